"""The context-parallel attention transport in Megatron's zigzag (load-balanced) layout.

Layout: every sequence ``b`` of the packed batch (global boundaries ``cu_seqlens``, each length a
multiple of ``2 * cp``) is cut into ``2 * cp`` equal chunks; CP rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r`` of every sequence, in that order, sequences concatenated — as Megatron's
``get_batch_on_this_cp_rank`` and slime's ``slice_with_cp`` do. So the local boundaries are
``cu_seqlens // cp`` on every rank.

- :func:`cp_all_gather` turns every rank's local K (or V) into the whole packed K in global order
  (exact data movement); :meth:`ZigzagLayout.q_positions` gives each local query its position inside
  its sequence, the ``q_positions`` of ``rlk_core.ops.attention.attention_varlen`` (keys ``0..t``).
- :func:`cp_reduce_scatter` is its adjoint for the backward: every rank holds a dK over the whole
  packed K; rank ``r`` receives, for each of its local rows, the sum over ranks of that row in the
  tree of contract ``rlk.collective.v1`` (fp32, rank order, one rounding).
Each is the other's autograd backward.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from rlk_collectives import _transport as T
from rlk_collectives._ops import _wants_grad, adjoint_pair, prepare
from rlk_collectives._tree import reduce_rows
from rlk_core.errors import RlkInputError

Tensor = torch.Tensor


@dataclass(frozen=True)
class ZigzagLayout:
    """The zigzag CP layout of one packed batch, with its index tensors built once on ``device``.

    Build it once per batch (host work: it reads ``cu_seqlens``) and pass it to every layer's
    :func:`cp_all_gather` / :func:`cp_reduce_scatter`; nothing in those calls reads the host then, so
    they can be captured in a CUDA graph.
    """

    cu_seqlens: tuple[int, ...]
    cp_size: int
    device: torch.device
    # gathered row (rank-major: rank j's local row i is j * local_total + i) of each global row
    gather_index: Tensor = field(repr=False, compare=False)
    # global row of each (rank, local row), rank-major: the inverse permutation of gather_index
    scatter_index: Tensor = field(repr=False, compare=False)

    @staticmethod
    def build(cu_seqlens: Sequence[int] | Tensor, cp_size: int, device: torch.device | str = "cpu") -> ZigzagLayout:
        cu = [int(v) for v in (cu_seqlens.tolist() if isinstance(cu_seqlens, Tensor) else cu_seqlens)]
        _validate(cu, cp_size)
        scatter = torch.cat([global_rows(cu, cp_size, r) for r in range(cp_size)]) if cu[-1] else \
            torch.zeros(0, dtype=torch.int64)
        gather = torch.empty_like(scatter)
        gather[scatter] = torch.arange(scatter.numel(), dtype=torch.int64)
        dev = torch.device(device)
        return ZigzagLayout(tuple(cu), cp_size, dev, gather.to(dev), scatter.to(dev))

    @property
    def local_cu_seqlens(self) -> tuple[int, ...]:
        """Boundaries of the sequences in every rank's local tokens: ``cu_seqlens // cp_size``."""
        return tuple(c // self.cp_size for c in self.cu_seqlens)

    @property
    def local_tokens(self) -> int:
        return self.cu_seqlens[-1] // self.cp_size

    def q_positions(self, rank: int) -> Tensor:
        """int64 ``[local_tokens]`` on ``device``: each local token's position inside its sequence."""
        rows = self.scatter_index[rank * self.local_tokens:(rank + 1) * self.local_tokens].cpu()
        starts = torch.tensor(self.cu_seqlens[:-1], dtype=torch.int64)
        seq = torch.searchsorted(torch.tensor(self.cu_seqlens[1:], dtype=torch.int64), rows, right=True)
        return (rows - starts[seq]).to(self.device)

    def shard(self, x_full: Tensor, rank: int) -> Tensor:
        """Rank ``rank``'s local rows of a packed tensor in global order (what the data loader gives it)."""
        rows = self.scatter_index[rank * self.local_tokens:(rank + 1) * self.local_tokens]
        return x_full.index_select(0, rows.to(x_full.device))

    def digest(self) -> int:
        """A number every rank computes alike from the layout (compared across ranks by checked calls)."""
        return hash((self.cu_seqlens, self.cp_size)) & ((1 << 62) - 1)


def global_rows(cu_seqlens: Sequence[int], cp_size: int, rank: int) -> Tensor:
    """int64: the global packed row of each of ``rank``'s local tokens, in local order."""
    parts = []
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        chunk = (end - start) // (2 * cp_size)
        for c in (rank, 2 * cp_size - 1 - rank):
            parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk, dtype=torch.int64))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _validate(cu: list[int], cp_size: int) -> None:
    if cp_size < 1:
        raise RlkInputError(f"ZigzagLayout: cp_size must be >= 1, got {cp_size}")
    if len(cu) < 1 or cu[0] != 0 or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise RlkInputError(f"ZigzagLayout: cu_seqlens must start at 0 and never decrease, got {cu[:8]}...")
    bad = [(i, b - a) for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])) if (b - a) % (2 * cp_size)]
    if bad:
        raise RlkInputError(f"ZigzagLayout: every sequence length must be a multiple of 2 * cp_size = "
                            f"{2 * cp_size} (pad the sequences as Megatron / slime do); (index, length): {bad[:5]}")


