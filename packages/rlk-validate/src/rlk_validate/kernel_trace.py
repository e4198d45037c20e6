"""The kernel-trace gate: which kernel families one traced round of each side ran (``kernel-trace.json``).

``rlk-repro run --trace`` profiles the first round of both sides with ``torch.profiler`` and writes
``kernel-trace.json`` (``rlk.kernel-trace.v1``) into the run directory, sealed like every other file. Per side
it lists *units* ``[name, context, count]``: on a GPU a unit is a kernel (its name; ``context`` the innermost rlk
op or collective range it was launched from, or null), on a CPU an operator event (an rlk op, or an ``aten`` op
outside every rlk op: the events an rlk op runs inside are its implementation and are not listed). This module
classifies the units into families (:func:`classify`), torch-free, and :func:`check_kernel_trace` checks them:

- for an all-R run: every required rlk family (:data:`REQUIRED_FAMILIES`; ``collective`` only when the run's
  tensor-parallel size is > 1: a TP-1 run has no collective to run) counted > 0 over the two sides, and no unit of a
  forbidden vendor family (:data:`FORBIDDEN_FAMILIES`: vendor GEMM, vendor / flash attention, NCCL or custom
  all-reduce payload) on either side;
- the families the producer wrote equal the ones recomputed here from its units;
- any run: the counts are reported (``KERNEL_TRACE_SUMMARY``).

What is allowed in the traced windows (docs/validate.md): every unit of no family above, e.g. element-wise and
copy kernels, memcpy / memset, the embedding gather, the optimizer's ``multi_tensor_apply`` kernels, NCCL
data-movement kernels (AllGather, Broadcast, SendRecv, AllToAll: rlk's collectives move data with them and reduce
in their own fixed order; weight-sync broadcasts are outside the traced windows anyway) and the vendor softmax of
diagnostics (``vendor_softmax``, reported, not gated). Kernel names are matched by the patterns below; a name
that matches no pattern is ``other`` (reported by name among the most frequent).
"""

from __future__ import annotations

import re
from typing import Any

from .evidence import KERNEL_TRACE_SCHEMA, MODULES
from .findings import Finding, finding
from .safeio import MAX_INT, InputError, Root

CHECK = "kernel-trace"
KERNEL_TRACE = "kernel-trace.json"
TRACE_SIDES = ("rollout", "train")

#: rlk's kernels (the ``@triton.jit`` functions of ``rlk_core/ops/*/triton*.py``, whose names the AOT cubins keep)
#: and ops (``rlk::<op>``, their eager autograd functions ``<op>_function`` / ``<op>_functionBackward``) by family
RLK_KERNELS: dict[str, tuple[str, ...]] = {
    "gemm": ("_linear_fwd_kernel", "_linear_tma_kernel", "_linear_bwd_kernel", "_linear_bwd_tma_kernel",
             "_linear_tp_fwd_kernel", "_linear_tp_leaf_kernel", "_linear_tp_merge_kernel", "_linear_tp_stash_kernel",
             "_moe_grouped_fwd_kernel", "_moe_wgrad_kernel"),
    "attention_fwd": ("_attention_fwd_kernel", "_kv_cache_write_kernel"),
    "attention_bwd": ("_attn_bwd_stats_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_group_sum_kernel",
                      "_attn_bwd_dq_kernel"),
    "swiglu": ("_swiglu_fwd_kernel", "_swiglu_bwd_kernel"),
    "rms_norm": ("_rms_norm_fwd_kernel", "_rms_norm_bwd_kernel", "_rms_norm_bwd_dw_kernel"),
    "logp": ("_logp_block_fwd_kernel", "_merge_blocks_kernel", "_merge_groups_kernel", "_logp_grad_kernel"),
    "rope": ("_rope_fwd_kernel", "_rope_bwd_kernel"),
    "moe_routing": ("_moe_topk_fwd_kernel", "_moe_topk_bwd_kernel", "_moe_combine_fwd_kernel",
                    "_moe_combine_bwd_kernel"),
}
RLK_OPS: dict[str, tuple[str, ...]] = {
    "gemm": ("linear", "linear_tp_partials", "linear_tp", "moe_grouped_linear", "moe_grouped_linear_backward"),
    "attention_fwd": ("attention_varlen", "attention_decode", "attention_paged_prefill", "kv_cache_write"),
    "attention_bwd": ("attention_varlen_backward",),
    "swiglu": ("swiglu", "swiglu_backward"),
    "rms_norm": ("rms_norm", "rms_norm_backward"),
    "logp": ("linear_logprobs", "linear_logprobs_backward", "processed_linear_logprobs",
             "processed_linear_logprobs_backward", "token_logprobs", "token_logprobs_backward",
             "processed_token_logprobs", "processed_token_logprobs_backward", "linear_logp_partials",
             "processed_linear_logp_partials", "logp_partials", "processed_logp_partials", "merge_logp_partials",
             "kept_set"),
    "rope": ("rope", "rope_backward"),
    "moe_routing": ("moe_topk", "moe_topk_backward", "moe_combine", "moe_combine_backward"),
}
#: the record_function range rlk's collectives open while a profiler runs (``rlk.collective.all_reduce``, ...)
COLLECTIVE_RANGE = "rlk.collective."
#: the families an all-R run must show (``collective`` only at tensor-parallel size > 1)
REQUIRED_FAMILIES = ("gemm", "attention_fwd", "attention_bwd", "swiglu", "rms_norm", "logp", "collective")
#: vendor families that must not run in an all-R run's traced forward and backward
FORBIDDEN_FAMILIES = ("vendor_gemm", "vendor_attention", "vendor_allreduce")

