"""The frameworks engine's attribution dump producers on the CPU (issue 38): real vLLM 0.22's ``Qwen3ForCausalLM``
(built by its model loader, rlk-vllm-plugin installed, a paged KV cache run through chunked prefill and decode, two
requests a step) and real megatron-core's ``GPTModel`` on gloo (:func:`rlk_repro.attribute_frameworks.megatron_dump`,
the trainer's recompute as its step runs it), the same weights and tokens on both, each dumped by
:mod:`rlk_repro.attribute_hooks` into ``rlk.attribution-dump.v1`` files that :func:`compare_dumps` walks.

R/R: every point both sides dump agrees bit for bit (the RoPE points are missing on Megatron's side: rlk's core
attention applies RoPE inside); an injected one-ulp difference on either side is named at exactly its point (the
positive control); Megatron's P/P stock modules against vLLM's R/R part in layer 0 with every earlier point
equal (the negative control); probe 2's comparison of vLLM's parameters with the trainer's export
finds every one equal, and one tensor one ulp off in the export. The replay around the producers (``LLM.generate``
and the weight sync on a GPU) runs in the sitting stage ``attribute``. Three subprocesses, 35-60 s on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
ROUTE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "RL_KERNEL_MODE",
              "RL_KERNEL_READBACK_DIR", "RL_KERNEL_RUN_ID", "VLLM_PLUGINS", "WORLD_SIZE", "VLLM_TARGET_DEVICE")
LAYERS = 2


def _script(body: str, env: dict[str, str], cwd: Path, *args: str) -> str:
    full = {k: v for k, v in os.environ.items() if k not in ROUTE_VARS}
    full.update({"PYTHONWARNINGS": "ignore", "TEST_MEGATRON_DIR": str(TESTS / "megatron"), **env})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body), *args], capture_output=True, text=True,
                          timeout=300, env=full, cwd=cwd)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc.stdout


def _plan(case: str) -> dict[str, str]:
    return {"RL_KERNEL_ATTENTION_CASE": case, "RL_KERNEL_FFN_CASE": case, "RL_KERNEL_LOGP_CASE": case,
            "RL_KERNEL_MODE": "strict"}


VLLM_DUMP = r'''
import os, sys, tempfile, torch
from vllm.plugins import load_general_plugins
load_general_plugins()
from rlk_vllm_plugin.attention import RlkAttentionMetadata, RlkAttentionImpl
from rlk_repro.model.config import PRESETS
from rlk_repro.model import weights as W
from rlk_repro.attribute_dumps import Dump, save_dump
from rlk_repro.attribute_hooks import HookTap, install_vllm, vllm_step_keys
from rlk_repro.attribute_local import Injection
cfg = PRESETS["tiny"]
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
d = tempfile.mkdtemp(); W.save_checkpoint(d, cfg, w)
from vllm.config import ModelConfig, VllmConfig, CompilationConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader import get_model_loader
mc = ModelConfig(model=d, skip_tokenizer_init=True, dtype=torch.bfloat16, enforce_eager=True)
vc = VllmConfig(model_config=mc, compilation_config=CompilationConfig(custom_ops=["none"], mode=0))
with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist", local_rank=0,
                                 backend="gloo")
    initialize_model_parallel(1, 1)
    model = get_model_loader(vc.load_config).load_model(vllm_config=vc, model_config=mc)
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 10)]  # prompt + response
prompt = [5, 7]
# steps: per request (start, count)
steps = [[(0, 5), (0, 4)], [(5, 1), (4, 3)], [(6, 1), (7, 1)], [(7, 1), (8, 1)]]
B, N = 8, 16
def run(tap):
    kv = {}
    for name, m in model.named_modules():
        if isinstance(getattr(m, "impl", None), RlkAttentionImpl):
            be = m.attn_backend
            shape = be.get_kv_cache_shape(B, N, m.impl.num_kv_heads, m.impl.head_size)
            order = be.get_kv_cache_stride_order()
            raw = torch.zeros(B * N * m.impl.num_kv_heads * 2 * m.impl.head_size, dtype=torch.bfloat16)
            m.kv_cache = kv[name] = raw.view([shape[i] for i in order]).permute(*[order.index(i) for i in range(4)])
    bt = torch.tensor([[5, 2, 7, 0], [1, 3, 4, 6]], dtype=torch.int32)
    for step in steps:
        ids, pos, slots, qsl, lens = [], [], [], [0], []
        for r, (a, n) in enumerate(step):
            ids += seqs[r][a:a + n]; pos += list(range(a, a + n))
            slots += [int(bt[r, p // N]) * N + p % N for p in range(a, a + n)]
            qsl.append(qsl[-1] + n); lens.append(a + n)
        md = RlkAttentionMetadata(num_actual_tokens=len(ids), num_reqs=len(step), max_query_len=max(n for _, n in step),
                                  query_start_loc=torch.tensor(qsl, dtype=torch.int32),
                                  seq_lens=torch.tensor(lens, dtype=torch.int32), block_table=bt,
                                  slot_mapping=torch.tensor(slots, dtype=torch.int64))
        tap.begin(*vllm_step_keys([0, 1], qsl, pos))
        sl = torch.tensor(slots, dtype=torch.int64)
        ctx = set_forward_context({n: md for n in kv}, vc, slot_mapping={n: sl for n in kv})
        with set_current_vllm_config(vc), ctx, torch.no_grad():
            h = model(torch.tensor(ids), torch.tensor(pos))
            logits = model.compute_logits(h[torch.tensor(qsl[1:]) - 1])
        tap.end()
        for r, (a, n) in enumerate(step):  # the plugin's log-prob op, as vLLM's sampler calls it, where a token follows
            last = a + n - 1
            if last >= prompt[r] - 1 and last + 1 < len(seqs[r]):
                row = logits[r:r + 1]
                tok = logprobs._STEP.set({"logits": row, "temperature": torch.ones(1), "kept": None})
                try:
                    got = logprobs.token_logprobs_hook(row, torch.tensor([[seqs[r][last + 1]]]))[0, 0]
                finally:
                    logprobs._STEP.reset(tok)
                sampled[r].append(float(got))
# probe 2's comparison: vLLM's parameters against the export they were loaded from, and one bf16 ulp off in one
from rlk_repro.attribute_frameworks import vllm_weights_check
hf = W.to_hf(cfg, w)
check = vllm_weights_check(model, hf.items())
assert check["equal"] == len(dict(model.named_parameters())) and not check["differ"], check
assert not check["missing_in_export"] and not check["not_in_vllm"] and check["fp8_layers"] == 0, check
name = "model.layers.1.self_attn.v_proj.weight"
off = dict(hf, **{name: torch.nextafter(hf[name], torch.full_like(hf[name], float("inf")))})
bad = vllm_weights_check(model, off.items())
assert bad["differ"] == ["model.layers.1.self_attn.qkv_proj.weight"], bad
assert bad["export_sha256"] != check["export_sha256"] and bad["vllm_sha256"] == check["vllm_sha256"]
out = sys.argv[1]
import json
from rlk_vllm_plugin import logprobs
for name, inj in (("rollout", None), ("rollout-injected", Injection.parse(os.environ["INJECT"]))):
    sampled = [[], []]
    dump = Dump("rollout")
    tap = HookTap("rollout", dump, {0, 1}, inj)
    assert install_vllm(tap, model) == cfg.num_hidden_layers
    run(tap)
    tap.remove()
    assert tap.layers_seen == cfg.num_hidden_layers and (inj is None or tap.injected)
    save_dump(dump, f"{out}/{name}.safetensors")
    assert [len(x) for x in sampled] == [4, 3]
    json.dump({"logprobs": sampled, "check": check}, open(f"{out}/{name}.json", "w"))
    print(name, len(dump.points), sorted(dump.ops.get("layers.0.attention.core", ())))
print("ok")
'''

MEGATRON_DUMP = r'''
import json, os, sys, torch
sys.path.insert(0, os.environ['TEST_MEGATRON_DIR'])
from _cpu import gloo_world_of_one
gloo_world_of_one()
from rlk_repro.engine.frameworks_megatron import MegatronTrainer, init_model_parallel
from rlk_repro.engine.trainer import Sample
from rlk_repro.model.config import PRESETS
from rlk_repro.model import weights as W
from rlk_repro.attribute_dumps import save_dump
from rlk_repro.attribute_frameworks import megatron_dump
from rlk_repro.attribute_local import Injection
cfg = PRESETS["tiny"]
w = W.random_weights(cfg, seed=3, dtype=torch.bfloat16)
init_model_parallel(1, 0)
tr = MegatronTrainer(cfg, w, tp=1, rank=0, device=torch.device("cpu"), dtype=torch.bfloat16, temperature=1.0,
                     optimizer="adamw", lr=1e-3, micro_tokens=8192)
g = torch.Generator().manual_seed(0)
seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 10)]
samples = [Sample(q[:p], q[p:], [], 0.0) for q, p in zip(seqs, (5, 7))]
out, tag = sys.argv[1], sys.argv[2]
inj = os.environ.get("INJECT")
for name, i in ((tag, None),) + (((tag + "-injected", Injection.parse(inj)),) if inj else ()):
    dump, lp, tap = megatron_dump(tr, samples, {0, 1}, i)
    assert tap.layers_seen == cfg.num_hidden_layers and (i is None or tap.injected)
    assert [len(x) for x in lp] == [4, 3]
    save_dump(dump, f"{out}/{name}.safetensors")
    json.dump({"logprobs": [x.tolist() for x in lp]}, open(f"{out}/{name}.json", "w"))
    print(name, len(dump.points), sorted(dump.ops.get("layers.0.attention.core", ())), tr.r_attention, tr.r_logp)
assert all(p.grad is None for p in tr.params.values())
print("ok")
'''


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """The five dumps: vLLM R/R (plain, injected at layer 1's ffn.gate_up), Megatron R/R (plain, injected at layer
    0's attention.o_proj), Megatron P/P."""
    from rlk_repro.attribute_dumps import load_dump

    out = tmp_path_factory.mktemp("attribution-dumps")
    _script(VLLM_DUMP, {**_plan("R/R"), "RLK_TEST_VLLM_CPU_PLATFORM": "1",
                        "RL_KERNEL_VLLM_ATTENTION_OVERRIDE": "CPU_ATTN", "INJECT": "rollout:1:ffn.gate_up"},
            out, str(out))
    _script(MEGATRON_DUMP, {**_plan("R/R"), "CUDA_VISIBLE_DEVICES": "", "INJECT": "train:0:attention.o_proj"}, out,
            str(out), "train")
    _script(MEGATRON_DUMP, {**_plan("P/P"), "CUDA_VISIBLE_DEVICES": ""}, out, str(out), "train-pp")
    got = {p.stem: load_dump(p) for p in out.glob("*.safetensors")}
    got["json"] = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    return got


@pytest.mark.vllm
@pytest.mark.megatron
def test_rr_vllm_and_megatron_dumps_agree_bitwise_at_every_point(dumps):
    from rlk_repro.attribute_dumps import compare_dumps

    c = compare_dumps(dumps["train"], dumps["rollout"], LAYERS)
    rope = [f"layers.{i}.attention.rope_{x}" for i in range(LAYERS) for x in "qk"]
    assert sorted(c["missing"]) == sorted([*rope, "final.logprobs"])  # the taps dump no sampler log-probs
    assert len(c["points"]) == LAYERS * 12 + 3 and all(p["equal"] for p in c["points"]), \
        [(p["point"], p.get("max_abs_diff")) for p in c["points"] if not p["equal"]]
    assert c["boundary"] is None
    by = {p["point"]: p for p in c["points"]}
    assert by["final.logits"]["rows"] == 7 and by["layers.0.residual_in"]["rows"] == 17  # both requests' rows
    assert by["layers.0.attention.core"]["train_ops"] == ["megatron.RlkCoreAttention"]
    assert by["layers.0.attention.core"]["rollout_ops"] == ["vllm.RlkAttentionImpl"]


@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.parametrize("train, rollout, point", [("train-injected", "rollout", "layers.0.attention.o_proj"),
                                                   ("train", "rollout-injected", "layers.1.ffn.gate_up")])
def test_an_injected_ulp_is_named_at_its_point(dumps, train, rollout, point):
    from rlk_repro.attribute_dumps import compare_dumps

    b = compare_dumps(dumps[train], dumps[rollout], LAYERS)["boundary"]
    assert b is not None and b["point"] == point and b["mismatches"] > 0


@pytest.mark.vllm
@pytest.mark.megatron
def test_pp_megatron_against_rr_vllm_parts_in_layer_0(dumps):
    from rlk_repro.attribute_dumps import compare_dumps

    c = compare_dumps(dumps["train-pp"], dumps["rollout"], LAYERS)
    b = c["boundary"]
    assert b is not None and b["point"].startswith("layers.0.") and b["mismatches"] > 0
    before = [p for p in c["points"]][: [p["point"] for p in c["points"]].index(b["point"])]
    assert before and all(p["equal"] for p in before)
    assert "megatron.DotProductAttention" in c["points"][[p["point"] for p in c["points"]].index(
        "layers.0.attention.core")]["train_ops"]
    growth = [g for g in c["residual_growth"] if g["point"] != "layers.0.residual_in"]
    assert growth and not any(g["equal"] for g in growth)  # the difference is carried through the stack


def _replay(dumps, train: str):
    """The frameworks replay the probes read (:func:`attribute_frameworks.assemble`), from these dumps, the rollout's
    log-probs (the plugin's log-prob op on vLLM's logits), the trainer's, and probe 2's comparison; its train-data
    records those same log-probs (what the run would have written), so probe 0 holds by construction here — the
    checks are of the probes after it on frameworks dumps."""
    import torch

    from rlk_core.plan import RoutePlan
    from rlk_repro import runs
    from rlk_repro.attribute_frameworks import assemble
    from rlk_repro.engine.frameworks import FrameworksRunConfig
    from rlk_repro.engine.trainer import Sample
    from rlk_repro.model import qwen3
    from rlk_repro.model import weights as W
    from rlk_repro.model.config import PRESETS

    cfg = PRESETS["tiny"]
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (9, 10)]
    roll, tr = dumps["json"]["rollout"], dumps["json"][train]
    samples = [Sample(q[:p], q[p:], lp, 0.0) for q, p, lp in zip(seqs, (5, 7), roll["logprobs"], strict=True)]
    td = {"token_ids": torch.zeros(2, 10, dtype=torch.long), "response_mask": torch.zeros(2, 10, dtype=torch.bool),
          "rollout_logprobs": torch.zeros(2, 10), "train_logprobs": torch.zeros(2, 10)}
    for i, (q, p) in enumerate(zip(seqs, (5, 7), strict=True)):
        td["token_ids"][i, :len(q)] = torch.tensor(q)
        td["response_mask"][i, p:len(q)] = True
        td["rollout_logprobs"][i, p:len(q)] = torch.tensor(roll["logprobs"][i])
        td["train_logprobs"][i, p:len(q)] = torch.tensor(tr["logprobs"][i])
    plan = RoutePlan("R/R", "R/R", "R/R")
    man = {"run_id": "cpu", "engine": "frameworks", "plan": plan.as_dict(),
           "sampling": runs.sampling_semantics(1.0, 0, 1.0, 0.0, "processed", "processed")}
    fcfg = FrameworksRunConfig(device="cuda", plan=plan, temperature=1.0)
    head = qwen3.lm_head_weight(W.random_weights(cfg, seed=3, dtype=torch.bfloat16))
    return assemble(Path("cpu-run"), man, fcfg, cfg, 0, {"source": "checkpoint", "recorded": "h", "loaded": "h",
                                                          "what": "test"}, td, [0, 1], samples, dumps[train],
                    [torch.tensor(x) for x in tr["logprobs"]], dumps["rollout"], head,
                    {"vllm": roll["check"], "quantization": "none"}, {"rollout": LAYERS, "train": LAYERS}, False, [])


