"""Emulated TP on one process (``RL_KERNEL_TP_EMULATE``, ``rlk_megatron_provider.tp_emulate``) in the real
megatron-core on gloo (a world of one, real TP 1): a Qwen3-shaped GPTModel at emulated TP 2, 4, 8, sequence
parallelism on and off, gives the per-token log-probs and every gradient of real TP 1 in invariant mode, bit for bit,
and of real multi-process TP 2 (and 4); the ranks really ran (their calls counted in the readback, the merge recorded
as emulated). Negative control: the same emulation with the ``rlk.gemm.bi.v1`` split (``,bi``) differs from TP 1 —
and gives real TP 2's bits without invariant mode. Refusals: without invariant mode, t not dividing G, a real TP
other than 1, heads not divisible by t (docs/ops/linear_tp.md, "Emulated TP on one GPU")."""

from __future__ import annotations

import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model
from test_megatron_provider import MEGATRON_WARNINGS, run
from test_megatron_tp_invariant import (
    INVARIANT,
    LENGTHS,
    MODEL,
    MODEL8,
    TIED,
    G,
    differing,
    full_grads,
    invariant_run,
    off_run,
    sp_run,
)

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]

LENGTHS8 = [8, 16, 16]  # 40 tokens: divisible by 8 (SP at emulated TP 8), gcd(40, 8) = 8 token leaves, one a rank


def shape(t: int) -> tuple[dict, list[int]]:
    """The model and lengths of emulated TP t: 8 KV heads for TP 8 (one query group a rank)."""
    return (MODEL8, LENGTHS8) if t == 8 else (MODEL, LENGTHS)


def tp1(t: int) -> dict:
    model, lengths = shape(t)
    return run(f"tpemu-base-{len(lengths)}-{model['num_key_value_heads']}", 1, 1, TIED, "thd", INVARIANT,
               backward=True, lengths=lengths, model=model)


def emulated(value: str) -> dict:
    model, lengths = shape(int(value.split(",")[0]))
    return run(f"tpemu-{value}", 1, 1, TIED, "thd", {**INVARIANT, "RL_KERNEL_TP_EMULATE": value}, backward=True,
               lengths=lengths, model=model)


def grads(res: dict, t: int) -> dict:
    from rlk_megatron_provider.weights import from_megatron

    return from_megatron(_model.config(TIED, **shape(t)[0]), res["tp_grads"])


@pytest.mark.parametrize("sp", [False, True], ids=["sp-off", "sp-on"])
@pytest.mark.parametrize("t", [2, 4, 8])
def test_emulated_tp_gives_the_log_probs_and_every_gradient_of_tp_1(t, sp):
    value = f"{t},sp" if sp else str(t)
    res, want = emulated(value), tp1(t)
    assert torch.equal(res["logp"], want["logp"]), value
    for key in ("logp_nograd", "logp_logits", "logp_vime"):
        assert torch.equal(res[key], want["logp"]), (value, key)
    got_g, want_g = grads(res, t), grads(want, t)
    assert differing(got_g, want_g) == []
    assert all(bool(g.abs().sum() > 0) for g in want_g.values())  # no gradient is trivially zero


@pytest.mark.parametrize("t", [2, 4, 8])
def test_the_emulated_ranks_really_ran_and_the_merge_is_recorded_as_emulated(t):
    """Each rank's own calls: t x TP 1's attention, RoPE, and linears (QKV / fc1 forward and dW, one a rank), t
    partials per row-parallel forward and column input gradient; merge_partials with world_size t and G."""
    mods, base = emulated(str(t))["readback"]["modules"], tp1(t)["readback"]["modules"]
    layers = _model.config(TIED, **shape(t)[0]).num_hidden_layers
    for m, per_layer in (("attention", 4), ("ffn", 2)):  # merges a layer: o_proj, QKV dX (+ q / k norm) | fc2, fc1 dX
        ops, ops1 = mods[m]["ops"], base[m]["ops"]
        # TP 1 runs the finished op (the partials and the one rounding in one kernel); each emulated rank its partials
        assert "linear_tp_partials" not in ops1, m
        assert ops["linear_tp_partials"]["call_count"] == t * ops1["linear_tp"]["call_count"] == t * 2 * layers
        assert ops["linear"]["call_count"] == t * ops1["linear"]["call_count"], m
        merge = ops["merge_partials"]
        assert merge["call_count"] == per_layer * layers, (m, merge)
        assert merge["backend_id"] == "rlk.collectives.in_process"
        assert {"world_size": t, "emulated": True}.items() <= merge["provenance"].items(), merge
        assert "merge_partials" not in ops1
    att, att1 = mods["attention"]["ops"], base["attention"]["ops"]
    assert att["attention_varlen"]["call_count"] == t * att1["attention_varlen"]["call_count"]
    assert att["rope"]["call_count"] == t * att1["rope"]["call_count"]


