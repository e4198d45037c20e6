"""The collectives on gloo groups of spawned processes: bitwise equal to the single-process reference,
identical on every rank, independent of message size, path, slicing and concatenation; autograd; the
zigzag CP transport; bad input as an error on every rank (never a hang: each group has a deadline)."""

from __future__ import annotations

import pytest
import torch

from rlk_collectives import BACKEND_ID, CONTRACT_ID, ZigzagLayout, reduce_reference

WORLDS = (1, 2, 3, 4, 8)
DTYPE_NAMES = ("bfloat16", "float16", "float32")
N = 4099
PATHS = ("gather", "a2a")
PER_RANK = ("evidence", "rs0/", "rs1/", "grad/", "cp/q_positions", "cp/attn", "cp/k_grad", "cp/rs", "err/")


@pytest.fixture(params=WORLDS, ids=lambda w: f"W{w}")
def world(request):
    return request.param


def _eq(inputs, actual, expected, what):
    a, e = inputs.bits(actual), inputs.bits(expected)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    diff = int((a != e).sum())
    assert diff == 0, f"{what}: {diff} of {a.numel()} elements differ"


@pytest.mark.parametrize("d", DTYPE_NAMES)
def test_all_reduce_is_the_tree_on_every_rank(group_results, inputs, world, d):
    res = group_results("main", world)
    dtype = getattr(torch, d)
    xs = inputs.adversarial(world, N, dtype, seed=1)
    ref = reduce_reference(xs)
    for rank, r in enumerate(res):
        _eq(inputs, r[f"ar/{d}"], ref, f"rank {rank} all_reduce")
        for path in PATHS:
            _eq(inputs, r[f"ar/{d}/{path}"], ref, f"rank {rank} path {path}")
        _eq(inputs, r[f"ar/{d}/unchecked"], ref, f"rank {rank} check=False")
        _eq(inputs, r[f"ar/{d}/bits"], reduce_reference(inputs.random_bits(world, N, dtype, seed=2)),
            f"rank {rank} random bit patterns")
        _eq(inputs, r[f"ar/{d}/slice"], ref[100:1100], f"rank {rank} slice")
        _eq(inputs, r[f"ar/{d}/cat"], torch.cat([ref, ref[:50]]), f"rank {rank} concatenation")
        _eq(inputs, r[f"ar/{d}/strided"], ref[:4096].view(64, 64).t(), f"rank {rank} strided input")


@pytest.mark.parametrize("d", DTYPE_NAMES)
def test_reduce_scatter_and_all_gather(group_results, inputs, world, d):
    res = group_results("main", world)
    dtype = getattr(torch, d)
    xs = inputs.adversarial(world, N, dtype, seed=1)
    ms = [torch.stack([x[: 6 * world], x[6 * world: 12 * world]], dim=1) for x in xs]  # [6W, 2]
    full = reduce_reference(ms)
    for rank, r in enumerate(res):
        mine = full[6 * rank: 6 * rank + 6]
        _eq(inputs, r[f"rs0/{d}"], mine, f"rank {rank} reduce_scatter dim 0")
        _eq(inputs, r[f"rs1/{d}"], mine.t(), f"rank {rank} reduce_scatter dim 1")
        _eq(inputs, r[f"ag0/{d}"], torch.cat(ms, 0), f"rank {rank} all_gather dim -2")
        _eq(inputs, r[f"ag1/{d}"], torch.cat([m.t() for m in ms], 1), f"rank {rank} all_gather dim 1")
    # reduce-scatter pieces, concatenated, are the all-reduce of the same elements
    _eq(inputs, torch.cat([r[f"rs0/{d}"] for r in res]), full, "cat(reduce_scatter) == all_reduce")


def test_message_sizes(group_results, inputs, world):
    res = group_results("main", world)
    for n in (1, 2, 7, 1023, 4099):
        ref = reduce_reference(inputs.adversarial(world, n, torch.bfloat16, seed=3))
        for rank, r in enumerate(res):
            _eq(inputs, r[f"size/{n}"], ref, f"rank {rank} n={n}")
    assert all(r["empty"].shape == (0, 3) for r in res)


def test_identical_on_every_rank(group_results, inputs, world):
    res = group_results("main", world)
    for key, value in res[0].items():
        if key.startswith(PER_RANK):
            continue
        for rank in range(1, world):
            _eq(inputs, res[rank][key], value, f"{key} on rank {rank} vs rank 0")


