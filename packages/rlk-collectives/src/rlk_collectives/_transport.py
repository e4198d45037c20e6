"""Data movement only: the torch.distributed calls, on the raw bytes of flat contiguous tensors.

Sending bytes (a ``uint8`` view) keeps the transport free of arithmetic and of dtype support gaps
(gloo, NCCL): NCCL never adds anything here, so its algorithm, protocol and channel count cannot
change a bit. The reductions happen afterwards, on each rank, in :func:`rlk_collectives._tree.reduce_rows`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlk_collectives._group import Group
from rlk_collectives._tree import reduce_rows

# Messages up to this many bytes are all-reduced by one all-gather of the whole message and the tree
# on every rank (one collective: the lowest latency). Larger ones, for W > 2, go all-to-all -> tree on
# the own chunk -> all-gather (2 (W-1)/W of the message per rank, as a ring all-reduce). At W = 2 both
# move the same bytes per rank; the one-collective form is used at every size. A constant of size and
# group size only: the bits are the same on every path (the same tree for every element).
GATHER_MAX_BYTES = 1 << 20
# Large one-collective all-reduces are cut into this many pieces so the tree of piece i overlaps the
# all-gather of piece i + 1.
PIPELINE_PIECES = 4
PIPELINE_MIN_BYTES = 8 << 20


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _gather_into(out: torch.Tensor, inp: torch.Tensor, g: Group, async_op: bool = False):
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there); older torch has only the latter
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(_bytes(out), _bytes(inp), group=g.pg, async_op=async_op)


def all_gather_flat(flat: torch.Tensor, g: Group) -> torch.Tensor:
    """``[W * n]``: every rank's flat contiguous ``flat`` in rank order."""
    out = torch.empty(g.size * flat.numel(), dtype=flat.dtype, device=flat.device)
    _gather_into(out, flat, g)
    return out


def all_to_all_flat(flat: torch.Tensor, g: Group) -> torch.Tensor:
    """``[W * c]`` from ``[W * c]``: chunk ``j`` of the result is chunk ``rank`` of rank ``j``'s input."""
    out = torch.empty_like(flat)
    dist.all_to_all_single(_bytes(out), _bytes(flat), group=g.pg)
    return out


def all_reduce_path(nbytes: int, world: int) -> str:
    """``"gather"``, ``"gather_pipelined"`` or ``"a2a"``: a pure function of message size and group size."""
    if world <= 2 or nbytes <= GATHER_MAX_BYTES:
        return "gather_pipelined" if nbytes >= PIPELINE_MIN_BYTES else "gather"
    return "a2a"


def all_reduce_flat(flat: torch.Tensor, g: Group, path: str | None = None) -> torch.Tensor:
    """The reduced ``[n]`` of a flat contiguous ``[n]`` (``n >= 1``, ``W >= 2``)."""
    n, w = flat.numel(), g.size
    path = path or all_reduce_path(n * flat.element_size(), w)
    if path == "gather":
        return reduce_rows(all_gather_flat(flat, g).view(w, n))
    if path == "gather_pipelined":
        return _all_reduce_pipelined(flat, g)
    if path != "a2a":
        raise ValueError(f"unknown all-reduce path {path!r}")
    c = -(-n // w)
    send = flat
    if c * w != n:
        send = torch.zeros(c * w, dtype=flat.dtype, device=flat.device)
        send[:n] = flat
    mine = reduce_rows(all_to_all_flat(send, g).view(w, c))
    return all_gather_flat(mine, g)[:n]


def _all_reduce_pipelined(flat: torch.Tensor, g: Group) -> torch.Tensor:
    n, w = flat.numel(), g.size
    bounds = [n * i // PIPELINE_PIECES for i in range(PIPELINE_PIECES + 1)]
    pieces = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    bufs = [torch.empty(w * p.numel(), dtype=flat.dtype, device=flat.device) for p in pieces]
    works = [_gather_into(b, p, g, async_op=True) for b, p in zip(bufs, pieces)]
    out = torch.empty_like(flat)
    start = 0
    for p, b, work in zip(pieces, bufs, works):
        work.wait()
        reduce_rows(b.view(w, p.numel()), out=out[start:start + p.numel()])
        start += p.numel()
    return out


def reduce_scatter_rows(rows: torch.Tensor, g: Group) -> torch.Tensor:
    """``rows`` is ``[W, m]`` (contiguous): the reduced row ``rank`` over all ranks, ``[m]``."""
    w, m = rows.shape
    return reduce_rows(all_to_all_flat(rows.reshape(w * m), g).view(w, m))
