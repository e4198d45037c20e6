"""AOT variants of the log-prob kernels (:mod:`rlk_core.ops.token_logprobs.triton`, shared by
``token_logprobs``, its backward, ``logp_partials`` / ``merge_logp_partials`` and ``linear_logprobs``).

Their constexprs are the module's constants (``BLOCK_T``, the leaf ``BLOCK``, the merge tree's ``P`` and
``GROUPS``, ``NUM_WARPS``), so what multiplies the variants is the JIT's specialisation of the integer
arguments (sizes, column offsets, strides) and the pointer types (logits dtype, target ids int32 / int64):

- leaf-block partials and the gradient: ``aligned`` with a unit column stride — every vocabulary whose group
  width ``ceil(V / 8)`` is a multiple of 16 (V a multiple of 128: Qwen 151936 / 152064, Llama-3 128256, 32000,
  ...) in any tensor-parallel split into whole groups; the first leaf slot of a ``linear_logprobs`` chunk
  (``slot0``) in each of its three classes;
- the group merge (``_merge_blocks_kernel``): every ``P`` (padded blocks per group, a constexpr, up to
  ``MAX_PADDED_BLOCKS``) with the strides of a contiguous ``[T, G, P]`` buffer for each group count
  ``G = 1..GROUPS`` (the shard's groups) whose leaf blocks the aligned variant writes (:func:`aligned_partials`):
  the classes those strides fall in, as the rule gives them;
- the final merge: the row stride ``K`` of each group count.

Other layouts (vocabularies not a multiple of 128, odd strides, misaligned slices) get another binary from the
JIT: ``rlk.cuda`` declines them and ``rlk.triton`` runs them (:func:`not_built`).
"""

from __future__ import annotations

import torch

from rlk_core.aot.specs import DEFAULT_SMS, TRITON_TYPE, Spec, int_class

MODULE = "rlk_core.ops.token_logprobs.triton"
TARGETS = ("*i32", "*i64")
F32 = "*fp32"


