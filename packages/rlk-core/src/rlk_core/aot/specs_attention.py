"""AOT variants of the attention kernels (:mod:`rlk_core.ops.attention.triton`, ``triton_backward``), derived from
their launchers' own rules: ``config`` and ``CONFIGS`` (tile heights per dtype, head size and form), the GQA rule
of ``_supports_heads`` (the padded group ``G_PAD`` up to the smallest ``BLOCK_M``), ``KV_TMA`` as ``_launch`` keeps
or drops it, and the JIT's own specialisation of the integer arguments these kernels take.

Layout: every variant here is ``aligned`` — every pointer 16-byte aligned and every specialised integer marked
divisible by 16 — except the integers the launch fixes to 1 (``ones``: unit head-dim strides, and whatever the
JIT folds into a constant) and those a served launch cannot make divisible (``plain``: ``kv_cache_write``'s head
count and page size below 16). A launch with any other pattern gets another binary from the JIT, which is not
built: ``rlk.cuda`` declines it (``supports``) and ``rlk.triton`` runs it.

Built: head sizes :data:`HEAD_DIMS` (``HEAD_D`` and ``D_PAD`` are constexprs), every dtype with a ``CONFIGS``
entry, every ``G_PAD`` the rule accepts; ``kv_cache_write`` for up to :data:`KV_HEADS_MAX` KV heads per rank and
every page-size class; the backward for ``head_dim <= MAX_HEAD_DIM`` and the GQA groups
:data:`BACKWARD_GROUPS` (``G`` is a constexpr of every backward kernel: each group size is its own family).
What is not built is listed by :func:`not_built`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from rlk_core.aot.specs import DEFAULT_STAGES, TRITON_TYPE, Spec, int_class

HEAD_DIMS = (64, 128, 256)
KV_HEADS_MAX = 128  # kv_cache_write: H_PAD is a constexpr; head counts 1..128 per rank are built
PAGE_SIZES = tuple(1 << i for i in range(12))  # kv_cache_write's page_size is specialised: 1 / < 16 / 16k classes
BACKWARD_GROUPS = (1, 2, 4, 5, 6, 7, 8)  # Hq / Hkv of the backward (a constexpr): the GQA ratios of Qwen2.5/3, Llama 3
INT32 = "*i32"
MODULE = "rlk_core.ops.attention.triton"
BACKWARD_MODULE = "rlk_core.ops.attention.triton_backward"
FORWARD = "_attention_fwd_kernel"
KV_WRITE = "_kv_cache_write_kernel"
FWD_ONES = ("stride_qd", "stride_kd", "stride_vd", "stride_od")


def _pow2_upto(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


def g_pads(dtype: torch.dtype, head_dim: int) -> list[int]:
    """The padded GQA group sizes ``_supports_heads`` accepts for ``(dtype, head_dim)``: up to the smallest
    ``BLOCK_M`` of its configurations (a tile holds whole groups)."""
    from rlk_core.ops._triton_common import next_pow2
    from rlk_core.ops.attention import triton as at

    d_pad = max(16, next_pow2(head_dim))
    return _pow2_upto(min(c[0] for c in at.CONFIGS[(dtype, d_pad)].values()))


def forward_spec(dtype: torch.dtype, head_dim: int, g_pad: int, paged: bool, form: str, kv_tma: bool) -> Spec:
    """The variant ``_launch`` compiles for one call: ``config(dtype, head_dim, form)`` with ``KV_TMA`` as the
    call keeps it (``kv_tma`` is the launcher's decision), ``PAGED``, ``G_PAD``; ``lens`` absent (``None``) in
    varlen, ``k_desc``/``v_desc`` absent without TMA."""
    from rlk_core.ops.attention import triton as at

    cfg = dict(at.config(dtype, head_dim, form))
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    cfg.pop("KV_TMA")
    const = dict(cfg, G_PAD=g_pad, PAGED=paged, KV_TMA=kv_tma)
    ptrs = {"table_ptr": INT32, "cu_q_ptr": INT32, "qpos_ptr": INT32}
    boxes = {}
    if kv_tma:
        boxes = {"k_desc": (cfg["BLOCK_N"], cfg["D_PAD"]), "v_desc": (cfg["BLOCK_N"], cfg["D_PAD"])}
    else:
        const.update(k_desc=None, v_desc=None)
    if paged:
        ptrs["lens_ptr"] = INT32
    else:
        const["lens_ptr"] = None
    return Spec("attention", MODULE, FORWARD, TRITON_TYPE[dtype], "aligned", tuple(sorted(const.items())),
                tuple(sorted(ptrs.items())), tuple(sorted(boxes.items())), floats=("qk_scale",), ones=FWD_ONES,
                num_warps=warps, num_stages=stages, options=(("enable_fp_fusion", False),), grid="attention.tiles")


def forward_specs(dtype: torch.dtype, head_dims: Iterable[int] | None = None) -> list[Spec]:
    """Every variant the three forward ops can launch for ``dtype``: varlen (the ``prefill`` form, contiguous
    K/V, ``KV_TMA`` where the config has it and also without, as ``kv_tma_ok`` may drop it), chunked prefill
    and decode over a paged cache (``prefill`` / ``decode`` forms, pointer loads), every accepted ``G_PAD``."""
    from rlk_core.ops._triton_common import next_pow2
    from rlk_core.ops.attention import triton as at

    out = []
    for d in HEAD_DIMS if head_dims is None else head_dims:
        if (dtype, max(16, next_pow2(d))) not in at.CONFIGS:
            continue
        for g in g_pads(dtype, d):
            for paged, form in ((False, "prefill"), (True, "prefill"), (True, "decode")):
                tma = bool(at.config(dtype, d, form)["KV_TMA"]) and not paged
                for kv_tma in sorted({tma, False}):
                    out.append(forward_spec(dtype, d, g, paged, form, kv_tma))
    return out


def kv_write_spec(dtype: torch.dtype, head_dim: int, heads: int, page_size: int) -> Spec:
    """The variant of ``kv_cache_write`` for ``heads`` KV heads and a page size: ``H_PAD`` and the JIT's
    specialisation of ``H`` and ``page_size`` (1: a constant; not a multiple of 16: unmarked)."""
    from rlk_core.ops._triton_common import next_pow2

    const = dict(HEAD_D=head_dim, D_PAD=next_pow2(head_dim), H_PAD=next_pow2(heads))
    ones = ["stride_kd", "stride_vd", "stride_kcd", "stride_vcd"]
    plain = []
    for name, value in (("H", heads), ("page_size", page_size)):
        cls = int_class(value)
        if cls == "1":
            ones.append(name)
        elif cls == "":
            plain.append(name)
    return Spec("kv_cache_write", MODULE, KV_WRITE, TRITON_TYPE[dtype], "aligned", tuple(sorted(const.items())),
                (("slot_ptr", "*i64"),), ones=tuple(ones), plain=tuple(plain), num_stages=DEFAULT_STAGES,
                grid="kv_cache_write.tokens")


def kv_write_specs(dtype: torch.dtype, head_dims: Iterable[int] | None = None) -> list[Spec]:
    """``kv_cache_write`` for every head count 1..:data:`KV_HEADS_MAX` the launcher's ``supports`` accepts
    (``next_pow2(H) * next_pow2(D) <= 2**16``) and every page size of :data:`PAGE_SIZES` (distinct variants)."""
    from rlk_core.ops._triton_common import next_pow2

    seen: dict[tuple, Spec] = {}
    for d in HEAD_DIMS if head_dims is None else head_dims:
        for h in range(1, KV_HEADS_MAX + 1):
            if next_pow2(h) * next_pow2(d) > 1 << 16:
                continue
            for page in PAGE_SIZES:
                s = kv_write_spec(dtype, d, h, page)
                seen.setdefault(s.key, s)
    return list(seen.values())


# -- backward ---------------------------------------------------------------------------------------
def _bwd_pointers(dtype: torch.dtype, mode: int, pos: str) -> dict[str, str]:
    from rlk_core.ops.attention import triton_backward as ab

    # the positions pointer is cu_seqlens_q (i32) unless MODE_POSITIONS passes q_positions (i32 or i64)
    return {"pos_ptr": pos if mode == ab.MODE_POSITIONS else INT32, "cu_q_ptr": INT32, "cu_k_ptr": INT32,
            "lse_ptr": "*fp32", "delta_ptr": "*fp32"}


def backward_specs(dtype: torch.dtype, head_dims: Iterable[int] | None = None,
                   groups: Iterable[int] | None = None) -> list[Spec]:
    """The four backward kernels for every ``(head_dim <= MAX_HEAD_DIM, G, MODE, positions dtype)``, from
    ``triton_backward.config``: stats and dQ with ``KV_TMA`` as the config has it (``kv_tma_ok`` holds for the
    contiguous copies the launcher makes whenever ``head_dim`` is a power of two), dK/dV with ``SPLIT_G`` as
    the launcher decides it (the config's flag and ``G > 1``), the group sum where it splits."""
    from rlk_core.ops._triton_common import next_pow2
    from rlk_core.ops.attention import triton_backward as ab

    if dtype not in ab.CONFIGS:
        return []
    t = TRITON_TYPE[dtype]
    ieee = dtype == torch.float32
    out = []
    for d in HEAD_DIMS if head_dims is None else head_dims:
        if d > ab.MAX_HEAD_DIM or next_pow2(d) != d:
            continue
        cfg = ab.config(dtype, d)
        for g in BACKWARD_GROUPS if groups is None else groups:
            for mode in (ab.MODE_ALIGNED, ab.MODE_FULL, ab.MODE_POSITIONS):
                for pos in ("*i32", "*i64") if mode == ab.MODE_POSITIONS else ("*i32",):
                    ptrs = _bwd_pointers(dtype, mode, pos)
                    common = dict(G=g, MODE=mode, IEEE=ieee)
                    for kernel, part, floats in (("_attn_bwd_stats_kernel", "stats", ("qk_scale2",)),
                                                 ("_attn_bwd_dq_kernel", "dq", ("qk_scale2", "scale"))):
                        c = dict(cfg[part])
                        warps, stages = c.pop("num_warps"), c.pop("num_stages")
                        const = dict(common, **c)
                        boxes = {}
                        if c["KV_TMA"]:
                            boxes = {n: (c["BLOCK_N"], c["BLOCK_D"]) for n in ("k_desc", "v_desc")}
                        else:
                            const.update(k_desc=None, v_desc=None)
                        out.append(Spec("attention_backward", BACKWARD_MODULE, kernel, f"{t},pos={pos[1:]}",
                                        "aligned", tuple(sorted(const.items())), tuple(sorted(ptrs.items())),
                                        tuple(sorted(boxes.items())), floats=floats, num_warps=warps,
                                        num_stages=stages, grid=f"attention_backward.{part}"))
                    c = dict(cfg["dkdv"])
                    warps, stages = c.pop("num_warps"), c.pop("num_stages")
                    split = bool(c.pop("SPLIT_G")) and g > 1
                    part_t = "*fp32" if split else "*" + t
                    out.append(Spec("attention_backward", BACKWARD_MODULE, "_attn_bwd_dkdv_kernel",
                                    f"{t},pos={pos[1:]}", "aligned",
                                    tuple(sorted(dict(common, SPLIT_G=split, **c).items())),
                                    tuple(sorted({**ptrs, "dk_ptr": part_t, "dv_ptr": part_t}.items())),
                                    floats=("qk_scale2", "scale"), num_warps=warps, num_stages=stages,
                                    grid="attention_backward.dkdv"))
            if bool(cfg["dkdv"]["SPLIT_G"]) and g > 1:
                const = dict(G=g, BLOCK_T=ab._SUM_BLOCK_T, BLOCK_D=cfg["dkdv"]["BLOCK_D"])
                out.append(Spec("attention_backward", BACKWARD_MODULE, "_attn_bwd_group_sum_kernel", t, "aligned",
                                tuple(sorted(const.items())),
                                (("dk_part_ptr", "*fp32"), ("dv_part_ptr", "*fp32")), floats=("scale",),
                                grid="attention_backward.group_sum"))
    return out


def not_built() -> list[dict[str, str]]:
    from rlk_core.ops.attention import triton_backward as ab

    return [
        {"kernel": f"{FORWARD}, {KV_WRITE}", "what": f"head sizes outside {list(HEAD_DIMS)}",
         "why": "HEAD_D and D_PAD are constexprs: each head size is a family of binaries; others run on "
                "rlk.triton (extend HEAD_DIMS)."},
        {"kernel": FORWARD, "what": "strides not multiples of 16, head-dim strides other than 1, pointers not "
                                    "16-byte aligned",
         "why": "the JIT compiles another specialisation for such a launch; only the aligned one is built."},
        {"kernel": KV_WRITE, "what": f"more than {KV_HEADS_MAX} KV heads per rank; strides other than the "
                                     "aligned pattern",
         "why": "H_PAD is a constexpr; other layouts get another specialisation from the JIT."},
        {"kernel": "attention backward", "what": f"GQA groups outside {list(BACKWARD_GROUPS)}, head sizes "
                                                 f"that are not powers of two (or > {ab.MAX_HEAD_DIM})",
         "why": "G is a constexpr of every backward kernel (a family of binaries per group size); a head size "
                "below its power-of-two box drops KV_TMA, which the build does not enumerate."},
    ]
