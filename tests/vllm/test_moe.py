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
import json, types, torch
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.plugins import load_general_plugins

load_general_plugins()
from rlk_vllm_plugin import moe
moe._wrap_execute_model = lambda: None  # Model Runner V2 does not import on the CPU: its step is played below
import vllm_tiny
from rlk_core.ops.moe.layer import moe_ffn
from rlk_repro.model import weights as W
from rlk_repro.model.config import PRESETS

cfg = PRESETS["qwen3-moe-tiny"]
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
vc, model = vllm_tiny.tiny_model(cfg, w)  # RL_KERNEL_VLLM_MOE_ROUTING=1: the load binds every router to the record
x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
want = []
for layer in range(cfg.num_hidden_layers):
    with set_current_vllm_config(vc), torch.no_grad(), set_forward_context(None, vc):
        model.model.layers[layer].mlp(x)
    p = f"layers.{layer}."
    want.append(moe_ffn(x, w[p + "router"], w[p + "w13"], w[p + "w2"], cfg.num_experts_per_tok,
                        cfg.norm_topk_prob)[1])
want = torch.stack(want, dim=1)  # [7, layers, k]
# one step of two requests as MRv2's InputBatch holds it: sample 1 of request 4 (3 prefill tokens at positions 0..2),
# then request 5 (4 tokens at positions 0..3), and vLLM's request ids ("<i>_<id>-<8>" for n > 1 samples)
batch = types.SimpleNamespace(num_tokens=7, num_reqs=2, req_ids=["1_4-0a1b2c3d", "5-9f8e7d6c"],
                              query_start_loc_np=[0, 3, 7], positions=torch.tensor([0, 1, 2, 0, 1, 2, 3]))
moe._RECORD[0].harvest(batch)
got = {str(moe.request_key(k)): v for k, v in moe.take_routing().items()}
out = {"keys": sorted(got), "equal": torch.equal(got["('4', 1)"], want[:3]) and torch.equal(got["('5', 0)"], want[3:]),
       "empty": not any(bool(v.any()) for v in got.values()), "warmup_key": moe.request_key("_warmup_0") is None,
       "again": moe.take_routing() == {}}
print(json.dumps(out))
print("ok")
"""


def _capture(run_script, ffn: str) -> dict:
    import json

    env = {"RL_KERNEL_FFN_CASE": ffn, "RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P",
           "RL_KERNEL_MODE": "strict", "RL_KERNEL_VLLM_MOE_ROUTING": "1"}
    return json.loads(run_script(CAPTURE, env=env).strip().splitlines()[-2])


def test_fused_moe_routing_record_holds_rlk_s_expert_ids_per_request_and_position(run_script):
    """``RL_KERNEL_VLLM_MOE_ROUTING=1``: the load binds every ``FusedMoE`` router's capture hook to the plugin's record;
    under ffn R the method feeds it rlk's ids, and a step (an MRv2 ``InputBatch``: request ids, query offsets,
    positions) files them per (request, sample) and position — equal to the reference's ids bitwise. Under P on the CPU
    vLLM's own monolithic CPU kernel selects the experts without calling the hook: the record holds zeros (the negative
    control: the ids come from the plugin's method; on CUDA vLLM's router calls the hook itself)."""
    r = _capture(run_script, "R/R")
    assert r["keys"] == ["('4', 1)", "('5', 0)"] and r["equal"] and r["warmup_key"] and r["again"], r
    p = _capture(run_script, "P/P")
    assert p["empty"] and not p["equal"], p
