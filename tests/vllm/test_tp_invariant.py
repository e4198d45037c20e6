"""vLLM in TP-invariant mode (``RL_KERNEL_TP_INVARIANT=8``).

- TP 1: the tiny Qwen3 of test_model.py built by real vLLM runs its row-parallel linears (o_proj, down_proj) under
  rlk.gemm.tp.v1, and its log-probs over chunked prefill and decode equal the training recompute whose row-parallel
  GEMMs run the same contract — the bits Megatron gives at TP 1, 2 and 4 in the same mode
  (tests/megatron/test_megatron_tp_invariant.py) — and the hooked down_proj's bits are not rlk.gemm.bi.v1's
  (negative control). Each row-parallel call is one op, counted as ``linear_tp`` in the readback (no
  ``linear_tp_partials``: the rounding is in the op).
- TP 2 and 4 (issue 35): real ``RowParallelLinear`` layers on vLLM's own process groups (gloo, 4 forked ranks,
  ``init_distributed_environment`` / ``initialize_model_parallel``) give ``linear_tp(x, w, bias, 8)``'s bits — the
  TP 1 result — on every rank, bias added once (or returned, ``skip_bias_add``), replicated input sliced by vLLM;
  without the mode (rlk.gemm.bi.v1 + rlk's all-reduce) and natively (vLLM's GEMM + all-reduce) they differ; a layer
  whose caller reduces (``reduce_results=False``) is refused; vLLM's SP / async-TP passes are refused. And the tiny
  Qwen3 (test_model.py's, 64 wide) built by vLLM's loader at TP 2 on 2 forked ranks: every rank's log-probs over
  chunked prefill and decode equal the TP 1 training recompute with rlk.gemm.tp.v1 row-parallel GEMMs.
"""

import pytest

from .test_model import ENV, SCRIPT

pytestmark = [pytest.mark.vllm, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]

SMALL = "hidden_size=64, intermediate_size=128"
# wider than test_model's model: at K = 64 / 128 the two K trees' fp32 differences vanish in the bf16 log-probs
WIDE = "hidden_size=1024, intermediate_size=2048"
CUT = 'assert torch.equal(roll, train(RoutePlan.preset("consistency"))), "rollout != train"'
TAIL = r'''
from rlk_core.ops import linear_tp
row_parallel = {"attention": (cfg.hidden_size, cfg.q_size), "ffn": (cfg.hidden_size, cfg.intermediate_size)}
class TPInvariantOps(Ops):
    def linear(self, module, x, weight):
        if tuple(weight.shape) != row_parallel.get(module):
            return super().linear(module, x, weight)
        return linear_tp(x, weight, None, 8)
def train_with(ops_cls):
    plan = RoutePlan.preset("consistency")
    ops = ops_cls(plan, "train", ReadbackRecorder("megatron", "train", plan))
    tr = Trainer(cfg, w, ops, device=torch.device("cpu"), dtype=torch.bfloat16, temperature=T)
    with torch.no_grad():
        return tr.forward_logprobs([seq])[:25]
assert torch.equal(roll, train_with(TPInvariantOps)), "rollout != the rlk.gemm.tp.v1 recompute"
# negative control at the layer (the bf16 log-probs of a 2-layer model may not move): vLLM's down_proj itself gives
# rlk.gemm.tp.v1's bits, which are not rlk.gemm.bi.v1's
from rlk_core.ops import linear
down = dict(model.named_modules())["model.layers.0.mlp.down_proj"]
xd = torch.randn(64, cfg.intermediate_size, generator=torch.Generator().manual_seed(5)).bfloat16()
yd = down(xd)[0]
assert torch.equal(yd, linear_tp(xd, down.weight, None, 8)), "down_proj != rlk.gemm.tp.v1"
assert not torch.equal(yd, linear(xd, down.weight)), "negative control: rlk.gemm.bi.v1 must differ"
mods = _runtime.current().recorder.to_dict()["modules"]
L, steps = cfg.num_hidden_layers, len(chunks)
for m in ("attention", "ffn"):
    ops = mods[m]["ops"]
    assert ops["linear_tp"]["call_count"] == L * steps + (m == "ffn"), (m, ops)
    assert ops["linear_tp"]["contract_id"] == "rlk.gemm.tp.v1"
    assert "linear_tp_partials" not in ops, (m, ops)  # one op at TP 1: partial and rounding together
    assert ops["linear"]["call_count"] == L * steps, (m, ops)  # qkv / gate_up: column-parallel, rlk.gemm.bi.v1
print("ok")
'''


