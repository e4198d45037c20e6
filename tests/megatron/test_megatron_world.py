"""rlk-megatron-provider at world sizes 4 and 8 (real megatron-core on CPU, gloo): TP 4, TP 2 x CP 2, CP 4,
TP 4 x CP 2, TP 2 x CP 4, each checked against what the contracts promise (docs/megatron.md), bitwise:

- CP N == CP 1 at the same TP (the attention contract: zigzag shards + gathered K/V compute each token as
  CP 1 does; every other op is per token) — at TP 1 CP 1 is rlk-repro's local trainer;
- each run is deterministic: a second forward in the same processes gives the same log-probs, and the CP
  comparisons are separate runs (other processes, other groups) that must agree;
- TP N == the single-process TP-N reference (``_model.tp_reference_logprobs``: the local trainer with the
  row-parallel linears computed per rank's K slice and reduced by ``rlk_collectives.reduce_reference``),
  and != another TP's reference (TP N != TP 1 by contract);
- the logp module: vocab-parallel partials + merge == ``linear_logprobs`` on the gathered vocabulary ==
  the logits path;
- every rank's readback names the rlk collectives (``rlk.collective.v1``) with its group's size.

The model is the tiny Qwen3 shape with 8 query / 4 KV heads (divisible by TP 4) and sequence lengths that
are multiples of 2 * CP = 8. World 8 is 8 processes on CI's 2 cores: those runs are marked ``slow``.
"""

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
LENGTHS = [8, 16, 8]  # multiples of 2 * CP for CP 4
TIED = False
SLOW = pytest.mark.slow
# (tp, cp) -> marks; the CP-1 references at TP 2 and TP 4 run too (world 2 and 4)
SCENARIOS = {(4, 1): [], (2, 2): [], (1, 4): [], (4, 2): [SLOW], (2, 4): [SLOW]}


def world_run(tp: int, cp: int) -> dict:
    return run(f"w-tp{tp}-cp{cp}", tp, cp, TIED, "thd", R_ALL, lengths=LENGTHS, model=MODEL, repeat=True,
               all_readbacks=True)


def _params(pairs):
    return [pytest.param(tp, cp, marks=SCENARIOS.get((tp, cp), []), id=f"tp{tp}-cp{cp}") for tp, cp in pairs]


@pytest.mark.parametrize(("tp", "cp"), _params([(2, 2), (1, 4), (4, 2), (2, 4)]))
def test_cp_equals_cp1_at_the_same_tp_bitwise(tp, cp):
    res = world_run(tp, cp)
    ref = local(TIED, LENGTHS, **MODEL)[0] if tp == 1 else world_run(tp, 1)["logp"]
    assert torch.equal(res["logp"], ref)
    assert torch.equal(res["logp_logits"], ref)
    if tp > 1:  # TP N is not TP 1 (row-parallel partial sums), but the same model: close
        assert torch.allclose(res["logp"], local(TIED, LENGTHS, **MODEL)[0], rtol=0, atol=1e-5)


def tp_reference(tp: int) -> torch.Tensor:
    cfg = _model.config(TIED, **MODEL)
    return _model.tp_reference_logprobs(cfg, _model.weights(cfg), _model.sequences(LENGTHS, cfg.vocab_size), tp)


@pytest.mark.parametrize(("tp", "cp"), _params(SCENARIOS))
def test_equals_the_single_process_reference_of_its_tp_bitwise(tp, cp):
    res = world_run(tp, cp)
    assert torch.equal(res["logp"], tp_reference(tp))
    if tp == 1:
        assert torch.equal(tp_reference(1), local(TIED, LENGTHS, **MODEL)[0])  # the reference at TP 1: the trainer
    # negative control: another TP's reduction order gives other bits (TP N != TP 1 by contract)
    assert not torch.equal(res["logp"], tp_reference(2 if tp != 2 else 4))


