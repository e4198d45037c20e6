"""TP-invariant mode in the real megatron-core on gloo (CPU): with ``RL_KERNEL_TP_INVARIANT=8`` the provider's
row-parallel linears run ``rlk.gemm.tp.v1`` (``linear_tp_partials`` + ``rlk_collectives.all_reduce_partials``), and
a whole Qwen3-shaped GPTModel gives the same per-token log-probs at TP 1, 2 and 4 — equal to the local trainer with
its row-parallel GEMMs under the same contract; without the mode TP 2 differs from TP 1 (negative control). The
readback of every rank names the op and the partials' merge with G (docs/ops/linear_tp.md)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model
from test_megatron_provider import MEGATRON_WARNINGS, R_ALL, local, run

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]

MODEL = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)  # hidden 64, vocab 128, ffn 128
LENGTHS = [8, 16, 8]
TIED = False
G = 8
INVARIANT = {**R_ALL, "RL_KERNEL_TP_INVARIANT": str(G)}


def invariant_run(tp: int) -> dict:
    return run(f"tpinv-tp{tp}", tp, 1, TIED, "thd", INVARIANT, lengths=LENGTHS, model=MODEL, all_readbacks=True)


def invariant_reference() -> torch.Tensor:
    """The local trainer (rlk-repro, TP 1) with its two row-parallel GEMMs (attention output, MLP down) under
    rlk.gemm.tp.v1 with G leaves (``linear_tp``); every other op as the local trainer runs it."""
    from rlk_core.ops import linear_tp
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model.ops import Ops

    cfg = _model.config(TIED, **MODEL)
    row_parallel = {"attention": (cfg.hidden_size, cfg.q_size), "ffn": (cfg.hidden_size, cfg.intermediate_size)}

    class TPInvariantOps(Ops):
        def linear(self, module, x, weight):
            if tuple(weight.shape) != row_parallel.get(module):
                return super().linear(module, x, weight)
            return linear_tp(x, weight, None, G)

    plan = RoutePlan.preset("consistency")
    ops = TPInvariantOps(plan, "train", ReadbackRecorder("local", "train", plan, mode="strict"))
    tr = Trainer(cfg, _model.weights(cfg), ops, device=torch.device("cpu"), dtype=torch.float32,
                 temperature=_model.TEMPERATURE)
    with torch.no_grad():
        return tr.forward_logprobs(_model.sequences(LENGTHS, cfg.vocab_size))


@pytest.mark.parametrize("tp", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_tp_1_2_4_give_the_same_log_probs_in_invariant_mode(tp):
    res = invariant_run(tp)
    ref = invariant_reference()
    assert torch.equal(res["logp"], ref), tp
    if tp > 1:
        assert torch.equal(res["logp"], invariant_run(1)["logp"])
    assert not torch.equal(ref, local(TIED, LENGTHS, **MODEL)[0])  # rlk.gemm.tp.v1 is its own arithmetic


def test_negative_control_without_invariant_mode_tp_2_differs_from_tp_1():
    off = run("tpinv-off-tp2", 2, 1, TIED, "thd", R_ALL, lengths=LENGTHS, model=MODEL)
    assert not torch.equal(off["logp"], local(TIED, LENGTHS, **MODEL)[0])
    assert not torch.equal(off["logp"], invariant_run(2)["logp"])


def test_every_rank_s_readback_names_the_contract_and_g():
    for r in invariant_run(2)["readbacks"]:
        mods = r["readback"]["modules"]
        for m in ("attention", "ffn"):
            ops = mods[m]["ops"]
            assert ops["linear_tp_partials"]["contract_id"] == "rlk.gemm.tp.v1", m
            assert ops["linear_tp_partials"]["call_count"] > 0
            want = {"world_size": 2, "leaves_total": G, "partials": "rlk.gemm.tp.v1"}
            assert want.items() <= ops["all_reduce"]["provenance"].items(), ops["all_reduce"]