def test_tiny_qwen3_rollout_at_tp_1_equals_the_tp_invariant_recompute(run_script):
    assert CUT in SCRIPT and SMALL in SCRIPT
    script = SCRIPT[:SCRIPT.index(CUT)].replace("CUSTOM_OPS", repr("none")).replace(SMALL, WIDE) + TAIL
    run_script(script, env={**ENV, "RL_KERNEL_TP_INVARIANT": "8"})


TP_SCRIPT = r'''
import os, torch, torch.multiprocessing as mp
import vllm.model_executor.layers.linear  # vLLM imported once here: the forked ranks share it
import vllm_tp
out = os.environ["RLK_TEST_TP_OUT"]
mp.start_processes(vllm_tp.rank_main, args=(4, out + "/init", out, (4, 2, 1)), nprocs=4, start_method="fork")
print("ok")
'''


def test_row_parallel_linears_at_tp_1_2_and_4_give_the_tp_1_bits(run_script, tmp_path):
    import torch

    from rlk_core.ops import linear_tp

    from .vllm_tp import LAYERS, G, inputs

    run_script(TP_SCRIPT, env={"RL_KERNEL_MODE": "strict", "RLK_TEST_TP_OUT": str(tmp_path)})
    for rank in range(4):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert sorted(res) == [1, 2, 4]
        for tp, by_plan in res.items():
            for name, (_, _, kw) in LAYERS.items():
                x, w, b = inputs(name)
                skip = kw.get("skip_bias_add", False)
                want = linear_tp(x, w, None if skip else b, G)  # TP 1, one process
                inv = by_plan["invariant"]
                assert inv["class." + name] == "RlkRowParallelLinear", (tp, name)
                assert inv[name].dtype == torch.bfloat16 and torch.equal(inv[name], want), (rank, tp, name)
                assert (inv["bias." + name] is None) == (not skip), (tp, name)
                if skip:
                    assert torch.equal(inv["bias." + name], b)
                for plan in ("bi", "native"):  # negative controls: vLLM's forward, rounded before its all-reduce
                    assert by_plan[plan]["class." + name] == "RowParallelLinear", (plan, tp, name)
                    if tp > 1:  # (at TP 1 one rounding either way: K = 256 / 512 trees may round alike)
                        assert not torch.equal(by_plan[plan][name], want), (plan, rank, tp, name)
            x, w, _ = inputs("o_proj")  # torch.compile(fullgraph=True), as vLLM compiles: the same bits
            assert torch.equal(by_plan["invariant"]["compiled.o_proj"], linear_tp(x, w, None, G)), (rank, tp)
            mods = by_plan["invariant"]["readback"]
            # o_proj: one eager call + the compiled call site (counted once, at trace); down_proj: two eager calls
            if tp == 1:  # the linear method runs linear_tp itself (one op): no merge
                assert {m: mods[m]["ops"]["linear_tp"]["call_count"] for m in ("attention", "ffn")} == {
                    "attention": 2, "ffn": 2}, mods
                assert not any("linear_tp_partials" in mods[m]["ops"] for m in ("attention", "ffn")), mods
                assert "all_reduce" not in mods["attention"]["ops"], mods
                continue
            assert "reduce_results=False" in by_plan["invariant"]["refusal"], by_plan["invariant"]["refusal"]
            for m, calls in (("attention", 2), ("ffn", 2)):  # the merge op runs (and counts) at every call
                ops = mods[m]["ops"]
                assert ops["linear_tp_partials"]["contract_id"] == "rlk.gemm.tp.v1", ops
                assert ops["linear_tp_partials"]["call_count"] == calls, ops
                want_ar = {"world_size": tp, "leaves_total": G, "partials": "rlk.gemm.tp.v1"}
                assert ops["all_reduce"]["call_count"] == calls, ops
                assert want_ar.items() <= ops["all_reduce"]["provenance"].items(), ops["all_reduce"]
                assert "linear" not in ops, ops  # no rlk.gemm.bi.v1 call in invariant mode


