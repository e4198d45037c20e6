"""TP-invariant mode in the real megatron-core on gloo (CPU): with ``RL_KERNEL_TP_INVARIANT=8`` the provider's
row-parallel linears run ``rlk.gemm.tp.v1`` (``linear_tp_partials`` + ``rlk_collectives.all_reduce_partials``), and
a whole Qwen3-shaped GPTModel gives the same per-token log-probs at TP 1, 2, 4 (and 8, with 8 KV heads) — equal to
the local trainer with its row-parallel GEMMs under the same contract; every gradient (every rank's, gathered to the
full shapes, after megatron-core's own TP finalize of the q/k-norm grads) is the same at TP 1, 2, 4, 8 (the
column-parallel input gradient and the norms' weight gradients of ``rlk_megatron_provider.tp_grads``); without the
mode TP 2 differs from TP 1, log-probs and gradients (negative control). The readback of every rank names the op
and the partials' merge with G (docs/ops/linear_tp.md). Sequence parallelism in invariant mode gives the same
log-probs and gradients as TP 1 without it; without invariant mode it is refused (and so is train TP != rollout TP
in the provider's install)."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model
from test_megatron_provider import MEGATRON_WARNINGS, R_ALL, local, run

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]

MODEL = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)  # hidden 64, vocab 128, ffn 128
LENGTHS = [8, 16, 12]  # 36 tokens: the norms cut them into gcd(36, 8) = 4 leaves (SP at TP 4: one per rank)
TIED = False
G = 8
INVARIANT = {**R_ALL, "RL_KERNEL_TP_INVARIANT": str(G)}


def invariant_run(tp: int) -> dict:
    return run(f"tpinv-tp{tp}", tp, 1, TIED, "thd", INVARIANT, backward=True, lengths=LENGTHS, model=MODEL,
               all_readbacks=True)


def off_run(tp: int) -> dict:
    return run(f"tpinv-off-tp{tp}", tp, 1, TIED, "thd", R_ALL, backward=True, lengths=LENGTHS, model=MODEL)


def full_grads(res: dict) -> dict:
    """Every TP rank's gradients gathered to the local trainer's full shapes (exact: slices and concatenations)."""
    from rlk_megatron_provider.weights import from_megatron

    return from_megatron(_model.config(TIED, **MODEL), res["tp_grads"])


def differing(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b)
    return [k for k in a if not torch.equal(a[k], b[k])]


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


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_gradient_at_tp_2_4_equals_tp_1_in_invariant_mode(tp):
    want = full_grads(invariant_run(1))
    got = full_grads(invariant_run(tp))
    assert len(want) == 2 + 8 * _model.config(TIED, **MODEL).num_hidden_layers + (not TIED)
    assert differing(got, want) == []
    assert all(bool(g.abs().sum() > 0) for g in want.values())  # no gradient is trivially zero


MODEL8 = dict(num_attention_heads=8, num_key_value_heads=8, head_dim=8)  # 8 KV heads: TP 8 (one head per rank)


@pytest.mark.slow
def test_tp_8_log_probs_and_every_gradient_equal_tp_1_in_invariant_mode():
    """TP 8 = G: every rank holds one leaf of every row-parallel K, one leaf of every column component, one head."""
    from rlk_megatron_provider.weights import from_megatron

    cfg = _model.config(TIED, **MODEL8)
    tp1, tp8 = (run(f"tpinv8-tp{tp}", tp, 1, TIED, "thd", INVARIANT, backward=True, lengths=LENGTHS, model=MODEL8)
                for tp in (1, 8))
    assert torch.equal(tp8["logp"], tp1["logp"])
    assert differing(from_megatron(cfg, tp8["tp_grads"]), from_megatron(cfg, tp1["tp_grads"])) == []


@pytest.mark.slow
def test_tp_2_cp_2_log_probs_equal_tp_1_in_invariant_mode():
    """CP 2 x TP 2 (zigzag THD shards, K/V gathered by rlk's CP transport): the log-probs of TP 1. (Not the gradients:
    CP splits the tokens of every weight gradient and megatron-core sums the CP ranks' like data parallelism.)"""
    res = run("tpinv-tp2-cp2", 2, 2, TIED, "thd", INVARIANT, lengths=LENGTHS, model=MODEL)
    assert torch.equal(res["logp"], invariant_run(1)["logp"])
    assert "cp_all_gather" in res["readback"]["modules"]["attention"]["ops"]


def test_invariant_mode_gradients_are_their_own_arithmetic():
    """At TP 1 the column-parallel input gradients (a leaf tree over N, not rlk.gemm.bi.v1's order) and the q/k-norm
    weight gradients (a tree over head leaves, not one sum over the rows) are other bits than without the mode, and
    so is everything below them."""
    mine = full_grads(invariant_run(1))
    plain = full_grads(off_run(1))
    assert {"layers.0.qkv", "layers.0.q_norm", "layers.0.k_norm", "embed"} <= set(differing(mine, plain))


def test_negative_control_without_invariant_mode_tp_2_differs_from_tp_1():
    off = off_run(2)
    assert not torch.equal(off["logp"], local(TIED, LENGTHS, **MODEL)[0])
    assert not torch.equal(off["logp"], invariant_run(2)["logp"])
    assert not torch.equal(off["logp"], off_run(1)["logp"])
    # every gradient below the last MLP's down projection sees TP 2's different sums
    assert {"layers.0.qkv", "layers.0.q_norm", "layers.1.q_norm", "layers.0.gate_up", "embed"} <= set(
        differing(full_grads(off), full_grads(off_run(1))))


def sp_run(tp: int) -> dict:
    return run(f"tpinv-sp-tp{tp}", tp, 1, TIED, "thd", INVARIANT, backward=True, lengths=LENGTHS, model=MODEL,
               all_readbacks=True, sequence_parallel=True)


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_sequence_parallel_gives_the_bits_of_tp_1_without_it(tp):
    """Megatron's --sequence-parallel in invariant mode: the row-parallel merge reduce-scattered over the tokens by
    the same tree, the column-parallel input all-gathered and its gradient reduce-scattered, the norms' weight
    gradients over token leaves merged over the ranks: log-probs (every path) and every gradient == TP 1 without SP."""
    res, want = sp_run(tp), invariant_run(1)
    for key in ("logp", "logp_nograd", "logp_logits", "logp_vime", "logp_gathered_vocab"):
        assert torch.equal(res[key], want["logp"]), key
    assert differing(full_grads(res), full_grads(want)) == []
    for r in res["readbacks"]:  # SP really ran: the partials were reduce-scattered, the tokens gathered
        for m in ("attention", "ffn"):
            ops = r["readback"]["modules"][m]["ops"]
            want_rs = {"world_size": tp, "leaves_total": G, "partials": "rlk.gemm.tp.v1"}
            assert want_rs.items() <= ops["reduce_scatter"]["provenance"].items(), ops["reduce_scatter"]
            assert ops["all_gather"]["call_count"] > 0


def test_sequence_parallel_without_invariant_mode_is_refused(monkeypatch):
    from rlk_megatron_provider import layers, spec

    cfg = types.SimpleNamespace(sequence_parallel=True, normalization="RMSNorm", gated_linear_unit=True,
                                activation_func=torch.nn.functional.silu)
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    msg = "sequence_parallel=True is covered in TP-invariant mode only (set RL_KERNEL_TP_INVARIANT)"
    assert msg in layers.linear_problems(types.SimpleNamespace(), cfg)
    assert all(msg in p for p in spec.model_problems(cfg).values())
    monkeypatch.setenv("RL_KERNEL_TP_INVARIANT", str(G))
    assert layers.linear_problems(types.SimpleNamespace(), cfg) == []
    assert not any(msg in p for p in spec.model_problems(cfg).values())


def test_every_rank_s_readback_names_the_contract_and_g():
    for r in invariant_run(2)["readbacks"]:
        mods = r["readback"]["modules"]
        for m in ("attention", "ffn"):
            ops = mods[m]["ops"]
            assert ops["linear_tp_partials"]["contract_id"] == "rlk.gemm.tp.v1", m
            assert ops["linear_tp_partials"]["call_count"] > 0
            want = {"world_size": 2, "leaves_total": G, "partials": "rlk.gemm.tp.v1"}
            assert want.items() <= ops["all_reduce"]["provenance"].items(), ops["all_reduce"]


def test_install_refuses_train_tp_other_than_rollout_tp_without_invariant_mode(provider, monkeypatch):
    """slime's / VIME's args name both TPs: strict mode refuses TP 4 training with TP 1 rollout engines unless
    RL_KERNEL_TP_INVARIANT is set, saying what to set; audit mode records the problem in the readback."""
    import rlk_megatron_provider
    from rlk_core.errors import RlkPolicyError

    args = types.SimpleNamespace(tensor_model_parallel_size=4, rollout_num_gpus_per_engine=1, sequence_parallel=False)
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    provider("strict", logp="P/P")
    with pytest.raises(RlkPolicyError, match="train TP 4 != rollout TP 1.*Set RL_KERNEL_TP_INVARIANT=8 on both sides"):
        rlk_megatron_provider.install(args)
    monkeypatch.setenv("RL_KERNEL_TP_INVARIANT", str(G))
    st = rlk_megatron_provider.install(args)
    assert not [h for h in st.recorder.hooks if h["name"] == "tp_layout"]
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT")
    provider("audit", logp="P/P")
    st = rlk_megatron_provider.install(args)
    (hook,) = [h for h in st.recorder.hooks if h["name"] == "tp_layout"]
    assert "train TP 4 != rollout TP 1" in hook["target"] and hook["installed"] is False
    provider("strict", logp="P/P")  # one TP on both sides: nothing to say
    st = rlk_megatron_provider.install(types.SimpleNamespace(tensor_model_parallel_size=2,
                                                            rollout_num_gpus_per_engine=2))
    assert not [h for h in st.recorder.hooks if h["name"] == "tp_layout"]