@pytest.mark.parametrize("sp", [False, True], ids=["sp-off", "sp-on"])
def test_emulated_tp_2_gives_the_bits_of_real_tp_2_on_gloo(sp):
    res = emulated("2,sp" if sp else "2")
    real = sp_run(2) if sp else invariant_run(2)
    assert torch.equal(res["logp"], real["logp"])
    assert differing(grads(res, 2), full_grads(real)) == []


@pytest.mark.slow
def test_emulated_tp_4_with_sp_gives_the_bits_of_real_tp_4_with_sp_on_gloo():
    res, real = emulated("4,sp"), sp_run(4)
    assert torch.equal(res["logp"], real["logp"])
    assert differing(grads(res, 4), full_grads(real)) == []


@pytest.mark.parametrize("t", [2, 4])
def test_negative_control_the_bi_split_differs_from_tp_1(t):
    """``,bi``: rank r's rlk.gemm.bi.v1 GEMM on its K slice, the rounded rank outputs summed by the collective's tree —
    other log-probs and gradients than TP 1's."""
    res, want = emulated(f"{t},bi"), tp1(t)
    assert not torch.equal(res["logp"], want["logp"])
    assert {"layers.0.qkv", "layers.0.gate_up", "embed"} <= set(differing(grads(res, t), grads(want, t)))


def test_negative_control_the_bi_split_is_real_tp_2_without_invariant_mode():
    """The control's forward is what real TP 2 computes without invariant mode (gloo): the emulation reproduces a TP
    layout's arithmetic in the other contract too, so its agreement with TP 1 above is the contract's, not a copy."""
    assert torch.equal(emulated("2,bi")["logp"], off_run(2)["logp"])


def _config(**kw):
    base = dict(num_attention_heads=8, num_query_groups=4)
    return types.SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(("env", "tp", "config", "match"), [
    ({"RL_KERNEL_TP_EMULATE": "4"}, 1, _config(), "TP-invariant mode only: set RL_KERNEL_TP_INVARIANT=G"),
    ({"RL_KERNEL_TP_EMULATE": "8", "RL_KERNEL_TP_INVARIANT": "4"}, 1, _config(num_query_groups=8),
     "t must divide RL_KERNEL_TP_INVARIANT=4"),
    ({"RL_KERNEL_TP_EMULATE": "2", "RL_KERNEL_TP_INVARIANT": "8"}, 2, _config(), "the real TP is 2"),
    ({"RL_KERNEL_TP_EMULATE": "8", "RL_KERNEL_TP_INVARIANT": "8"}, 1, _config(), "num_query_groups=4"),
])
def test_emulation_is_refused_outside_its_layout(monkeypatch, env, tp, config, match):
    from rlk_core.errors import RlkConfigError
    from rlk_megatron_provider import tp_emulate

    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(RlkConfigError, match=match) as err:
        tp_emulate.emulation(config, tp)
    assert "\n" not in str(err.value)


def test_emulation_is_off_by_default_and_parsed(monkeypatch):
    from rlk_core import envs
    from rlk_core.errors import RlkConfigError
    from rlk_megatron_provider import tp_emulate

    monkeypatch.delenv("RL_KERNEL_TP_EMULATE", raising=False)
    assert tp_emulate.emulation(_config(), 1) is None
    monkeypatch.setenv("RL_KERNEL_TP_EMULATE", "4,sp")
    monkeypatch.setenv("RL_KERNEL_TP_INVARIANT", str(G))
    assert tp_emulate.emulation(_config(), 1) == tp_emulate.Emulation(4, True, G, False)
    for bad in ("3", "1", "4,xp", "4,sp,sp"):
        with pytest.raises(RlkConfigError, match="RL_KERNEL_TP_EMULATE"):
            envs.get("RL_KERNEL_TP_EMULATE", {"RL_KERNEL_TP_EMULATE": bad})
