"""rlk-collectives: deterministic collectives for the tensor-, sequence- and context-parallel routes.

Contract ``rlk.collective.v1``: for a group of ``W`` ranks the reduced value of every element is
``round_to_dtype(tree_sum_fp32(x_0, ..., x_{W-1}))`` — the inputs widened to fp32, added in one fixed
pairwise tree over rank order, rounded once — whatever the message size, the chunking, the transport's
algorithm, the number of elements, or which framework asks. All-gathers are exact data movement.
Transport: ``torch.distributed`` (NCCL on GPUs, gloo on CPUs), moving bytes only. See
``docs/ops/collectives.md``.

- :func:`all_reduce`, :func:`reduce_scatter`, :func:`all_gather` (tensor and sequence parallelism);
- :class:`ZigzagLayout`, :func:`cp_all_gather`, :func:`cp_all_gather_kv`, :func:`cp_reduce_scatter`
  (context parallelism in Megatron's zigzag layout);
- :func:`all_reduce_partials`, :func:`reduce_scatter_partials`: the rank merge of the TP-invariant row-parallel
  GEMM (``rlk.gemm.tp.v1``: fp32 partials, the same tree, one rounding at the end); :func:`merge_partials`, the
  same merge of W ranks' partials in one process (emulated TP);
- :func:`tree_sum_fp32`, :func:`round_to_dtype`, :func:`reduce_reference`: the single-process
  specification (``reduce_reference(xs) == round_to_dtype(tree_sum_fp32(xs), dtype)`` is what every
  rank receives).

Each call reports ``(op, BACKEND_ID, CONTRACT_ID)`` to the active readback scope
(``rlk_core.readback.note_op_call``). Importing this package has no side effects.
"""

from rlk_collectives._ops import BACKEND_ID, CONTRACT_ID, all_gather, all_reduce, reduce_scatter
from rlk_collectives._tree import CANONICAL_NAN, DTYPES, reduce_reference, round_to_dtype, tree_sum_fp32
from rlk_collectives.cp import ZigzagLayout, cp_all_gather, cp_all_gather_kv, cp_reduce_scatter
from rlk_collectives.partials import all_reduce_partials, merge_partials, reduce_scatter_partials

__version__ = "0.1.0"

# The collectives this version provides (each tested on gloo at W = 1, 2, 3, 4, 8 and on NCCL at W = 2).
AVAILABLE: tuple[str, ...] = ("all_reduce", "reduce_scatter", "all_gather", "cp_all_gather", "cp_reduce_scatter")

__all__ = [
    "AVAILABLE",
    "BACKEND_ID",
    "CANONICAL_NAN",
    "CONTRACT_ID",
    "DTYPES",
    "ZigzagLayout",
    "all_gather",
    "all_reduce",
    "all_reduce_partials",
    "cp_all_gather",
    "cp_all_gather_kv",
    "cp_reduce_scatter",
    "merge_partials",
    "reduce_reference",
    "reduce_scatter",
    "reduce_scatter_partials",
    "round_to_dtype",
    "tree_sum_fp32",
]