_VENDOR_KERNEL_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("vendor_allreduce", re.compile(r"nccl\w*(AllReduce|ReduceScatter|_Reduce_|Reduce_Sum|Reduce_RING|Reduce_TREE)"
                                    r"|cross_device_reduce|all_reduce|allreduce|one_shot_|two_shot_|multimem_",
                                    re.IGNORECASE)),
    ("vendor_attention", re.compile(r"flash|fmha|sdpa|scaled_dot_product|efficient_attention|paged_attention"
                                    r"|reshape_and_cache|unified_attention|kernel_unified_attention|attention_kernel"
                                    r"|flashinfer|BatchPrefill|BatchDecode|xformers", re.IGNORECASE)),
    ("vendor_gemm", re.compile(r"gemm|gemv|nvjet|cublas|cutlass|xmma|s16816|s1688|h16816|wgmma|splitKreduce"
                               r"|_mm_|triton_mm|matmul|ampere_.*_tn|sm\d+_.*_tn", re.IGNORECASE)),
    ("vendor_softmax", re.compile(r"softmax", re.IGNORECASE)),
)
_VENDOR_OPS: dict[str, tuple[str, ...]] = {
    "vendor_gemm": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                    "aten::_scaled_mm", "aten::addmv", "aten::mv", "aten::dot", "aten::einsum",
                    "aten::_addmm_activation",
                    "aten::addbmm", "aten::tensordot"),
    "vendor_attention": ("aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
                         "aten::_scaled_dot_product_flash_attention_for_cpu",
                         "aten::_scaled_dot_product_efficient_attention", "aten::_scaled_dot_product_cudnn_attention",
                         "aten::_scaled_dot_product_flash_attention_backward",
                         "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                         "aten::_scaled_dot_product_efficient_attention_backward",
                         "aten::_flash_attention_forward", "aten::_flash_attention_backward",
                         "aten::_efficient_attention_forward", "aten::_efficient_attention_backward"),
    "vendor_allreduce": ("c10d::allreduce_", "c10d::reduce_scatter_", "c10d::_reduce_scatter_base_",
                         "c10d::reduce_", "_c10d_functional::all_reduce", "_c10d_functional::reduce_scatter_tensor"),
    "vendor_softmax": ("aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax",
                       "aten::_log_softmax_backward_data", "aten::_softmax_backward_data"),
}
_KERNEL_FAMILY = {k: fam for fam, ks in RLK_KERNELS.items() for k in ks}
_OP_FAMILY = {op: fam for fam, ops in RLK_OPS.items() for op in ops}
_VENDOR_OP_FAMILY = {op: fam for fam, ops in _VENDOR_OPS.items() for op in ops}
_FUNCTION_RE = re.compile(r"(?:autograd::engine::evaluate_function: )?([a-z0-9_]+)_function(Backward)?")


def rlk_op_family(name: str) -> str | None:
    """The rlk family of an operator event's name (``rlk::linear``, ``linear_function``,
    ``attention_varlen_functionBackward``, ``rlk.collective.all_reduce``), or None for anything else."""
    if name.startswith(COLLECTIVE_RANGE):
        return "collective"
    if name.startswith("rlk::"):
        return _OP_FAMILY.get(name[5:].split(".", 1)[0])
    m = _FUNCTION_RE.fullmatch(name)
    if m:
        fam = _OP_FAMILY.get(m.group(1))
        if fam == "attention_fwd" and m.group(2):
            return "attention_bwd"  # the backward of the varlen attention's autograd function
        return fam
    return None


def classify(name: str, context: str | None = None) -> str:
    """The family of one unit: an rlk family, a vendor family, or ``other``.

    A kernel's own name decides first (a vendor GEMM inside an rlk op is still a vendor GEMM); a name of no family
    takes the family of its rlk context (``context``: the innermost rlk op or collective range around its launch,
    e.g. the NCCL AllGather and the adds of an rlk all-reduce are ``collective``)."""
    fam = _KERNEL_FAMILY.get(name) or rlk_op_family(name) or _VENDOR_OP_FAMILY.get(name)
    if fam is None and not name.startswith("aten::"):
        fam = next((f for f, pat in _VENDOR_KERNEL_PATTERNS if pat.search(name)), None)
    if fam is None and context is not None:
        fam = rlk_op_family(context)
    return fam or "other"


def families(units: list[list[Any]]) -> dict[str, int]:
    """``{family: count}`` over ``[name, context, count]`` units."""
    out: dict[str, int] = {}
    for name, context, count in units:
        fam = classify(name, context)
        out[fam] = out.get(fam, 0) + count
    return dict(sorted(out.items()))


