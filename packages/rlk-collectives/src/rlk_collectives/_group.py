"""Who is in the group, and the metadata exchange that makes bad input an error on every rank.

Before moving data, a checked collective all-gathers a small int64 vector from every rank: the op, the
dtype, the device type, the shape, the dim and a digest of any layout argument. Every rank then runs
the same pure function over the same ``[W, META_LEN]`` table, so either all ranks continue or all raise
the same :class:`~rlk_core.errors.RlkInputError` naming the ranks and what differs — nobody is left
waiting in a collective the others never enter. The exchange costs one small collective and a host
read; it is skipped under CUDA graph capture (a host read cannot be captured) and when the caller
passes ``check=False``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from rlk_collectives._tree import DTYPES
from rlk_core.errors import RlkInputError

MAGIC = 0x726C6B31  # "rlk1": a rank running a different protocol shows up as a mismatch, not garbage
MAX_DIMS = 16
OPS = ("all_reduce", "reduce_scatter", "all_gather", "cp_all_gather", "cp_reduce_scatter")
_DTYPE_NAMES = (torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64)
_DEVICE_TYPES = ("cpu", "cuda")
# field offsets of the metadata vector
_MAGIC, _OP, _DTYPE, _DEVICE, _NDIM, _DIM, _DIGEST, _SHAPE = range(8)
META_LEN = _SHAPE + MAX_DIMS


@dataclass(frozen=True)
class Group:
    """The caller's view of a process group: the group object, its size and the caller's rank in it."""

    pg: dist.ProcessGroup | None
    size: int
    rank: int
    backend: str


def resolve(group: dist.ProcessGroup | None, op: str) -> Group:
    """The caller's rank and the group's size; a clear error if the caller is not a member."""
    if not dist.is_available() or not dist.is_initialized():
        raise RlkInputError(f"rlk_collectives.{op}: torch.distributed is not initialised "
                            "(call torch.distributed.init_process_group first)")
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise RlkInputError(f"rlk_collectives.{op}: this process (global rank {dist.get_rank()}) is not a "
                            "member of the group it passed (torch.distributed.new_group returned "
                            "NON_GROUP_MEMBER here)")
    rank = dist.get_rank(group)
    if rank < 0:
        raise RlkInputError(f"rlk_collectives.{op}: this process (global rank {dist.get_rank()}) is not a "
                            "member of the group it passed")
    return Group(group, dist.get_world_size(group), rank, str(dist.get_backend(group)))


def exchange_device(g: Group) -> torch.device:
    """Where the metadata vector lives: the same on every rank (decided by the backend, not the input)."""
    if g.backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _code(table: tuple, value) -> int:
    return table.index(value) if value in table else -1


def encode(op: str, x: torch.Tensor, dim: int, digest: int = 0) -> list[int]:
    shape = list(x.shape)[:MAX_DIMS]
    return [MAGIC, OPS.index(op), _code(_DTYPE_NAMES, x.dtype), _code(_DEVICE_TYPES, x.device.type),
            x.dim(), dim, digest, *shape, *([0] * (MAX_DIMS - len(shape)))]


def _dtype_name(row: list[int]) -> str:
    return str(_DTYPE_NAMES[row[_DTYPE]]).replace("torch.", "") if row[_DTYPE] >= 0 else "<other dtype>"


def _describe(row: list[int]) -> str:
    dtype = _dtype_name(row)
    shape = tuple(row[_SHAPE:_SHAPE + min(row[_NDIM], MAX_DIMS)])
    return f"{OPS[row[_OP]] if 0 <= row[_OP] < len(OPS) else '?'} {dtype} {shape} dim={row[_DIM]}"


def problems(table: list[list[int]], op: str, g: Group, reduces: bool, dim_rule: str) -> list[str]:
    """Every problem with the gathered metadata; the same list on every rank (a pure function).

    ``dim_rule``: ``"none"`` (no dim argument), ``"range"`` (dim must index the tensor; a 0-d tensor
    counts as 1-d) or ``"divisible"`` (also ``shape[dim]`` divisible by the group size)."""
    out: list[str] = []
    if any(r[_MAGIC] != MAGIC or r[_OP] != table[0][_OP] for r in table):
        return ["ranks are not in the same rlk collective: " +
                "; ".join(f"rank {i}: {_describe(r) if r[_MAGIC] == MAGIC else 'another protocol'}"
                          for i, r in enumerate(table))]
    for i, r in enumerate(table):
        ndim = r[_NDIM]
        if reduces and (r[_DTYPE] < 0 or _DTYPE_NAMES[r[_DTYPE]] not in DTYPES):
            out.append(f"rank {i}: dtype {_dtype_name(r)} is not supported (bfloat16, float16, float32)")
        if ndim > MAX_DIMS:
            out.append(f"rank {i}: {ndim} dims; at most {MAX_DIMS} are supported")
        want_device = "cuda" if g.backend == "nccl" else None
        if want_device is not None and r[_DEVICE] != _DEVICE_TYPES.index(want_device):
            out.append(f"rank {i}: the tensor is not on a CUDA device but the group's backend is nccl")
        if dim_rule != "none":
            dim, nd = r[_DIM], max(ndim, 1)
            if not -nd <= dim < nd:
                out.append(f"rank {i}: dim {dim} is out of range for a {ndim}-d tensor")
            elif dim_rule == "divisible" and ndim <= MAX_DIMS and (ndim == 0 or r[_SHAPE + dim % ndim] % g.size):
                size = r[_SHAPE + dim % ndim] if ndim else 1
                out.append(f"rank {i}: size {size} of dim {dim} is not divisible by the group size {g.size}")
    fields = [(_DTYPE, "dtypes"), (_DEVICE, "device types"), (_DIM, "dims"), (_DIGEST, "layouts")]
    for idx, what in fields:
        if len({r[idx] for r in table}) > 1:
            out.append(f"{what} differ across ranks: " + "; ".join(f"rank {i}: {_describe(r)}"
                                                                   for i, r in enumerate(table)))
    shapes = {tuple(r[_NDIM:_NDIM + 1] + r[_SHAPE:]) for r in table}
    if len(shapes) > 1:
        out.append("shapes differ across ranks: " + "; ".join(f"rank {i}: {_describe(r)}"
                                                              for i, r in enumerate(table)))
    return out


def check_agreement(op: str, x: torch.Tensor, g: Group, dim: int = 0, digest: int = 0, reduces: bool = True,
                    dim_rule: str = "none") -> None:
    """Exchange metadata with every rank of ``g``; raise the same error on every rank on any problem."""
    vec = torch.tensor(encode(op, x, dim, digest), dtype=torch.int64, device=exchange_device(g))
    table = torch.empty(g.size * META_LEN, dtype=torch.int64, device=vec.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch >= 2.13 / older
    gather(table, vec, group=g.pg)
    rows = table.view(g.size, META_LEN).tolist()
    found = problems(rows, op, g, reduces, dim_rule)
    if found:
        raise RlkInputError(f"rlk_collectives.{op} (rank {g.rank} of {g.size}): " + " | ".join(found))


def check_local(op: str, x: torch.Tensor, g: Group, dim: int = 0, reduces: bool = True,
                dim_rule: str = "none") -> None:
    """The checks that need no exchange (``check=False``, graph capture): this rank's own input only. A
    problem found here raises on this rank alone; the others may then wait in the collective until the
    process group's timeout."""
    found = problems([encode(op, x, dim)], op, g, reduces, dim_rule)
    if found:
        raise RlkInputError(f"rlk_collectives.{op} (rank {g.rank} of {g.size}): " + " | ".join(found))