def test_autograd(group_results, inputs, world):
    res = group_results("main", world)
    ws = inputs.adversarial(world, 8 * world, torch.float32, seed=5)
    total = reduce_reference(ws)
    rs_grad = reduce_reference([w.view(4 * world, 2) for w in ws])
    for rank, r in enumerate(res):
        _eq(inputs, r["grad/all_reduce"], total, f"rank {rank}: d all_reduce = all_reduce of the gradients")
        _eq(inputs, r["grad/reduce_scatter"], torch.cat([w[:8].view(4, 2) for w in ws]),
            f"rank {rank}: d reduce_scatter = all_gather")
        _eq(inputs, r["grad/all_gather"], rs_grad[4 * rank: 4 * rank + 4],
            f"rank {rank}: d all_gather = reduce_scatter")


def test_context_parallel_transport(group_results, inputs, world):
    res = group_results("main", world)
    lengths = [2 * world * m for m in (3, 1, 5)]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    layout = ZigzagLayout.build(cu, world)
    total = cu[-1]
    g = torch.Generator().manual_seed(6)
    q_full = torch.randn(total, 4, 16, generator=g).to(torch.bfloat16)
    k_full = torch.randn(total, 2, 16, generator=g).to(torch.bfloat16)
    v_full = torch.randn(total, 2, 16, generator=g).to(torch.bfloat16)
    wk = reduce_reference(inputs.adversarial(world, total * 32, torch.bfloat16, seed=7)).view(total, 2, 16)
    dk = reduce_reference(inputs.adversarial(world, total * 32, torch.float16, seed=8)).view(total, 2, 16)
    seen = torch.zeros(total, dtype=torch.int64)
    for rank, r in enumerate(res):
        rows = layout.scatter_index[rank * layout.local_tokens:(rank + 1) * layout.local_tokens]
        seen[rows] += 1
        chunk = [n // (2 * world) for n in lengths]
        expect_pos = torch.cat([torch.cat([torch.arange(rank * c, rank * c + c),
                                           torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c)])
                                for c in chunk])
        assert torch.equal(r["cp/q_positions"], expect_pos), f"rank {rank} q_positions"
        assert r["cp/local_cu"].tolist() == [c // world for c in cu]
        _eq(inputs, r["cp/k_all"], k_full, f"rank {rank} gathered K")
        _eq(inputs, r["cp/v_all"], v_full, f"rank {rank} gathered V")
        _eq(inputs, r["cp/ag"], q_full, f"rank {rank} cp_all_gather")
        _eq(inputs, r["cp/attn_local"], r["cp/attn_full_shard"], f"rank {rank}: attention on CP shards")
        _eq(inputs, r["cp/k_grad"], layout.shard(wk, rank), f"rank {rank}: dK through cp_all_gather_kv")
        _eq(inputs, r["cp/rs"], layout.shard(dk, rank), f"rank {rank}: cp_reduce_scatter")
    assert bool((seen == 1).all()), "every global row belongs to exactly one rank"


def test_bad_input_is_an_error_on_every_rank(group_results):
    world = 4
    res = [{k[4:]: v for k, v in r.items() if k.startswith("err/")} for r in group_results("main", world)]
    expected = {
        "shape": "shapes differ", "dtype": "dtypes differ", "int_dtype": "int32 is not supported",
        "rs_divisible": "not divisible by the group size 4", "rs_dim": "dim 3 is out of range",
        "ag_shape": "shapes differ", "op_mismatch": "not in the same rlk collective",
        "cp_layout": "layouts differ", "cp_size": "layout is for cp_size 5",
        "zigzag_lengths": "multiple of 2 * cp_size",
    }
    for rank, r in enumerate(res):
        for key, text in expected.items():
            assert r[key].startswith("RlkInputError") and text in r[key], f"rank {rank} {key}: {r[key]}"
        if rank < 2:
            assert r["subgroup"].tolist() == [3.0] * 5
        else:
            assert "not a member" in r["subgroup"], r["subgroup"]
        assert r["after"].tolist() == [10.0] * 3, "the group works after the errors"


def test_each_call_is_reported_to_the_readback_scope(group_results):
    for r in group_results("main", 2):
        ffn, attn = r["evidence"]["ffn"]["ops"], r["evidence"]["attention"]["ops"]
        assert ffn["all_reduce"]["call_count"] == 2 and ffn["reduce_scatter"]["call_count"] == 1
        assert attn["cp_all_gather"]["call_count"] == 1
        for rec in (ffn["all_reduce"], ffn["reduce_scatter"], attn["cp_all_gather"]):
            assert (rec["backend_id"], rec["contract_id"], rec["fallback"]) == (BACKEND_ID, CONTRACT_ID, False)
            assert rec["execution_mode"] == "eager" and rec["provenance"] == {"world_size": 2}
    assert CONTRACT_ID == "rlk.collective.v1"