def _classes(values: dict[str, int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(ones, plain)`` of named integer arguments, as the JIT specialises them."""
    ones = tuple(n for n, v in values.items() if int_class(v) == "1")
    plain = tuple(n for n, v in values.items() if int_class(v) == "")
    return ones, plain


def block_spec(dtype: torch.dtype, target: str, slot0: int) -> Spec:
    """``_logp_block_fwd_kernel`` on aligned logits (unit column stride), the first slot ``slot0``'s class."""
    from rlk_core.ops.token_logprobs import triton as tt

    ones, plain = _classes({"slot0": slot0})
    ptrs = {"temp_ptr": F32, "target_ptr": target, "m_ptr": F32, "s_ptr": F32, "zt_ptr": F32}
    return Spec("logp", MODULE, "_logp_block_fwd_kernel", f"{TRITON_TYPE[dtype]},target={target[1:]}", "aligned",
                (("BLOCK", tt.L.BLOCK), ("BLOCK_T", tt.BLOCK_T)), tuple(sorted(ptrs.items())),
                ones=("stride_xn", *ones), plain=plain, num_warps=tt.NUM_WARPS, grid="logp.rows_x_blocks")


def grad_spec(dtype: torch.dtype, target: str) -> Spec:
    """``_logp_grad_kernel`` on aligned logits and a gradient of the logits' dtype (unit column strides)."""
    from rlk_core.ops.token_logprobs import triton as tt

    ptrs = {"temp_ptr": F32, "target_ptr": target, "lse_ptr": F32, "glogp_ptr": F32, "glse_ptr": F32}
    return Spec("logp", MODULE, "_logp_grad_kernel", f"{TRITON_TYPE[dtype]},target={target[1:]}", "aligned",
                (("BLOCK_N", tt.GRAD_BLOCK_N), ("BLOCK_T", tt.GRAD_BLOCK_T)), tuple(sorted(ptrs.items())),
                ones=("stride_xn", "stride_on"), num_warps=tt.NUM_WARPS, grid="logp.rows_x_cols")


def merge_blocks_spec(groups: int, p: int) -> Spec:
    """``_merge_blocks_kernel`` over a contiguous ``[T, groups, p]`` buffer into ``[T, groups]``."""
    from rlk_core.ops.token_logprobs import triton as tt

    ones, plain = _classes({"stride_t": groups * p, "stride_g": p, "stride_gt": groups})
    return Spec("logp", MODULE, "_merge_blocks_kernel", "fp32", "aligned",
                (("BLOCK_T", tt.MERGE_BLOCK_T), ("P", p)), (), ones=ones, plain=plain, num_warps=tt.NUM_WARPS,
                options=(("enable_fp_fusion", False),), grid="logp.rows_x_groups")


def merge_groups_spec(k: int) -> Spec:
    """``_merge_groups_kernel`` over contiguous ``[T, k]`` group partials."""
    from rlk_core.ops.token_logprobs import triton as tt

    ones, plain = _classes({"stride_mt": k, "stride_st": k})
    return Spec("logp", MODULE, "_merge_groups_kernel", "fp32", "aligned",
                (("BLOCK_T", tt.MERGE_BLOCK_T), ("GROUPS", tt.L.GROUPS)), (), ones=ones, plain=plain,
                num_warps=tt.NUM_WARPS, options=(("enable_fp_fusion", False),), grid="logp.rows")


def aligned_partials(groups: int, p: int) -> bool:
    """Whether the block partials of a ``[T, groups, p]`` buffer are written by the built (aligned) leaf-block
    variant: its row stride ``groups * p`` a multiple of 16 and each group's slots 16-byte aligned (fp32: ``p`` a
    multiple of 4). Only those buffers reach the group merge on ``rlk.cuda`` (the other calls are declined)."""
    return int_class(groups * p) == "16" and p * 4 % 16 == 0


def dhidden_gemm_spec(dtype: torch.dtype, sms: int = DEFAULT_SMS) -> Spec:
    """``linear_logprobs_backward``'s ``dhidden`` product ``dz [T, C] @ W[chunk]`` (``linear_2d_into(dz, W[chunk].t(),
    part)``, bf16 / fp16): the stored-layout TMA kernel reading ``dz`` and ``W[chunk]`` as stored (``B_KN``) into an
    fp32 output stored by pointers, the rule's fp32-output tile. Its other product, ``dW[chunk] = dz^T @ hidden``, is
    the linear backward's dW variant (:mod:`rlk_core.aot.specs_backward`); in fp32 both are that module's pointer
    kernels."""
    from rlk_core.aot import specs_backward as BW
    from rlk_core.ops.linear import tiles as rule

    return BW.stored_tma_spec(dtype, rule._STORED_F32_OUT, False, True, sms, f32_out=True, op="logp")


def logp_specs(dtype: torch.dtype, sms: int = DEFAULT_SMS) -> list[Spec]:
    """Every variant above a ``dtype`` logits call launches: its leaf-block and gradient variants, the merges —
    fp32 whatever the logits dtype, so every dtype's list has them (``enumerate_specs`` keeps one of each; a build
    of bf16 alone once left them out, and rlk.cuda declined every bf16 ``token_logprobs`` call) — and
    :func:`dhidden_gemm_spec` for a 16-bit dtype."""
    from rlk_core.ops.token_logprobs import triton as tt

    out = [dhidden_gemm_spec(dtype, sms)] if dtype != torch.float32 else []
    for target in TARGETS:
        for slot0 in (0, 1, 3):  # a multiple of 16, one, neither: the three classes of a chunk's first slot
            out.append(block_spec(dtype, target, slot0))
        out.append(grad_spec(dtype, target))
    seen: dict[tuple, Spec] = {}
    p = 1
    while p <= tt.MAX_PADDED_BLOCKS:
        for g in range(1, tt.L.GROUPS + 1):
            if aligned_partials(g, p):
                s = merge_blocks_spec(g, p)
                seen.setdefault(s.key, s)
        p *= 2
    for k in range(1, tt.L.GROUPS + 1):
        s = merge_groups_spec(k)
        seen.setdefault(s.key, s)
    return out + list(seen.values())


def not_built() -> list[dict[str, str]]:
    return [
        {"kernel": "_logp_block_fwd_kernel, _logp_grad_kernel",
         "what": "group widths, column offsets or row strides that are not multiples of 16 (vocabularies that "
                 "are not multiples of 128), non-unit column strides, slices not 16-byte aligned",
         "why": "the JIT specialises those integers and pointers; only the aligned pattern is built, the rest "
                "runs on rlk.triton."},
        {"kernel": "linear_logprobs backward GEMMs", "what": "hidden sizes or chunk widths whose strides are not "
                                                             "multiples of 16, misaligned shards",
         "why": "the dhidden and dW products are the stored-layout kernels' aligned variants (dW's is the linear "
                "backward's: a build without linear_backward declines linear_logprobs_backward); the rest runs on "
                "rlk.triton."},
    ]
