"""What each rank of a gloo test group runs (see _worker.py). Each function returns ``{name: result}``;
the tests compare the results with the reference in the test process and across ranks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from rlk_collectives import (
    ZigzagLayout,
    all_gather,
    all_reduce,
    cp_all_gather,
    cp_all_gather_kv,
    cp_reduce_scatter,
    reduce_scatter,
)
from rlk_core.errors import RlkInputError


def _inputs():
    name = "rlk_coll_inputs"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / "_inputs.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


SIZES = (1, 2, 7, 1023, 4099)
N = 4099  # odd: not a multiple of any W > 1, so the all-to-all path pads
PATHS = ("gather", "a2a")


def cp_lengths(world: int) -> list[int]:
    return [2 * world * m for m in (3, 1, 5)]


def cp_cu(world: int) -> list[int]:
    cu = [0]
    for n in cp_lengths(world):
        cu.append(cu[-1] + n)
    return cu


def main(rank: int, world: int) -> dict:
    inp = _inputs()
    out: dict = {}
    for dtype in inp.DTYPES:
        d = str(dtype).replace("torch.", "")
        xs = inp.adversarial(world, N, dtype, seed=1)
        x = xs[rank]
        out[f"ar/{d}"] = all_reduce(x)
        for path in PATHS:
            out[f"ar/{d}/{path}"] = all_reduce(x, _path=path)
        out[f"ar/{d}/unchecked"] = all_reduce(x, check=False)
        out[f"ar/{d}/bits"] = all_reduce(inp.random_bits(world, N, dtype, seed=2)[rank])
        # slices and concatenations of the same elements
        out[f"ar/{d}/slice"] = all_reduce(x[100:1100])
        out[f"ar/{d}/cat"] = all_reduce(torch.cat([x, x[:50]]))
        out[f"ar/{d}/strided"] = all_reduce(x[: 4096].view(64, 64).t())
        m = torch.stack([xs[rank][: 6 * world], xs[rank][6 * world: 12 * world]], dim=1)  # [6W, 2]
        out[f"rs0/{d}"] = reduce_scatter(m, dim=0)
        out[f"rs1/{d}"] = reduce_scatter(m.t(), dim=1)
        out[f"ag1/{d}"] = all_gather(m.t(), dim=1)
        out[f"ag0/{d}"] = all_gather(m, dim=-2)
    for n in SIZES:
        out[f"size/{n}"] = all_reduce(inp.adversarial(world, n, torch.bfloat16, seed=3)[rank])
    out["empty"] = all_reduce(torch.empty(0, 3, dtype=torch.bfloat16))
    out.update(_autograd(rank, world, inp))
    out.update(_cp(rank, world, inp))
    if world == 2:
        out["evidence"] = _evidence(rank)
    if world == 4:  # one group fewer to start: the bad-input cases run after the others at W = 4
        out.update({f"err/{k}": v for k, v in errors(rank, world).items()})
    return out


def _autograd(rank: int, world: int, inp) -> dict:
    out = {}
    xs = inp.adversarial(world, 8 * world, torch.float32, seed=4)
    ws = inp.adversarial(world, 8 * world, torch.float32, seed=5)
    x = xs[rank].clone().requires_grad_(True)
    (all_reduce(x) * ws[rank]).sum().backward()
    out["grad/all_reduce"] = x.grad
    x = xs[rank].view(4 * world, 2).clone().requires_grad_(True)
    (reduce_scatter(x, dim=0) * ws[rank][: 8].view(4, 2)).sum().backward()
    out["grad/reduce_scatter"] = x.grad
    x = xs[rank][: 8].view(4, 2).clone().requires_grad_(True)
    (all_gather(x, dim=0) * ws[rank].view(4 * world, 2)).sum().backward()
    out["grad/all_gather"] = x.grad
    return out


def _cp(rank: int, world: int, inp) -> dict:
    """K/V gathered from zigzag shards, dK/dV reduce-scattered, and attention on CP shards == unsharded."""
    from rlk_core.ops.attention import attention_varlen

    layout = ZigzagLayout.build(cp_cu(world), world)
    total = layout.cu_seqlens[-1]
    g = torch.Generator().manual_seed(6)
    q_full = torch.randn(total, 4, 16, generator=g).to(torch.bfloat16)
    k_full = torch.randn(total, 2, 16, generator=g).to(torch.bfloat16)
    v_full = torch.randn(total, 2, 16, generator=g).to(torch.bfloat16)
    out = {"cp/q_positions": layout.q_positions(rank), "cp/local_cu": torch.tensor(layout.local_cu_seqlens)}
    k_loc = layout.shard(k_full, rank).requires_grad_(True)
    v_loc = layout.shard(v_full, rank).requires_grad_(True)
    k_all, v_all = cp_all_gather_kv(k_loc, v_loc, layout)
    out["cp/k_all"], out["cp/v_all"] = k_all.detach(), v_all.detach()
    cu = torch.tensor(layout.cu_seqlens, dtype=torch.int32)
    cu_loc = torch.tensor(layout.local_cu_seqlens, dtype=torch.int32)
    q_loc = layout.shard(q_full, rank)
    o_loc = attention_varlen(q_loc, k_all, v_all, cu_loc, cu, 0.25, True, layout.q_positions(rank))
    out["cp/attn_local"] = o_loc
    out["cp/attn_full_shard"] = layout.shard(attention_varlen(q_full, k_full, v_full, cu, cu, 0.25, True, None), rank)
    # autograd through the gather: dK_loc = tree over ranks of each rank's weights at my rows
    wk = inp.adversarial(world, total * 32, torch.bfloat16, seed=7)
    (k_all.float() * wk[rank].view(total, 2, 16).float()).sum().backward()
    out["cp/k_grad"] = k_loc.grad
    dks = inp.adversarial(world, total * 32, torch.float16, seed=8)
    out["cp/rs"] = cp_reduce_scatter(dks[rank].view(total, 2, 16), layout)
    out["cp/ag"] = cp_all_gather(layout.shard(q_full, rank), layout)
    return out


def _evidence(rank: int) -> dict:
    """Each collective reports to the active readback scope like an op."""
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder

    rec = ReadbackRecorder("local", "train", RoutePlan("R/R", "R/R", "R/R"), mode="strict", rank=rank, world_size=2)
    x = torch.ones(8)
    with rec.scope("ffn"):
        all_reduce(x)
        all_reduce(x, check=False)
        reduce_scatter(x)
    with rec.scope("attention"):
        cp_all_gather(torch.ones(2, 3), ZigzagLayout.build([0, 4], 2))
    return rec.to_dict()["modules"]


def _expect_error(fn) -> str:
    try:
        fn()
    except RlkInputError as exc:
        return f"RlkInputError: {exc}"
    return "no error"


def errors(rank: int, world: int) -> dict:
    """Bad input on one rank: every rank gets an error, and the group still works afterwards."""
    out = {}
    x = torch.ones(12, dtype=torch.bfloat16)
    out["shape"] = _expect_error(lambda: all_reduce(x if rank else torch.ones(13, dtype=torch.bfloat16)))
    out["dtype"] = _expect_error(lambda: all_reduce(x if rank != 1 else x.float()))
    out["int_dtype"] = _expect_error(lambda: all_reduce(torch.ones(4, dtype=torch.int32)))
    out["rs_divisible"] = _expect_error(lambda: reduce_scatter(torch.ones(world + 1, dtype=torch.float32)))
    out["rs_dim"] = _expect_error(lambda: reduce_scatter(x, dim=3 if rank == 0 else 0))
    out["ag_shape"] = _expect_error(lambda: all_gather(torch.ones(rank + 1, 2)))
    out["op_mismatch"] = _expect_error(lambda: all_reduce(x) if rank else all_gather(x))
    layout = ZigzagLayout.build(cp_cu(world), world)
    other = ZigzagLayout.build([0, 2 * world, 4 * world * 3], world)
    t = torch.ones(layout.local_tokens, 2)
    out["cp_layout"] = _expect_error(lambda: cp_all_gather(t, layout if rank else other))
    wider = ZigzagLayout.build([0, 2 * world * (world + 1)], world + 1)  # valid, but for W + 1 ranks
    out["cp_size"] = _expect_error(lambda: cp_all_gather(torch.ones(wider.local_tokens, 2), wider))
    out["zigzag_lengths"] = _expect_error(lambda: ZigzagLayout.build([0, 2 * world + 1], world))
    # a group of ranks 0 and 1: the others are not members; the members' collective still works
    sub = dist.new_group([0, 1])
    y = torch.full((5,), float(rank + 1))
    if rank < 2:
        out["subgroup"] = all_reduce(y, sub)
    else:
        out["subgroup"] = _expect_error(lambda: all_reduce(y, sub))
    out["after"] = all_reduce(torch.full((3,), float(rank + 1)))
    return out


# -- rlk.gemm.tp.v1: the fp32-partial rank merge (rlk_collectives.partials) ------------------------------------------
TP_M, TP_N, TP_K, TP_G = 16, 24, 8 * 40, 8


def tp_inputs():
    """The same row-parallel problem on every rank: x [M, K], w [N, K], bias [N] (bf16), and an embedding table."""
    g = torch.Generator().manual_seed(35)
    x = torch.randn(TP_M, TP_K, generator=g).to(torch.bfloat16)
    w = (torch.randn(TP_N, TP_K, generator=g) / TP_K**0.5).to(torch.bfloat16)
    b = torch.randn(TP_N, generator=g).to(torch.bfloat16)
    table = torch.randn(64, 12, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 64, (TP_M,), generator=g)
    return x, w, b, table, ids


def partials(rank: int, world: int) -> dict:
    """A row-parallel linear at TP = world: this rank's K slice, G / W leaves, merged by the collectives (all-reduce;
    reduce-scatter + all-gather for SP); a vocab-parallel embedding; bad input on every rank."""
    from rlk_collectives import all_reduce_partials, reduce_scatter_partials
    from rlk_core.ops import linear, linear_tp_partials

    x, w, b, table, ids = tp_inputs()
    c = TP_K // world
    xs, ws = x[:, rank * c:(rank + 1) * c], w[:, rank * c:(rank + 1) * c]
    out: dict = {}
    if world == 4:  # a group of 3 ranks: not a power of two
        sub = dist.new_group([0, 1, 2])
        if rank < 3:
            out["not_pow2"] = _expect_error(lambda: all_reduce_partials(torch.zeros(4), sub, leaves_total=TP_G))
    if world & (world - 1) == 0:
        s = linear_tp_partials(xs, ws, TP_G // world)
        out["ar"] = all_reduce_partials(s, leaves_total=TP_G, bias=b, dtype=torch.bfloat16)
        out["ar_fp32"] = all_reduce_partials(s, leaves_total=TP_G, check=False)
        mine = reduce_scatter_partials(s, leaves_total=TP_G, bias=b, dtype=torch.bfloat16)
        out["rs"] = mine
        out["sp"] = all_gather(mine)
        out["naive"] = all_reduce(linear(xs, ws))  # without invariant mode: the rank sum of rounded bi GEMMs
        out["bf16_partials"] = _expect_error(lambda: all_reduce_partials(s.bfloat16(), leaves_total=TP_G))
        out["g_mismatch"] = _expect_error(lambda: all_reduce_partials(s, leaves_total=TP_G if rank else 2 * TP_G))
        if world > 1:
            out["g_small"] = _expect_error(lambda: all_reduce_partials(s, leaves_total=world // 2))
    # vocab-parallel embedding (Megatron's VocabParallelEmbedding): each rank looks up its rows, zeros elsewhere
    rows = table.shape[0] // world
    local = (ids >= rank * rows) & (ids < (rank + 1) * rows)
    emb = table[rank * rows:(rank + 1) * rows][(ids - rank * rows).clamp(0, rows - 1)]
    out["embedding"] = all_reduce(emb.masked_fill(~local[:, None], 0.0))
    out["after"] = all_reduce(torch.ones(3))
    return out
