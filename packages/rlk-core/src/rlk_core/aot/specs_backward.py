"""AOT variants of the backward kernels of the row-wise ops and of ``linear``'s stored-layout GEMMs.

- ``rms_norm_backward``: ``_rms_norm_bwd_kernel`` (one variant per distinct ``config(H)``, the weight in the input
  dtype or fp32) and ``_rms_norm_bwd_dw_kernel`` (its constants; per weight dtype);
- ``swiglu_backward``: ``_swiglu_bwd_kernel``, one variant per distinct ``config(I)``;
- ``rope_backward``: ``_rope_bwd_kernel`` for each built ``(head_dim, rotary_dim)`` (:data:`~rlk_core.aot.specs.
  ROPE_SHAPES`), one variant per distinct ``config(heads, rotary_dim // 2)`` and class of the head count (the JIT
  specialises ``NH``: 1, a multiple of 16, neither), positions int32 or int64, ``enable_fp_fusion=False``;
- ``linear_backward``: the kernels :func:`rlk_core.ops.linear.triton.stored_layout` selects for the backward's
  GEMMs (``ops/linear/__init__.py::_backward``) — dx = dy W (W given as ``W.t()``: ``B_KN``), dW = dy^T x (both
  given transposed: ``A_KM`` and ``B_KN``) and db = dy^T 1 (a column of ones of stride 0) — for every tile
  :func:`~rlk_core.ops.linear.tiles.stored_config` picks: the persistent TMA kernel (bf16/fp16, output in the
  input dtype stored by TMA, ``NUM_PROGRAMS = sms``) and the pointer kernel (fp32; outputs of at most
  ``NARROW_N`` columns, db's among them), each with the unit and zero strides those three calls give it.

All are ``aligned`` variants, resolved per launch as the JIT specialises it (``rlk_core.ops._cuda_calls.resolve``):
every pointer 16-byte aligned, every integer argument the kernel specialises a multiple of 16 — row lengths,
intermediate and head sizes and the GEMM's output columns multiples of 16, as in every model rlk targets — except
the integers the variant fixes to 1 (:attr:`Spec.ones`) or leaves unmarked (:attr:`Spec.plain`). Other launches
(sizes not multiples of 16, misaligned views, other operand layouts) get another binary from the JIT: ``rlk.cuda``
declines them and ``rlk.triton`` runs them (:func:`not_built`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlk_core.aot.specs import DEFAULT_SMS, RMS_MAX_H, ROPE_SHAPES, TRITON_TYPE, Spec, int_class

F32 = "*fp32"


def _t(dtype: torch.dtype) -> str:
    return TRITON_TYPE[dtype]


def _pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def _classes(values: dict[str, int]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """``(ones, plain)`` of named integer arguments, as the JIT specialises them."""
    ones = tuple(n for n, v in values.items() if int_class(v) == "1")
    plain = tuple(n for n, v in values.items() if int_class(v) == "")
    return ones, plain


# -- row-wise ops -----------------------------------------------------------------------------------------
RMS_MODULE = "rlk_core.ops.rms_norm.triton"
SWIGLU_MODULE = "rlk_core.ops.swiglu.triton"
ROPE_MODULE = "rlk_core.ops.rope.triton"


def rms_name(dtype: torch.dtype, wdtype: torch.dtype) -> str:
    """The variant's dtype string: the input's, and the weight's where it differs (as the forward's)."""
    return _t(dtype) if wdtype == dtype else f"{_t(dtype)},w={_t(wdtype)}"


def rms_norm_backward_specs(dtype: torch.dtype) -> list[Spec]:
    """``_rms_norm_bwd_kernel`` per distinct ``config(H)`` with ``BLOCK_H >= 16`` (H a multiple of 16 fits), the
    gradient and dx in the input dtype, the weight in it or fp32; ``_rms_norm_bwd_dw_kernel`` per weight dtype."""
    from rlk_core.ops.rms_norm import triton as rms

    specs = []
    for wdtype in sorted({dtype, torch.float32}, key=str):
        for h in _pow2_upto(RMS_MAX_H):
            c = rms.config(h)
            if c["BLOCK_H"] < 16:
                continue
            ptrs = {"x_ptr": _t(dtype), "w_ptr": _t(wdtype), "g_ptr": _t(dtype), "dx_ptr": _t(dtype),
                    "part_ptr": "fp32"}
            specs.append(Spec("rms_norm_backward", RMS_MODULE, "_rms_norm_bwd_kernel", rms_name(dtype, wdtype),
                              "aligned", (("BLOCK_H", c["BLOCK_H"]), ("ROWS", c["ROWS"])),
                              tuple(sorted((k, "*" + v) for k, v in ptrs.items())), floats=("eps",),
                              num_warps=c["num_warps"], grid="rms_norm.backward_programs"))
        specs.append(rms_dw_spec(wdtype))
    return specs


def rms_dw_spec(wdtype: torch.dtype) -> Spec:
    """``_rms_norm_bwd_dw_kernel`` merging fp32 partials into a weight gradient of ``wdtype``."""
    from rlk_core.ops.rms_norm import triton as rms

    return Spec("rms_norm_backward", RMS_MODULE, "_rms_norm_bwd_dw_kernel", f"dw={_t(wdtype)}", "aligned",
                (("BLOCK_N", rms.DW_BLOCK_N), ("BLOCK_P", rms.DW_BLOCK_P)),
                (("dw_ptr", "*" + _t(wdtype)), ("part_ptr", F32)), num_warps=rms.DW_WARPS, grid="rms_norm.dw_columns")


def swiglu_backward_specs(dtype: torch.dtype) -> list[Spec]:
    """``_swiglu_bwd_kernel`` per distinct ``config(I)`` with ``BLOCK >= 16``."""
    from rlk_core.ops.swiglu import triton as sw

    specs, seen = [], set()
    for inter in _pow2_upto(4096):
        c = sw.config(inter)
        if c["BLOCK"] < 16 or c["BLOCK"] in seen:
            continue
        seen.add(c["BLOCK"])
        ptrs = (("dx_ptr", "*" + _t(dtype)), ("g_ptr", "*" + _t(dtype)), ("x_ptr", "*" + _t(dtype)))
        specs.append(Spec("swiglu_backward", SWIGLU_MODULE, "_swiglu_bwd_kernel", _t(dtype), "aligned",
                          (("BLOCK", c["BLOCK"]),), ptrs, num_warps=c["num_warps"], grid="swiglu.rows_x_blocks"))
    return specs


def rope_name(dtype: torch.dtype, pos: str) -> str:
    return f"{_t(dtype)},pos={pos}"


def rope_backward_specs(dtype: torch.dtype, shapes: Iterable[tuple[int, int]] = ROPE_SHAPES,
                        max_heads: int = 1 << 16) -> list[Spec]:
    """``_rope_bwd_kernel`` for each ``(head_dim, rotary_dim)`` of ``shapes``: one variant per distinct pair of
    ``config(heads, rotary_dim // 2)`` and the head count's class over ``1..max_heads`` heads (the strides, multiples
    of the head dim, are multiples of 16), positions int32 or int64."""
    from rlk_core.ops._triton_common import next_pow2
    from rlk_core.ops.rope import triton as rp

    specs = []
    for d, r in shapes:
        half = r // 2
        seen: dict[tuple, int] = {}
        # config reads next_pow2(heads) only: 1, 2 and each power of two p >= 4 with p - 1 (odd: unmarked) give every
        # (config, class) pair of 1..max_heads (tests/core/test_aot.py checks this against every head count)
        for nh in sorted({1, 2, *(q for p in _pow2_upto(max_heads) if p >= 4 for q in (p - 1, p))}):
            c = rp.config(nh, half)
            seen.setdefault((tuple(sorted(c.items())), int_class(nh)), nh)
        for (cfg, _), nh in sorted(seen.items()):
            c = dict(cfg)
            const = dict(HALF=half, D=d, R=r, BLOCK_H=c["BLOCK_H"], BLOCK_HALF=c["BLOCK_HALF"],
                         BLOCK_PASS=next_pow2(d - r) if d > r else 0)
            ones, plain = _classes({"NH": nh})
            for pos in ("i32", "i64"):
                ptrs = (("cos_ptr", F32), ("dx_ptr", "*" + _t(dtype)), ("g_ptr", "*" + _t(dtype)),
                        ("pos_ptr", "*" + pos), ("sin_ptr", F32))
                specs.append(Spec("rope_backward", ROPE_MODULE, "_rope_bwd_kernel", rope_name(dtype, pos), "aligned",
                                  tuple(sorted(const.items())), ptrs, ones=ones, plain=plain,
                                  num_warps=c["num_warps"], options=(("enable_fp_fusion", False),),
                                  grid="rope.tokens_x_heads"))
    return specs


# -- linear's stored-layout GEMMs ---------------------------------------------------------------------------
LINEAR_MODULE = "rlk_core.ops.linear.triton"
# the backward's three GEMMs through the stored-layout kernels: (A_KM, B_KN) of the TMA kernel, and the pointer
# kernel's integers the operands' layout fixes to 1 (the unit strides; db's one output column) — stride_bk of db is
# its ones' stride 0, a multiple of 16 as the JIT reads it
STORED_CALLS = {
    "dx": {"tma": (False, True), "ones": ("stride_ak", "stride_bn", "stride_yn")},
    "dw": {"tma": (True, True), "ones": ("stride_am", "stride_bn", "stride_yn")},
    "db": {"tma": None, "ones": ("N", "stride_am", "stride_bn", "stride_ym", "stride_yn")},
}


def stored_tma_spec(dtype: torch.dtype, tile: tuple[int, ...], a_km: bool, b_kn: bool, sms: int,
                    f32_out: bool = False, op: str = "linear_backward") -> Spec:
    """``_linear_bwd_tma_kernel`` with the output in the input dtype stored by TMA (``Y_TMA``), or (``f32_out``) an
    fp32 output stored by pointers (``Y_TMA`` False, no y descriptor: ``linear_2d_into``'s fp32 products)."""
    from rlk_core.ops.linear import tiles as rule

    c = rule.stored_tile_config(tile, dtype, True)
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    const = dict(A_KM=a_km, B_KN=b_kn, Y_TMA=not f32_out, NUM_PROGRAMS=sms, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 GROUP_M=c["GROUP_M"])
    boxes = {"a_desc": (bk, bm) if a_km else (bm, bk), "b_desc": (bk, bn) if b_kn else (bn, bk), "y_desc": (bm, bn)}
    if f32_out:
        const["y_desc"] = None
        del boxes["y_desc"]
    out = "fp32" if f32_out else _t(dtype)
    return Spec(op, LINEAR_MODULE, "_linear_bwd_tma_kernel", f"{_t(dtype)}->fp32" if f32_out else _t(dtype),
                "aligned", tuple(sorted(const.items())), (("y_ptr", "*" + out),), tuple(sorted(boxes.items())),
                ones=("stride_yn",), num_warps=c["num_warps"], num_stages=c["num_stages"],
                grid="linear.stored_persistent", tile=tuple(tile))


def stored_ptr_spec(dtype: torch.dtype, tile: tuple[int, ...], ones: tuple[str, ...]) -> Spec:
    """``_linear_bwd_kernel`` with these unit integers (every other one a multiple of 16)."""
    from rlk_core.ops.linear import tiles as rule

    c = rule.stored_tile_config(tile, dtype, False)
    const = dict(IEEE=c["IEEE"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"])
    ptrs = (("a_ptr", "*" + _t(dtype)), ("b_ptr", "*" + _t(dtype)), ("y_ptr", "*" + _t(dtype)))
    return Spec("linear_backward", LINEAR_MODULE, "_linear_bwd_kernel", _t(dtype), "aligned",
                tuple(sorted(const.items())), ptrs, ones=tuple(sorted(ones)), num_warps=c["num_warps"],
                num_stages=c["num_stages"], grid="linear.stored_tiles", tile=tuple(tile))


def linear_backward_specs(dtype: torch.dtype, sms: int = DEFAULT_SMS) -> list[Spec]:
    """Every stored-layout variant the backward's GEMMs launch for ``dtype`` on an sm_90 device of ``sms`` SMs with
    the sizes multiples of 16: the rule's TMA tiles for dx and dW (bf16/fp16), its pointer tile for dx and dW in fp32
    (no TMA), its narrow tile for dx and dW of 16 columns and for db (every dtype)."""
    from rlk_core.ops.linear import tiles as rule

    out = []
    if dtype != torch.float32:
        for tile, _ in rule._STORED_TMA:
            for call in ("dx", "dw"):
                out.append(stored_tma_spec(dtype, tile, *STORED_CALLS[call]["tma"], sms))
    else:
        for call in ("dx", "dw"):
            out.append(stored_ptr_spec(dtype, rule._STORED_PTR[dtype], STORED_CALLS[call]["ones"]))
    for call in ("dx", "dw", "db"):
        out.append(stored_ptr_spec(dtype, rule._STORED_NARROW[dtype], STORED_CALLS[call]["ones"]))
    return out


def backward_specs(op: str, dtype: torch.dtype, sms: int = DEFAULT_SMS) -> list[Spec]:
    makers = {"rms_norm_backward": rms_norm_backward_specs, "swiglu_backward": swiglu_backward_specs,
              "rope_backward": rope_backward_specs, "linear_backward": lambda dt: linear_backward_specs(dt, sms)}
    return makers[op](dtype)


OPS = ("rms_norm_backward", "swiglu_backward", "rope_backward", "linear_backward")


def not_built() -> list[dict[str, str]]:
    return [
        {"kernel": "_rms_norm_bwd_kernel, _swiglu_bwd_kernel, _rope_bwd_kernel",
         "what": "row lengths, intermediate sizes or strides that are not multiples of 16, misaligned views, a "
                 "gradient of another dtype than the input, (head_dim, rotary_dim) outside ROPE_SHAPES",
         "why": "the JIT specialises those integers and pointers; only the aligned pattern is built, the rest runs "
                "on rlk.triton."},
        {"kernel": "_linear_bwd_tma_kernel, _linear_bwd_kernel",
         "what": "stored-layout GEMMs other than the backward's dx / dW / db (a transposed x with W as stored), "
                 "output columns not multiples of 16, an fp32 output (linear_2d_into), misaligned operands",
         "why": "other layouts and integer classes are other JIT binaries: left to rlk.triton."},
    ]