@pytest.mark.vllm
@pytest.mark.megatron
@pytest.mark.parametrize("train, kind", [("train", "no_boundary"), ("train-pp", "boundary")])
def test_the_probes_and_verdict_on_frameworks_dumps(dumps, train, kind):
    """R/R: probes 1-4 pass on the frameworks dumps (identity, weights, logits and log-probs bitwise), 5 and 6 trivial,
    no boundary. Megatron P/P: the logits differ (probe 3 fails, not blocking) and the verdict names the walk's first
    differing point."""
    from rlk_repro.attribute import markdown, report

    doc, _ = report(_replay(dumps, train), repeats=1)
    status = {p["id"]: p["status"] for p in doc["probes"]}
    assert [status[i] for i in (0, 1, 2, 5, 6)] == ["pass", "pass", "pass", "trivial", "trivial"], doc["probes"]
    assert doc["verdict"]["kind"] == kind, doc["verdict"]
    if kind == "no_boundary":
        assert status[3] == status[4] == "pass" and doc["positions_compared"] == 7
    else:
        assert status[3] == "fail" and doc["verdict"]["boundary"]["point"] == doc["layers"]["boundary"]["point"]
        assert doc["verdict"]["boundary"]["layer"] == 0
    assert "Verdict" in markdown(doc)
