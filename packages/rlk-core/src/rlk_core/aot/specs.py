"""Every kernel specialisation ``rlk.triton`` can launch, as data: the input of the ahead-of-time build.

A :class:`Spec` is one compiled variant of one ``@triton.jit`` kernel: its constexprs (tile sizes, flags,
``PDL``), the element types of its pointer and descriptor arguments, the launch options (``num_warps``,
``num_stages``, ``enable_fp_fusion``), and the **layout class** of the runtime arguments Triton
specialises on at launch (a JIT launch compiles a separate variant per pattern of 16-byte aligned
pointers, integers divisible by 16 and integers equal to 1):

- ``aligned``: what a launch on contiguous, 16-byte aligned operands with sizes divisible by 16 gets —
  pointers and integer arguments marked divisible by 16, unit strides the constant 1 — the JIT's own
  binary for the common case;
- ``generic``: nothing assumed (no divisibility, no constant strides): valid for every launch the op
  accepts, the variant a compiled launcher falls back to (transposed views, odd sizes, ``N == 1``).

Nothing here is a copy of a launcher's table: the GEMM's tiles come from
:func:`rlk_core.ops.linear.tiles.shipped_tiles` and the rule's own tables (which kernel each tile runs
in), the last-row-block boxes from :func:`~rlk_core.ops.linear.tiles.rem_rows`, the row-wise kernels'
constexprs from each op's ``config``. :func:`linear_launch_specs` goes the other way — from a problem
shape through :func:`~rlk_core.ops.linear.tiles.config`, as ``ops/linear/triton.py::_launch`` does — so a
test can check that every launch finds its variant among :func:`enumerate_specs`.

The row-wise kernels' ``config`` functions live in their Triton modules, so enumerating imports Triton
(inside the functions; importing this module does not). The attention and log-prob families are enumerated in
:mod:`rlk_core.aot.specs_attention` and :mod:`rlk_core.aot.specs_logp` (all ``aligned``, with per-variant unit
and unmarked integers, :attr:`Spec.ones` / :attr:`Spec.plain`, as the JIT specialises their launches); the backward
kernels of the row-wise ops and linear's stored-layout GEMMs in :mod:`rlk_core.aot.specs_backward` (likewise).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

import torch

from rlk_core.ops.linear import tiles as rule

LAYOUTS = ("aligned", "generic")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TRITON_TYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
DEFAULT_SMS = 132  # H100 SXM / H200 / GH200: the persistent GEMM's NUM_PROGRAMS (a constexpr) on a full grid
DEFAULT_STAGES = 3  # Triton's default num_stages on CUDA (the row-wise launchers pass none)
# (head_dim, rotary_dim) pairs built for rope: D and R are constexprs of _rope_fwd_kernel, so each pair is its
# own family of binaries; other pairs are left to the JIT backend (recorded in the manifest's ``not_built``).
ROPE_SHAPES = ((64, 64), (128, 128), (256, 256), (128, 64))
RMS_MAX_H = 65536  # rms_norm's MAX_H (checked against the module by the tests)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One compiled variant of one kernel. Hashable; :attr:`key` is its identity."""

    op: str
    module: str  # the module defining the kernel
    kernel: str  # the @triton.jit function's name
    dtype: str  # the op's input dtype, e.g. "bf16"
    layout: str  # "aligned" or "generic"
    constexprs: tuple[tuple[str, Any], ...]
    pointers: tuple[tuple[str, str], ...]  # pointer argument -> Triton type ("*bf16"); others "*<dtype>"
    descriptors: tuple[tuple[str, tuple[int, int]], ...] = ()  # TMA descriptor argument -> box
    floats: tuple[str, ...] = ()  # fp32 scalar arguments
    ones: tuple[str, ...] = ()  # integer arguments the layout fixes to 1 (constexprs in the binary)
    plain: tuple[str, ...] = ()  # integer arguments an ``aligned`` variant does not mark divisible by 16
    num_warps: int = 4
    num_stages: int = DEFAULT_STAGES
    options: tuple[tuple[str, Any], ...] = ()  # other compile options (enable_fp_fusion)
    grid: str = ""  # name of the grid rule the launcher applies
    launch_pdl: bool = False  # launched with programmatic dependent launch (the PDL launch attribute)
    tile: tuple[int, ...] | None = None  # the GEMM tile tuple of ops/linear/tiles.py

    @property
    def key(self) -> tuple:
        return (self.module, self.kernel, self.dtype, self.layout, self.constexprs, self.pointers, self.descriptors,
                self.floats, self.ones, self.plain, self.num_warps, self.num_stages, self.options, self.launch_pdl)

    @property
    def name(self) -> str:
        c = ",".join(f"{k}={v}" for k, v in self.constexprs if not k.endswith("_desc") and not k.endswith("_ptr"))
        loose = f",plain={'+'.join(self.plain)}" if self.plain else ""
        ones = f",ones={'+'.join(o for o in self.ones if not o.startswith('stride'))}" if any(
            not o.startswith("stride") for o in self.ones) else ""
        return f"{self.kernel}[{self.dtype},{self.layout}{loose}{ones},w{self.num_warps},s{self.num_stages},{c}]"

    def identity(self) -> str:
        """A canonical JSON string of the variant (the input of the cubin's file-name hash; ``plain`` only where
        set, so the variants that have none keep the names they had before the field existed)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if not fields["plain"]:
            del fields["plain"]
        return json.dumps(fields, sort_keys=True, default=str)


def _t(dtype: torch.dtype) -> str:
    return TRITON_TYPE[dtype]


def int_class(value: int) -> str:
    """How Triton's JIT specialises an integer argument it may specialise (not ``do_not_specialize``): ``"1"``
    (the constant 1: a constexpr in the binary), ``"16"`` (marked divisible by 16) or ``""`` (neither).
    ``tests/core/test_aot.py`` checks this against Triton's own ``native_specialize_impl``."""
    return "1" if value == 1 else "16" if value % 16 == 0 else ""


