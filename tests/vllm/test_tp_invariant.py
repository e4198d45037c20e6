"""vLLM at TP 1 in TP-invariant mode (``RL_KERNEL_TP_INVARIANT=8``): the tiny Qwen3 of test_model.py built by real
vLLM runs its row-parallel linears (o_proj, down_proj) under rlk.gemm.tp.v1, and its log-probs over chunked prefill
and decode equal the training recompute whose row-parallel GEMMs run the same contract — the bits Megatron gives at
TP 1, 2 and 4 in the same mode (tests/megatron/test_megatron_tp_invariant.py) — and the hooked down_proj's bits are not
rlk.gemm.bi.v1's (negative control). Each row-parallel call is counted as ``linear_tp_partials`` in the readback."""

import pytest

from .test_model import ENV, SCRIPT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

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
    assert ops["linear_tp_partials"]["call_count"] == L * steps + (m == "ffn"), (m, ops)
    assert ops["linear_tp_partials"]["contract_id"] == "rlk.gemm.tp.v1"
    assert ops["linear"]["call_count"] == L * steps, (m, ops)  # qkv / gate_up: column-parallel, rlk.gemm.bi.v1
print("ok")
'''


def test_tiny_qwen3_rollout_at_tp_1_equals_the_tp_invariant_recompute(run_script):
    assert CUT in SCRIPT and SMALL in SCRIPT
    script = SCRIPT[:SCRIPT.index(CUT)].replace("CUSTOM_OPS", repr("none")).replace(SMALL, WIDE) + TAIL
    run_script(script, env={**ENV, "RL_KERNEL_TP_INVARIANT": "8"})
