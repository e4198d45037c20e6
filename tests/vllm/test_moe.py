"""Issue 36: vLLM's ``FusedMoE`` under the plugin, on real vLLM classes on the CPU — a Qwen3-MoE checkpoint written by
the local engine (per expert, as the Hub's), loaded by vLLM's own model loader, its ``Qwen3MoeSparseMoeBlock`` run:
under ffn R the out-of-tree ``UnquantizedFusedMoEMethod`` computes rlk's block (the trainer's bits); under P vLLM's
own fused MoE runs, counted, and differs (the negative control)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

SCRIPT = """
import json, torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.plugins import load_general_plugins

load_general_plugins()
import vllm_tiny
from rlk_core.ops.moe.layer import moe_ffn
from rlk_repro.model import weights as W
from rlk_repro.model.config import PRESETS
from rlk_vllm_plugin import _runtime

cfg = PRESETS["qwen3-moe-tiny"]
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
vc, model = vllm_tiny.tiny_model(cfg, w)
out = {}
def routed(mlp):  # the FusedMoE layer: mlp.experts on 0.22; 0.33's MoERunner holds it as routed_experts
    return getattr(mlp.experts, "routed_experts", mlp.experts)


for layer in range(cfg.num_hidden_layers):
    mlp = model.model.layers[layer].mlp
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(layer)).to(torch.bfloat16)
    with set_current_vllm_config(vc), torch.no_grad(), set_forward_context(None, vc):
        y = mlp(x)
        alone = mlp(x[3:4])
    p = f"layers.{layer}."
    ref, _ = moe_ffn(x, w[p + "router"], w[p + "w13"], w[p + "w2"], cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out[layer] = {"equal": torch.equal(y, ref), "close": bool(torch.allclose(y.float(), ref.float(), atol=1e-3)),
                  "alone_equal": torch.equal(alone[0], y[3]),
                  "weights_as_loaded": torch.equal(routed(mlp).w13_weight, w[p + "w13"])}
method = routed(model.model.layers[0].mlp).quant_method
out["method"] = type(method).__name__
out["ffn"] = _runtime.get().recorder.to_dict()["modules"]["ffn"]
print(json.dumps(out))
print("ok")
"""


def _run(run_script, ffn: str) -> dict:
    import json

    env = {"RL_KERNEL_FFN_CASE": ffn, "RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P",
           "RL_KERNEL_MODE": "strict"}
    return json.loads(run_script(SCRIPT, env=env).strip().splitlines()[-2])


def test_fused_moe_under_ffn_r_is_rlk_s_block_bitwise(run_script):
    out = _run(run_script, "R/R")
    assert out["method"] == "RlkUnquantizedFusedMoEMethod"
    for layer in ("0", "1"):
        assert out[layer]["equal"] and out[layer]["alone_equal"] and out[layer]["weights_as_loaded"], out[layer]
    ops = out["ffn"]["ops"]
    for op in ("moe_topk", "moe_grouped_linear", "moe_combine"):
        assert ops[op]["contract_id"] == "rlk.moe.v1" and ops[op]["backend_id"].startswith("rlk."), op
    assert ops["moe_grouped_linear"]["call_count"] == 2 * ops["moe_topk"]["call_count"] > 0
    assert out["ffn"]["implementation"] == "rlk" and not out["ffn"]["fallback"]


def test_fused_moe_under_ffn_p_is_vllm_s_own_and_the_negative_control(run_script):
    out = _run(run_script, "P/P")
    assert out["method"] == "RlkUnquantizedFusedMoEMethod"  # installed for every plan: it counts P calls
    assert not any(out[layer]["equal"] for layer in ("0", "1"))  # vLLM's fused MoE: other bits than rlk's
    assert all(out[layer]["close"] for layer in ("0", "1"))  # the same block
    ops = out["ffn"]["ops"]
    assert ops["moe_grouped_linear"]["backend_id"] == "production.vllm.UnquantizedFusedMoEMethod"
    assert out["ffn"]["implementation"] == "production"


CAPTURE = """
import dataclasses, json, types, torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.plugins import load_general_plugins

load_general_plugins()
from vllm.v1.worker.gpu.input_batch import InputBatch
from rlk_vllm_plugin import moe
moe._wrap_execute_model = lambda: None  # 0.22's Model Runner V2 does not import on the CPU: its step is played below
import vllm_tiny
from rlk_core.ops.moe import moe_topk
from rlk_core.ops.moe.layer import moe_ffn
from rlk_repro.engine.routing import routing_metrics
from rlk_repro.model import weights as W
from rlk_repro.model.config import PRESETS

cfg = PRESETS["qwen3-moe-tiny"]
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
vc, model = vllm_tiny.tiny_model(cfg, w)  # RL_KERNEL_VLLM_MOE_ROUTING=1: the load binds every layer's hooks


def step(n):  # one step of two requests as MRv2's InputBatch holds it: sample 1 of request 4 (3 prefill tokens at
    # positions 0..2), then request 5 (n - 3 tokens at positions 0..n-4), with vLLM's request ids ("<i>_<id>-<8>")
    fields = {"num_tokens", "num_reqs", "req_ids", "query_start_loc_np", "positions"}
    assert fields <= {f.name for f in dataclasses.fields(InputBatch)}, "MRv2 InputBatch fields"
    moe._RECORD[0].harvest(types.SimpleNamespace(num_tokens=n, num_reqs=2, req_ids=["1_4-0a1b2c3d", "5-9f8e7d6c"],
                                                 query_start_loc_np=[0, 3, n],
                                                 positions=torch.tensor([0, 1, 2, *range(n - 3)])))
    got = {str(moe.request_key(k)): v for k, v in moe.take_routing().items()}
    return got, torch.cat([got["('4', 1)"], got["('5', 0)"]]) if sorted(got) == ["('4', 1)", "('5', 0)"] else None


def report(got, rows, want):
    return {"keys": sorted(got), "equal": rows is not None and torch.equal(rows, want),
            "format": rows is not None and rows.dtype == torch.int64 and list(rows.shape) == list(want.shape),
            "empty": not any(bool(v.any()) for v in got.values()),
            "metrics": routing_metrics([rows], [want]) if rows is not None else None}
"""

FORWARD = CAPTURE + """
x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
want = []
for layer in range(cfg.num_hidden_layers):
    with set_current_vllm_config(vc), torch.no_grad(), set_forward_context(None, vc):
        model.model.layers[layer].mlp(x)
    p = f"layers.{layer}."
    want.append(moe_ffn(x, w[p + "router"], w[p + "w13"], w[p + "w2"], cfg.num_experts_per_tok,
                        cfg.norm_topk_prob)[1])
got, rows = step(7)
out = {**report(got, rows, torch.stack(want, dim=1)),  # [7, layers, k]
       "warmup_key": moe.request_key("_warmup_0") is None, "again": moe.take_routing() == {}}
print(json.dumps(out))
print("ok")
"""


def _capture(run_script, ffn: str, script: str = FORWARD) -> dict:
    import json

    env = {"RL_KERNEL_FFN_CASE": ffn, "RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P",
           "RL_KERNEL_MODE": "strict", "RL_KERNEL_VLLM_MOE_ROUTING": "1"}
    return json.loads(run_script(script, env=env).strip().splitlines()[-2])


ZERO = {"routing_compared_tokens": 7, "routing_mismatch_tokens": 0, "routing_mismatch_fraction": 0.0,
        "routing_mismatch_layer_tokens": 0}


def test_fused_moe_routing_record_holds_rlk_s_expert_ids_per_request_and_position(run_script):
    """``RL_KERNEL_VLLM_MOE_ROUTING=1``: the load binds every ``FusedMoE``'s capture hook to the plugin's record (0.22:
    the router's ``capture_fn``; 0.33: the routed experts' ``routing_sink``, what a monolithic method reports
    through); under ffn R the method feeds it rlk's ids, and a step (an MRv2 ``InputBatch``: request ids, query
    offsets, positions) files them per (request, sample) and position — equal to the reference's ids bitwise, in the
    one format (``[positions, layers, k]`` int64) that the routing metric reads: 0 of 7 tokens differ. Runs on 0.22 and
    0.33 alike."""
    r = _capture(run_script, "R/R")
    assert r["keys"] == ["('4', 1)", "('5', 0)"] and r["equal"] and r["format"], r
    assert r["warmup_key"] and r["again"] and not r["empty"] and r["metrics"] == ZERO, r


def test_fused_moe_routing_record_under_p_on_the_cpu_is_empty_the_negative_control(run_script):
    """Under P on the CPU, vLLM 0.22's own monolithic CPU kernel selects the experts without calling the hook: the
    record holds zeros (the ids of the R test come from the plugin's method; on CUDA vLLM's router calls the hook
    itself). Not run on 0.33 (scripts/test-vllm-033.sh): its CPU fused MoE needs a compiled op the CUDA wheel lacks;
    the next test is 0.33's negative control."""
    p = _capture(run_script, "P/P")
    assert p["empty"] and not p["equal"] and p["metrics"]["routing_mismatch_tokens"] > 0, p


