"""Data movement only: the torch.distributed calls, on the raw bytes of flat contiguous tensors.

Sending bytes (a ``uint8`` view) keeps the transport free of arithmetic and of dtype support gaps
(gloo, NCCL): NCCL never adds anything here, so its algorithm, protocol and channel count cannot
change a bit. The reductions happen afterwards, on each rank, in :func:`rlk_collectives._tree.reduce_rows`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from rlk_collectives._group import Group
from rlk_collectives._tree import canonical_nan_, reduce_rows

# Messages up to this many bytes are all-reduced by one all-gather of the whole message and the tree
# on every rank (one collective: the lowest latency). Larger ones go all-to-all -> tree on the own
# chunk -> all-gather (2 (W-1)/W of the message per rank, as a ring all-reduce). A constant of size
# only: the bits are the same on every path (the same tree for every element). Measured on 2 H200s
# (benchmarks/results/h200x2/collectives): the two cross between 16 and 32 MiB.
GATHER_MAX_BYTES = 16 << 20


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _gather_into(out: torch.Tensor, inp: torch.Tensor, g: Group):
    # torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns there); older torch has only the latter
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(_bytes(out), _bytes(inp), group=g.pg)


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
    """``"gather"`` or ``"a2a"``: a pure function of the message size (never of timing)."""
    return "gather" if nbytes <= GATHER_MAX_BYTES else "a2a"


def all_reduce_flat(flat: torch.Tensor, g: Group, path: str | None = None) -> torch.Tensor:
    """The reduced ``[n]`` of a flat contiguous ``[n]`` (``n >= 1``, ``W >= 2``)."""
    n, w = flat.numel(), g.size
    path = path or all_reduce_path(n * flat.element_size(), w)
    if path == "gather":
        return reduce_rows(all_gather_flat(flat, g).view(w, n))
    if path in ("nccl2", "nccl2_raw") and w == 2:
        # candidate, not a default: at W = 2 NCCL's sum adds two values once (commutative, correctly
        # rounded), which is the tree; measured here for its bits (NaN patterns) and speed
        out = flat.clone()
        dist.all_reduce(out, group=g.pg)
        return canonical_nan_(out) if path == "nccl2" else out
    if path != "a2a":
        raise ValueError(f"unknown all-reduce path {path!r}")
    c = -(-n // w)
    send = flat
    if c * w != n:
        send = torch.zeros(c * w, dtype=flat.dtype, device=flat.device)
        send[:n] = flat
    mine = reduce_rows(all_to_all_flat(send, g).view(w, c))
    return all_gather_flat(mine, g)[:n]


def reduce_scatter_rows(rows: torch.Tensor, g: Group) -> torch.Tensor:
    """``rows`` is ``[W, m]`` (contiguous): the reduced row ``rank`` over all ranks, ``[m]``."""
    w, m = rows.shape
    return reduce_rows(all_to_all_flat(rows.reshape(w * m), g).view(w, m))