@pytest.mark.parametrize(("tp", "cp"), _params(SCENARIOS))
def test_logp_provider_equals_linear_logprobs_on_gathered_vocab_and_repeats(tp, cp):
    res = world_run(tp, cp)
    assert res["logp"].numel() == sum(LENGTHS)
    assert torch.equal(res["logp_nograd"], res["logp_gathered_vocab"])  # partials + gather + merge
    assert torch.equal(res["logp"], res["logp_gathered_vocab"])  # differentiable path (gathered shards)
    assert torch.equal(res["logp_logits"], res["logp_gathered_vocab"])  # slime's logits path
    assert torch.equal(res["logp_vime"], res["logp_gathered_vocab"])  # VIME's provider (rank's vocab partition)
    assert torch.equal(res["logp_repeat"], res["logp_nograd"])  # a second forward: the same bits
    # processed log-probs (top_k 8, top_p 0.9): sharded == gathered vocabulary, threshold == VIME's keep mask
    assert res["kept_equal_here"]  # kept sets from the rank's gathered logits == from the whole LM head
    assert torch.equal(res["logp_processed"], res["logp_processed_gathered_vocab"])
    assert torch.equal(res["logp_vime_keep_mask"], res["logp_processed"])
    assert torch.equal(res["logp_vime_kept"], res["logp_processed"])
    finite = torch.isfinite(res["logp_processed"])
    # half the targets are kept tokens (finite); of the sampled half most fall outside the top 8 (-inf)
    assert 2 * int(finite.sum()) >= finite.numel() and not bool(finite.all())
    # renormalised over the kept set: larger than the full-vocabulary log-prob of the same token
    assert bool((res["logp_processed"][finite] > res["logp_unfiltered_same_targets"][finite]).all())
    assert [r["repeat_equal"] for r in res["readbacks"]] == [True] * (tp * cp)  # on every rank
    # entropy (rlk.entropy.v1) through VIME's provider at this TP == the op on the gathered vocabulary, bitwise;
    # threshold form == mask form; the processed entropy differs from the unfiltered one
    assert torch.equal(res["entropy_vime_kept"], res["entropy_processed_gathered_vocab"])
    assert torch.equal(res["entropy_vime_keep_mask"], res["entropy_processed_gathered_vocab"])
    assert torch.equal(res["entropy_vime"], res["entropy_gathered_vocab"])
    assert not torch.equal(res["entropy_vime"], res["entropy_vime_kept"])


def _collective(ops: dict, name: str) -> dict | None:
    rec = ops.get(name)
    if rec is None:
        return None
    return {k: rec[k] for k in ("backend_id", "contract_id", "fallback")} | {"world_size": rec["provenance"].get(
        "world_size"), "called": rec["call_count"] > 0}


@pytest.mark.parametrize(("tp", "cp"), _params(SCENARIOS))
def test_every_rank_readback_shows_the_rlk_collectives(tp, cp):
    res = world_run(tp, cp)
    rbs = res["readbacks"]
    assert sorted((r["tp_rank"], r["cp_rank"]) for r in rbs) == [(t, c) for t in range(tp) for c in range(cp)]

    def want(size: int) -> dict:
        return {"backend_id": "rlk.collectives.torch_distributed", "contract_id": "rlk.collective.v1",
                "fallback": False, "world_size": size, "called": True}

    for rank, r in enumerate(rbs):
        rb = r["readback"]
        assert (rb["rank"], rb["world_size"]) == (rank, tp * cp)
        mods = rb["modules"]
        assert {m: (mods[m]["implementation"], mods[m]["fallback"]) for m in mods} == {
            m: ("rlk", False) for m in ("attention", "ffn", "logp")}
        att, ffn, lp = (mods[m]["ops"] for m in ("attention", "ffn", "logp"))
        # TP: the row-parallel output projection / fc2 all-reduce, the vocab-parallel log-prob all-gather
        assert _collective(att, "all_reduce") == (want(tp) if tp > 1 else None), rank
        assert _collective(ffn, "all_reduce") == (want(tp) if tp > 1 else None), rank
        assert _collective(lp, "all_gather") == (want(tp) if tp > 1 else None), rank
        # CP: K/V gathered in the zigzag layout
        assert _collective(att, "cp_all_gather") == (want(cp) if cp > 1 else None), rank