@pytest.mark.parametrize("passes", [("enable_sp",), ("fuse_gemm_comms", "enable_sp")])
@pytest.mark.parametrize("leaves", ["8", "off"])
def test_sequence_parallel_and_async_tp_passes_are_refused_at_tp_2(plugin, passes, leaves):
    from vllm.config import CompilationMode, VllmConfig, set_current_vllm_config

    from rlk_core.errors import RlkPolicyError
    from rlk_vllm_plugin import collectives

    rt = plugin(attention="R/R", ffn="R/R", RL_KERNEL_TP_INVARIANT=leaves)
    vc = VllmConfig()
    vc.parallel_config.tensor_parallel_size = 2
    vc.compilation_config.mode = CompilationMode.VLLM_COMPILE
    for name in passes:
        setattr(vc.compilation_config.pass_config, name, True)
    with set_current_vllm_config(vc):
        with pytest.raises(RlkPolicyError, match="-cc.pass_config.enable_sp=false -cc.pass_config.fuse_gemm_comms=f"):
            collectives.check_config(rt)
        vc.parallel_config.tensor_parallel_size = 1  # TP 1: vLLM itself turns both off; nothing to refuse
        collectives.check_config(rt)
        vc.parallel_config.tensor_parallel_size = 2
        vc.compilation_config.mode = CompilationMode.NONE  # enforce_eager: no compile pass runs
        collectives.check_config(rt)
        vc.compilation_config.mode = CompilationMode.VLLM_COMPILE
        for name in passes:
            setattr(vc.compilation_config.pass_config, name, False)
        collectives.check_config(rt)  # both off at TP 2: accepted


MODEL_TP2 = r'''
import os, torch, torch.multiprocessing as mp
import vllm.model_executor.layers.linear  # vLLM imported once here: the forked ranks share it
body = open(os.environ["RLK_TEST_TP_BODY"]).read()
def rank_main(r):
    torch.set_num_threads(1)
    exec(body.replace("RANK", str(r)), {"__name__": "rank"})
mp.start_processes(rank_main, nprocs=2, start_method="fork")  # raises if a rank failed
print("ok")
'''
RANK_TAIL = r'''
mods = _runtime.current().recorder.to_dict()["modules"]
L, steps = cfg.num_hidden_layers, len(chunks)
for m in ("attention", "ffn"):
    ops = mods[m]["ops"]
    assert ops["linear_tp_partials"]["call_count"] == L * steps, (m, ops)  # every o_proj / down_proj call
    assert ops["linear"]["call_count"] == L * steps, (m, ops)  # qkv / gate_up only: column-parallel, rlk.gemm.bi.v1
    want = {"world_size": 2, "leaves_total": 8, "partials": "rlk.gemm.tp.v1"}
    assert want.items() <= ops["all_reduce"]["provenance"].items(), (m, ops["all_reduce"])
print("rank RANK ok")
'''


def test_tiny_qwen3_rollout_at_tp_2_equals_the_tp_1_invariant_recompute(run_script, tmp_path):
    """Both ranks of a vLLM TP 2 model (heads, KV heads, vocabulary and every linear sharded by vLLM's own loader):
    the log-probs after vLLM's logits all-gather equal the single-process trainer's with rlk.gemm.tp.v1."""
    init = 'init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"file://{d}/dist", local_rank=0'
    assert CUT in SCRIPT and init in SCRIPT and "initialize_model_parallel(1, 1)" in SCRIPT
    tail = TAIL[:TAIL.index("# negative control at the layer")] + RANK_TAIL
    body = (SCRIPT[:SCRIPT.index(CUT)].replace("CUSTOM_OPS", repr("none"))
            .replace(init, f'init_distributed_environment(world_size=2, rank=RANK, distributed_init_method='
                           f'"file://{tmp_path}/dist", local_rank=RANK')
            .replace("initialize_model_parallel(1, 1)", "initialize_model_parallel(2, 1)") + tail)
    (tmp_path / "rank.py").write_text(body)
    run_script(MODEL_TP2, env={**ENV, "RL_KERNEL_TP_INVARIANT": "8", "RLK_TEST_TP_BODY": str(tmp_path / "rank.py")})