ROUTER = CAPTURE + """
# vLLM's own router of each layer (what a modular method's MoERunner calls: the P route), driven with router logits
# where 3 rows hold exact ties at the k boundary (experts tied for the last slot; rlk's top-k takes the lower id) and
# 4 rows are distinct
logits = torch.zeros(7, cfg.num_experts, dtype=torch.bfloat16)
logits[0, 5], logits[0, [1, 6]] = 2, 1
logits[1, 0], logits[1, [3, 7]] = 2, 1
logits[2, 4] = 2
g = torch.Generator().manual_seed(1)
logits[3:] = torch.stack([torch.randperm(cfg.num_experts, generator=g) for _ in range(4)]).to(torch.bfloat16) / 2
x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
vllm_ids = []
for layer in range(cfg.num_hidden_layers):
    router = model.model.layers[layer].mlp.experts.router  # 0.22: FusedMoE.router; 0.33: MoERunner.router
    with set_current_vllm_config(vc), torch.no_grad(), set_forward_context(None, vc):
        vllm_ids.append(router.select_experts(hidden_states=x, router_logits=logits)[1].to(torch.int64))
got, rows = step(7)
rlk_ids = moe_topk(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)[1].to(torch.int64)
rlk = torch.stack([rlk_ids] * cfg.num_hidden_layers, dim=1)
out = {"vllm": report(got, rows, torch.stack(vllm_ids, dim=1)), "rlk": report(got, rows, rlk),
       "rlk_distinct": routing_metrics([rows[3:]], [rlk[3:]]), "router": type(router).__name__}
print(json.dumps(out))
print("ok")
"""


