"""rlk.gemm.tp.v1's rank merge on gloo groups (W = 1, 2, 4, 8): a row-parallel linear's fp32 partials all-reduced
(and reduce-scattered + all-gathered: sequence parallelism) give the bits of one process's ``linear_tp`` on every
rank and at every W; the native rank sum differs (negative control); a vocab-parallel embedding is exact; bad input
is an error on every rank (docs/ops/linear_tp.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from rlk_core.ops import linear_tp, linear_tp_partials

WORLDS = (1, 2, 4, 8)


def _scenarios():
    spec = importlib.util.spec_from_file_location("rlk_coll_scenarios_tp", Path(__file__).resolve().parent /
                                                  "scenarios.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


S = _scenarios()


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"W{w}")
def test_row_parallel_partials_give_the_tp_1_bits_at_every_world_size(group_results, world):
    x, w, b, table, ids = S.tp_inputs()
    want = linear_tp(x, w, b, leaves=S.TP_G)
    want_fp32 = linear_tp_partials(x, w, S.TP_G)
    rows = S.TP_M // world
    for rank, r in enumerate(group_results("partials", world)):
        assert r["ar"].dtype == torch.bfloat16 and torch.equal(r["ar"], want), (world, rank)
        assert torch.equal(r["ar_fp32"], want_fp32), (world, rank)
        assert torch.equal(r["rs"], want[rank * rows:(rank + 1) * rows]), (world, rank)
        assert torch.equal(r["sp"], want), (world, rank)  # SP on == SP off
        assert torch.equal(r["embedding"], table[ids]), (world, rank)  # exact
        assert r["bf16_partials"].startswith("RlkInputError") and "must be float32" in r["bf16_partials"]
        if world > 1:
            assert r["g_mismatch"].startswith("RlkInputError") and "layouts differ" in r["g_mismatch"]
        if world > 1:
            assert "must be a power of two dividing G" in r["g_small"], r["g_small"]
        assert r["after"].tolist() == [float(world)] * 3


def test_negative_control_the_native_rank_sum_changes_with_world_size(group_results):
    naive = {w: group_results("partials", w)[0]["naive"] for w in (1, 2, 4, 8)}
    assert all(not torch.equal(naive[w], naive[1]) for w in (2, 4, 8))


def test_a_group_size_that_is_not_a_power_of_two_is_refused_on_every_rank(group_results):
    for r in group_results("partials", 4)[:3]:  # the sub-group of ranks 0, 1, 2
        assert r["not_pow2"].startswith("RlkInputError") and "group size 3 must be a power of two" in r["not_pow2"], r


def _rank_partials(world: int) -> list[torch.Tensor]:
    """The W ranks' partials of the scenario's row-parallel linear, computed here in one process (as the ranks do)."""
    x, w, *_ = S.tp_inputs()
    c = S.TP_K // world
    return [linear_tp_partials(x[:, r * c:(r + 1) * c].contiguous(), w[:, r * c:(r + 1) * c].contiguous(),
                               S.TP_G // world) for r in range(world)]


@pytest.mark.parametrize("world", WORLDS, ids=lambda w: f"W{w}")
def test_merge_partials_in_one_process_gives_the_all_reduce_s_bits(group_results, world):
    """Emulated TP's merge (``merge_partials``, no transport) == what every gloo rank's ``all_reduce_partials`` gave,
    fp32 and rounded with the bias; its rows == each rank's ``reduce_scatter_partials``."""
    from rlk_collectives import merge_partials

    _, _, b, *_ = S.tp_inputs()
    parts = _rank_partials(world)
    got_fp32 = merge_partials(parts, leaves_total=S.TP_G)
    got = merge_partials(parts, leaves_total=S.TP_G, bias=b, dtype=torch.bfloat16)
    rows = S.TP_M // world
    for rank, r in enumerate(group_results("partials", world)):
        assert torch.equal(got_fp32, r["ar_fp32"]) and torch.equal(got, r["ar"]), (world, rank)
        assert torch.equal(got[rank * rows:(rank + 1) * rows], r["rs"]), (world, rank)


def test_negative_control_merge_partials_is_not_the_sequential_rank_sum():
    from rlk_collectives import merge_partials

    parts = _rank_partials(8)
    sequential = parts[0].clone()
    for p in parts[1:]:
        sequential = sequential + p
    assert not torch.equal(merge_partials(parts, leaves_total=S.TP_G), sequential)


def test_merge_partials_refuses_what_all_reduce_partials_refuses():
    from rlk_collectives import merge_partials
    from rlk_core.errors import RlkInputError

    parts = _rank_partials(4)
    with pytest.raises(RlkInputError, match="must be float32"):
        merge_partials([p.bfloat16() for p in parts], leaves_total=S.TP_G)
    with pytest.raises(RlkInputError, match="group size 3 must be a power of two dividing G=8"):
        merge_partials(parts[:3], leaves_total=S.TP_G)
    with pytest.raises(RlkInputError, match="group size 4 must be a power of two dividing G=2"):
        merge_partials(parts, leaves_total=2)
    with pytest.raises(RlkInputError, match="part 1 is"):
        merge_partials([parts[0], parts[1][:1]], leaves_total=S.TP_G)
    with pytest.raises(RlkInputError, match="non-empty list"):
        merge_partials([], leaves_total=S.TP_G)