def _linear_tma_spec(dtype: torch.dtype, tile: tuple[int, ...], rem: int, pdl: int, bias: bool, layout: str,
                     sms: int) -> Spec:
    c = rule.tile_config(tile, 0, dtype, True)
    bm, bn, bk, tail = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["TAIL_M"]
    small = tail or rem
    const = dict(HAS_BIAS=bias, IEEE=c["IEEE"], NUM_PROGRAMS=sms, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 GROUP_M=c["GROUP_M"], TAIL_M=tail, REM_M=rem, PDL=pdl)
    boxes = {"x_desc": (bm, bk), "w_desc": (bn, bk), "y_desc": (bm, bn)}
    if small:
        boxes.update(xt_desc=(small, bk), yt_desc=(small, bn))
    else:
        const.update(xt_desc=None, yt_desc=None)
    return Spec("linear", "rlk_core.ops.linear.triton", "_linear_tma_kernel", _t(dtype), layout,
                tuple(sorted(const.items())), (("b_ptr", "*" + _t(dtype)),), tuple(sorted(boxes.items())),
                num_warps=c["num_warps"], num_stages=c["num_stages"], grid="linear.persistent",
                launch_pdl=pdl == 2, tile=tuple(tile))


def _linear_ptr_spec(dtype: torch.dtype, out: torch.dtype, tile: tuple[int, ...], even_k: bool, bias: bool,
                     layout: str) -> Spec:
    c = rule.tile_config(tile, 0, dtype, False)
    const = dict(HAS_BIAS=bias, EVEN_K=even_k, IEEE=c["IEEE"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                 BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"])
    ptrs = {"x_ptr": _t(dtype), "w_ptr": _t(dtype), "b_ptr": _t(dtype if bias else out), "y_ptr": _t(out)}
    return Spec("linear", "rlk_core.ops.linear.triton", "_linear_fwd_kernel",
                _t(dtype) if out == dtype else f"{_t(dtype)}->{_t(out)}", layout, tuple(sorted(const.items())),
                tuple(sorted((k, "*" + v) for k, v in ptrs.items())),
                ones=("stride_xk", "stride_wk", "stride_yn") if layout == "aligned" else (),
                num_warps=c["num_warps"], num_stages=c["num_stages"], grid="linear.tiles", tile=tuple(tile))


def tma_tiles() -> list[tuple[int, ...]]:
    """The tiles the rule runs in the persistent TMA kernel (its TMA tables), sorted."""
    return sorted({*rule._SMALL_TMA, *rule._MID_TMA, *rule._TAIL_TMA, *(e[0] for e in rule._LARGE_TMA)})


def pointer_tiles(dtype: torch.dtype) -> list[tuple[int, ...]]:
    """The tiles the rule runs in the pointer-load kernel for ``dtype``, sorted."""
    if dtype == torch.float32:
        return [t for t in rule.shipped_tiles(dtype)]
    return sorted({*rule._DECODE, rule._SMALL_PTR, rule._LARGE_PTR})


def linear_specs(dtype: torch.dtype, sms: int = DEFAULT_SMS, layouts: Iterable[str] = LAYOUTS) -> list[Spec]:
    """Every variant ``linear`` (and ``linear_2d_into``, the log-prob backward GEMMs) can launch for ``dtype``.

    Tiles: :func:`~rlk_core.ops.linear.tiles.shipped_tiles`, each in the kernel(s) the rule runs it in
    (a tile named by ``shipped_tiles`` but in neither table raises: the enumerator must be taught it).
    TMA kernel (bf16/fp16, output in the input dtype): every last-row-block box ``rem_rows`` can give the
    tile (none with a tail), bias or not, and for the 128-row tiles of the row split the first launch
    (``PDL`` 1) and the second (``PDL`` 2, launched with PDL); ``NUM_PROGRAMS = sms``. Pointer kernel:
    ``EVEN_K`` both ways, bias or not, the output in the input dtype, and — without bias — fp32 (the
    log-prob backward's GEMMs)."""
    shipped = set(rule.shipped_tiles(dtype))
    tma = [t for t in tma_tiles() if t in shipped] if dtype != torch.float32 else []
    ptr = [t for t in pointer_tiles(dtype) if t in shipped]
    unplaced = shipped - set(tma) - set(ptr)
    if unplaced:
        raise RuntimeError(f"tiles {sorted(unplaced)} of shipped_tiles({dtype}) are in no kernel table the "
                           "AOT enumerator knows: teach rlk_core.aot.specs where they run")
    large = {e[0] for e in rule._LARGE_TMA}
    out: list[Spec] = []
    for layout in layouts:
        for tile in tma:
            tail = len(tile) > 6
            rems = {0} if tail else {rule.rem_rows(m, tile[0]) for m in range(1, 2 * tile[0] + 1)}
            pdls = (0, 1, 2) if tile in large and tile[0] == 128 else (0,)
            for rem in sorted(rems):
                for pdl in pdls:
                    for bias in (False, True):
                        out.append(_linear_tma_spec(dtype, tile, rem, pdl, bias, layout, sms))
        outs = (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
        for tile in ptr:
            for o in outs:
                for even_k in (False, True):
                    for bias in (False, True) if o == dtype else (False,):
                        out.append(_linear_ptr_spec(dtype, o, tile, even_k, bias, layout))
    return out


def linear_launch_specs(dtype: torch.dtype, m: int, n: int, k: int, tma: bool, sms: int = DEFAULT_SMS,
                        bias: bool = False, out: torch.dtype | None = None, layout: str = "aligned") -> list[Spec]:
    """The variants one ``linear`` call launches, derived as ``ops/linear/triton.py::_launch`` derives
    them (one, or two for a row split). ``tma`` as the launcher decides it (sm_90, TMA-compatible operands,
    output in the input dtype). The persistent kernel's ``NUM_PROGRAMS`` is ``sms`` here: the variant for a
    full grid (see the manifest's ``not_built`` for problems with fewer tiles than SMs)."""
    out = out or dtype
    cfg = dict(rule.config(dtype, m, n, k, tma and out == dtype, sms))
    rows, rest = cfg.pop("SPLIT_ROWS", 0), cfg.pop("REST", None)
    parts = [(cfg, rows, 1), (rest, m - rows, 2)] if rows else [(cfg, m, 0)]
    specs = []
    for c, rows_here, pdl in parts:
        tile = (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["GROUP_M"], c["num_warps"], c["num_stages"])
        tile += (c["TAIL_M"],) if c["TAIL_M"] else ()
        if c["TMA"]:
            rem = rule.rem_rows(rows_here, c["BLOCK_M"]) if c["REM_BOX"] and not c["TAIL_M"] else 0
            specs.append(_linear_tma_spec(dtype, tile, rem, pdl, bias, layout, sms))
        else:
            specs.append(_linear_ptr_spec(dtype, out, tile, c["EVEN_K"], bias, layout))
    return specs


def _pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def rms_norm_specs(dtype: torch.dtype, layouts: Iterable[str] = LAYOUTS) -> list[Spec]:
    """One variant per distinct ``config(H)`` (a function of ``next_pow2(H)``), weight in the input dtype or
    fp32; ``aligned`` only where H can be a multiple of 16 (``BLOCK_H >= 16``)."""
    from rlk_core.ops.rms_norm import triton as rms

    specs = []
    for layout in layouts:
        for h in _pow2_upto(RMS_MAX_H):
            c = rms.config(h)
            if layout == "aligned" and c["BLOCK_H"] < 16:
                continue
            for w in sorted({dtype, torch.float32}, key=str):
                ptrs = (("w_ptr", "*" + _t(w)), ("x_ptr", "*" + _t(dtype)), ("y_ptr", "*" + _t(dtype)))
                specs.append(Spec("rms_norm", rms.__name__, "_rms_norm_fwd_kernel",
                                  _t(dtype) if w == dtype else f"{_t(dtype)},w={_t(w)}", layout,
                                  (("BLOCK_H", c["BLOCK_H"]), ("ROWS", c["ROWS"])), ptrs, floats=("eps",),
                                  num_warps=c["num_warps"], grid="rms_norm.rows"))
    return specs


def swiglu_specs(dtype: torch.dtype, layouts: Iterable[str] = LAYOUTS) -> list[Spec]:
    """One variant per distinct ``config(I)`` (``BLOCK = min(2048, next_pow2(I))``)."""
    from rlk_core.ops.swiglu import triton as sw

    specs, seen = [], set()
    for layout in layouts:
        for inter in _pow2_upto(4096):
            c = sw.config(inter)
            if (layout, c["BLOCK"]) in seen or (layout == "aligned" and c["BLOCK"] < 16):
                continue
            seen.add((layout, c["BLOCK"]))
            ptrs = (("x_ptr", "*" + _t(dtype)), ("y_ptr", "*" + _t(dtype)))
            specs.append(Spec("swiglu", sw.__name__, "_swiglu_fwd_kernel", _t(dtype), layout,
                              (("BLOCK", c["BLOCK"]),), ptrs, num_warps=c["num_warps"], grid="swiglu.rows_x_blocks"))
    return specs


def rope_specs(dtype: torch.dtype, shapes: Iterable[tuple[int, int]] = ROPE_SHAPES,
               layouts: Iterable[str] = LAYOUTS) -> list[Spec]:
    """For each ``(head_dim, rotary_dim)`` in ``shapes``: one variant per distinct ``config(n_heads,
    rotary_dim // 2)`` over every head count, positions int32 or int64, ``enable_fp_fusion=False``."""
    from rlk_core.ops._triton_common import next_pow2
    from rlk_core.ops.rope import triton as rp

    specs = []
    for layout in layouts:
        for d, r in shapes:
            half = r // 2
            configs = {tuple(sorted(rp.config(nh, half).items())) for nh in _pow2_upto(1 << 16)}
            for cfg in sorted(configs):
                c = dict(cfg)
                const = dict(HALF=half, D=d, R=r, BLOCK_H=c["BLOCK_H"], BLOCK_HALF=c["BLOCK_HALF"],
                             BLOCK_PASS=next_pow2(d - r) if d > r else 0)
                for pos in ("*i32", "*i64"):
                    ptrs = (("cos_ptr", "*fp32"), ("pos_ptr", pos), ("sin_ptr", "*fp32"),
                            ("x_ptr", "*" + _t(dtype)), ("y_ptr", "*" + _t(dtype)))
                    specs.append(Spec("rope", rp.__name__, "_rope_fwd_kernel", f"{_t(dtype)},pos={pos[1:]}", layout,
                                      tuple(sorted(const.items())), ptrs, num_warps=c["num_warps"],
                                      options=(("enable_fp_fusion", False),), grid="rope.tokens_x_heads"))
    return specs


OPS = ("linear", "rms_norm", "swiglu", "rope", "attention", "kv_cache_write", "attention_backward", "logp",
       "rms_norm_backward", "swiglu_backward", "rope_backward", "linear_backward")


def enumerate_specs(ops: Iterable[str] = OPS, dtypes: Iterable[torch.dtype] = DTYPES, sms: int = DEFAULT_SMS,
                    layouts: Iterable[str] = LAYOUTS) -> list[Spec]:
    """Every variant of ``ops`` for ``dtypes`` (duplicates removed, order stable). ``layouts`` selects the
    row-wise and GEMM layout classes; the attention and log-prob variants are all ``aligned`` (their own
    modules, :mod:`rlk_core.aot.specs_attention` and :mod:`rlk_core.aot.specs_logp`, say why), and so are the backward
    kernels' (:mod:`rlk_core.aot.specs_backward`)."""
    from rlk_core.aot import specs_attention as A
    from rlk_core.aot import specs_backward as BW
    from rlk_core.aot import specs_logp as P

    layouts = tuple(layouts)
    aligned = "aligned" in layouts
    makers = {"linear": lambda dt: linear_specs(dt, sms, layouts), "rms_norm": lambda dt: rms_norm_specs(dt, layouts),
              "swiglu": lambda dt: swiglu_specs(dt, layouts), "rope": lambda dt: rope_specs(dt, layouts=layouts),
              "attention": lambda dt: A.forward_specs(dt) if aligned else [],
              "kv_cache_write": lambda dt: A.kv_write_specs(dt) if aligned else [],
              "attention_backward": lambda dt: A.backward_specs(dt) if aligned else [],
              "logp": lambda dt: P.logp_specs(dt, sms) if aligned else [],
              **{op: (lambda dt, op=op: BW.backward_specs(op, dt, sms) if aligned else []) for op in BW.OPS}}
    unknown = set(ops) - set(makers)
    if unknown:
        raise ValueError(f"no AOT enumerator for {sorted(unknown)}; known: {OPS}")
    seen: dict[tuple, Spec] = {}
    for op in ops:
        for dt in dtypes:
            for s in makers[op](dt):
                seen.setdefault(s.key, s)
    return list(seen.values())


def not_built(sms: int = DEFAULT_SMS) -> list[dict[str, str]]:
    """Launches of ``rlk.triton`` no enumerated variant serves exactly, and why (written into the manifest)."""
    return [
        {"kernel": "_linear_tma_kernel", "what": f"NUM_PROGRAMS < {sms} (problems with fewer tiles than SMs)",
         "why": "NUM_PROGRAMS is a constexpr equal to min(tiles, #SMs), so the JIT compiles one variant per tile "
                f"count 1..{sms - 1}; the build makes NUM_PROGRAMS = {sms} only. Launched with a grid of `tiles` "
                "programs that binary has program p compute tile p and stop, as the JIT's does — to be shown "
                "bitwise on a GPU — or the kernel takes NUM_PROGRAMS as a runtime argument (a kernel change)."},
        {"kernel": "_linear_tma_kernel", "what": "other SM counts",
         "why": f"NUM_PROGRAMS = {sms} is built (H100 SXM, H200, GH200); other sm_90 parts (H100 PCIe: 114, "
                "H20: 78) need a build with --sms or the runtime-argument change above."},
        {"kernel": "*", "what": "integer arguments >= 2**31 (i64 variants) and 1-valued sizes",
         "why": "the JIT specialises those per launch; the generic variant (i32, no assumption) serves sizes "
                "equal to 1, arguments past int32 are left to the JIT backend."},
        {"kernel": "_rms_norm_fwd_kernel", "what": "weight dtype other than the input dtype or fp32",
         "why": "rare mixed dtypes (fp16 weight with bf16 input and the like): left to the JIT backend."},
        {"kernel": "_rope_fwd_kernel", "what": f"(head_dim, rotary_dim) outside {list(ROPE_SHAPES)}",
         "why": "D and R are constexprs: each pair is a family of binaries; other pairs are left to the JIT "
                "backend (extend ROPE_SHAPES)."},
    ] + _family_not_built()


def _family_not_built() -> list[dict[str, str]]:
    from rlk_core.aot import specs_attention as A
    from rlk_core.aot import specs_backward as BW
    from rlk_core.aot import specs_logp as P

    return A.not_built() + P.not_built() + BW.not_built()