def _f(code: str, msg: str, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=KERNEL_TRACE, **kw)


def _units_problem(units: Any, side: str) -> str | None:
    if not isinstance(units, list) or len(units) > 100_000:
        return f"sides.{side}.units must be a list (at most 100000 entries)"
    for i, u in enumerate(units):
        if not (isinstance(u, list) and len(u) == 3 and type(u[0]) is str and 0 < len(u[0]) <= 4096
                and (u[1] is None or (type(u[1]) is str and len(u[1]) <= 4096))
                and type(u[2]) is int and 0 < u[2] <= MAX_INT):
            return f"sides.{side}.units[{i}] must be [name, context or null, count > 0]"
    return None


def _doc_problem(doc: Any) -> str | None:
    if not isinstance(doc, dict):
        return "the document is not an object"
    if type(doc.get("tp")) is not int or doc["tp"] < 1:
        return "tp must be an integer >= 1"
    if not isinstance(doc.get("device"), str) or not isinstance(doc.get("round"), int):
        return "device (string) and round (integer) are required"
    sides = doc.get("sides")
    if not isinstance(sides, dict) or sorted(sides) != sorted(TRACE_SIDES):
        return f"sides must hold exactly {', '.join(TRACE_SIDES)}"
    for side in TRACE_SIDES:
        s = sides[side]
        if not isinstance(s, dict):
            return f"sides.{side} must be an object"
        problem = _units_problem(s.get("units"), side)
        if problem:
            return problem
        fams = s.get("families")
        if not isinstance(fams, dict) or not all(type(v) is int and v >= 0 for v in fams.values()):
            return f"sides.{side}.families must map family names to counts"
    return None


def _all_r(plan: Any) -> bool:
    return isinstance(plan, dict) and all(plan.get(m) == "R/R" for m in MODULES)


def check_kernel_trace(root: Root, plan: Any, manifest: Any) -> list[Finding]:
    """The kernel-trace gate of a run directory (nothing when the run neither asked for a trace nor has one)."""
    config = manifest.get("config") if isinstance(manifest, dict) else None
    asked = isinstance(config, dict) and config.get("trace") is True
    if not root.lexists(KERNEL_TRACE):
        if asked:
            return [_f("KERNEL_TRACE_MISSING", f"the run asked for a kernel trace (--trace) but {KERNEL_TRACE} "
                       "is absent")]
        return []
    try:
        doc = root.read_json(KERNEL_TRACE)
    except InputError as e:
        return [e.finding]
    if not isinstance(doc, dict) or doc.get("schema") != KERNEL_TRACE_SCHEMA:
        got = str(doc.get("schema"))[:80] if isinstance(doc, dict) else None
        return [finding("SCHEMA_UNSUPPORTED", f"{KERNEL_TRACE}: schema is {got!r}, expected {KERNEL_TRACE_SCHEMA!r}",
                        check=CHECK, path=KERNEL_TRACE)]
    problem = _doc_problem(doc)
    if problem:
        return [_f("KERNEL_TRACE_INVALID", f"{KERNEL_TRACE}: {problem}")]
    out: list[Finding] = []
    per_side = {side: families(doc["sides"][side]["units"]) for side in TRACE_SIDES}
    for side in TRACE_SIDES:
        written = {k: v for k, v in doc["sides"][side]["families"].items() if v}
        if written != per_side[side]:
            out.append(_f("KERNEL_TRACE_DISAGREES", f"{KERNEL_TRACE} sides.{side}.families {written} differ from "
                          f"the families of its units, recomputed: {per_side[side]}", side=side))
    total: dict[str, int] = {}
    for fams in per_side.values():
        for k, v in fams.items():
            total[k] = total.get(k, 0) + v
    if _all_r(plan):
        needed = [f for f in REQUIRED_FAMILIES if f != "collective" or doc["tp"] > 1]
        missing = [f for f in needed if not total.get(f)]
        if missing:
            out.append(_f("KERNEL_FAMILY_MISSING", f"an all-R run's traced round ran no kernel of rlk famil"
                          f"{'y' if len(missing) == 1 else 'ies'} {', '.join(missing)} (on either side; tp "
                          f"{doc['tp']})", families=missing))
        for side in TRACE_SIDES:
            bad = {f: per_side[side][f] for f in FORBIDDEN_FAMILIES if per_side[side].get(f)}
            if bad:
                names = sorted({u[0] for u in doc["sides"][side]["units"]
                                if classify(u[0], u[1]) in bad})[:8]
                out.append(_f("VENDOR_KERNEL_IN_R", f"the {side} side of an all-R run ran vendor kernels "
                              f"{bad} in its traced round: {', '.join(names)}", side=side, families=bad))
    shown = "; ".join(f"{side}: " + (", ".join(f"{k} {v}" for k, v in fams.items()) or "nothing")
                      for side, fams in per_side.items())
    out.append(_f("KERNEL_TRACE_SUMMARY", f"round {doc['round']} traced on {doc['device'][:40]} (tp {doc['tp']}): "
                  f"{shown}", families=per_side))
    return out