def _check_layout(op: str, x: Tensor, layout: ZigzagLayout, rows: int, group, check: bool):
    g = prepare(op, x, group, check, digest=layout.digest(), dim_rule="none")
    if g.size != layout.cp_size:
        raise RlkInputError(f"rlk_collectives.{op}: the layout is for cp_size {layout.cp_size}, the group has "
                            f"{g.size} ranks")
    if x.dim() == 0 or x.shape[0] != rows:
        raise RlkInputError(f"rlk_collectives.{op}: expected {rows} rows (dim 0), got shape {tuple(x.shape)}")
    return g


def _gather(x: Tensor, layout: ZigzagLayout, g) -> Tensor:
    flat = x.contiguous().view(-1)
    gathered = T.all_gather_flat(flat, g) if g.size > 1 else flat.clone()
    gathered = gathered.view(g.size * x.shape[0], *x.shape[1:])
    return gathered.index_select(0, layout.gather_index.to(x.device))


def _scatter(x_full: Tensor, layout: ZigzagLayout, g) -> Tensor:
    rows = x_full.index_select(0, layout.scatter_index.to(x_full.device))
    per_rank = rows.view(g.size, rows.numel() // g.size)
    mine = reduce_rows(per_rank) if g.size == 1 else T.reduce_scatter_rows(per_rank, g)
    return mine.view(layout.local_tokens, *x_full.shape[1:])


_CPAllGather = adjoint_pair("_CPAllGather", _gather, _scatter)
_CPReduceScatter = adjoint_pair("_CPReduceScatter", _scatter, _gather)


def cp_all_gather(x: Tensor, layout: ZigzagLayout, group: dist.ProcessGroup | None = None, *,
                  check: bool = True) -> Tensor:
    """All-gather of zigzag CP shards into global packed order (exact data movement).

    Parameters
    ----------
    x : ``[layout.local_tokens, ...]``, this rank's local rows (chunks ``r`` and ``2cp-1-r`` of every
        sequence); any dtype; the same shape on every rank.
    layout : the batch's :class:`ZigzagLayout`; ``layout.cp_size`` is the group's size.
    group, check : the CP group (caller a member) and the metadata exchange, as for
        :func:`rlk_collectives.all_reduce` (the layout is compared across ranks too).

    Returns
    -------
    ``[cu_seqlens[-1], ...]``: the rows of all ranks in global order. Autograd: the gradient of ``x`` is
    :func:`cp_reduce_scatter` of the output gradient (contract ``rlk.collective.v1``).
    """
    g = _check_layout("cp_all_gather", x, layout, layout.local_tokens, group, check)
    if _wants_grad(x):
        return _CPAllGather.apply(x, layout, g)
    return _gather(x, layout, g)


def cp_reduce_scatter(x_full: Tensor, layout: ZigzagLayout, group: dist.ProcessGroup | None = None, *,
                      check: bool = True) -> Tensor:
    """Reduce-scatter of a global packed tensor (e.g. dK) back onto the zigzag shards.

    Contract ``rlk.collective.v1``: row ``i`` of rank ``r``'s result is
    ``round_to_dtype(tree_sum_fp32(x_full_0[g], ..., x_full_{W-1}[g]))`` with ``g`` the global row of
    rank ``r``'s local row ``i`` — the inputs widened to fp32, added in the fixed pairwise tree over rank
    order, rounded once.

    Parameters
    ----------
    x_full : ``[cu_seqlens[-1], ...]``, bfloat16, float16 or float32, the same shape on every rank.
    layout, group, check : as for :func:`cp_all_gather`.

    Returns
    -------
    ``[layout.local_tokens, ...]``. Autograd: the gradient of ``x_full`` is :func:`cp_all_gather` of the
    output gradient.
    """
    g = _check_layout("cp_reduce_scatter", x_full, layout, layout.cu_seqlens[-1], group, check)
    if _wants_grad(x_full):
        return _CPReduceScatter.apply(x_full, layout, g)
    return _scatter(x_full, layout, g)


def cp_all_gather_kv(k: Tensor, v: Tensor, layout: ZigzagLayout, group: dist.ProcessGroup | None = None, *,
                     check: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`cp_all_gather` of K and V in one collective: ``(k_full, v_full)`` in global order.

    ``k`` ``[t_local, Hk, Dk]`` and ``v`` ``[t_local, Hv, Dv]`` of one dtype. Autograd flows through both
    (dK and dV come back through one :func:`cp_reduce_scatter`)."""
    if k.dtype != v.dtype or k.shape[:1] != v.shape[:1]:
        raise RlkInputError(f"cp_all_gather_kv: k {k.dtype} {tuple(k.shape)} and v {v.dtype} {tuple(v.shape)} "
                            "need one dtype and one row count")
    t = k.shape[0]
    kv = torch.cat([k.reshape(t, -1), v.reshape(t, -1)], dim=1)
    full = cp_all_gather(kv, layout, group, check=check)
    nk = math.prod(k.shape[1:])
    k_full, v_full = full.split([nk, full.shape[1] - nk], dim=1)
    return k_full.reshape(-1, *k.shape[1:]), v_full.reshape(-1, *v.shape[1:])