def _cpu_router() -> tuple[bool, str]:
    import importlib.util
    from pathlib import Path

    vllm = Path(importlib.util.find_spec("vllm").origin).parent  # read, not imported: collection stays light
    ok = (vllm / "model_executor/layers/fused_moe/router/cpu_router.py").is_file()
    return ok, "this vLLM has no CPU router (0.22's FusedTopKRouter runs torch.ops._moe_C.topk_softmax, compiled " \
               "for CUDA only); its hook is covered by the tests above"


@pytest.mark.skipif(not _cpu_router()[0], reason=_cpu_router()[1])
def test_fused_moe_routing_record_takes_vllm_s_router_ids_and_sees_its_ties(run_script):
    """The router hook the record binds (the P route of a modular method, vLLM 0.33's CPU ``MoERunner``; on CUDA also
    0.22's): vLLM's own router, run on each layer, fills the record with exactly the ids it returned; against rlk's
    top-k of the same logits the routing metric finds no difference on distinct logits and a difference on exact ties
    (vLLM's ``torch.topk`` takes another tied expert than rlk's lower id: the negative control of the R test on 0.33,
    the same check failing on the native path)."""
    out = _capture(run_script, "R/R", ROUTER)
    assert out["router"] == "CPURouter" and out["vllm"]["equal"] and out["vllm"]["format"], out
    assert out["vllm"]["metrics"]["routing_mismatch_tokens"] == 0, out
    assert out["rlk_distinct"]["routing_mismatch_tokens"] == 0, out
    assert not out["rlk"]["equal"] and 0 < out["rlk"]["metrics"]["routing_mismatch_tokens"] <= 3, out
