"""``linear`` on ``rlk.cuda``: ``rlk.triton``'s GEMM kernels (:mod:`rlk_core.ops.linear.triton`) from their AOT
cubins, launched by ``rlk_core._C`` — the same tile rule (:func:`rlk_core.ops.linear.tiles.config`, through
:func:`rlk_core.aot.specs.linear_launch_specs`, the derivation the AOT build is tested against), the same
persistent grid, TMA descriptors encoded in C++ from the manifest's ``tensordesc_meta``, a row split's
second launch made with programmatic dependent launch.

``supports`` and ``forward`` share one decision per call signature (:class:`~rlk_core.ops._cuda_common.Launch`):
the general code below (:func:`supports_general`, :func:`forward_general`) decides it once; a signature seen
before, launched in one part, is one dict lookup and one ``_C.run``.

The persistent TMA kernel's ``NUM_PROGRAMS`` is a constexpr the JIT sets to ``min(tiles, #SMs)``; the
build has ``NUM_PROGRAMS = sms`` only (132). With at least ``sms`` tiles that is the JIT's binary; with
fewer, each program computes one tile and stops either way, with the same per-tile code — served only
while :data:`SMALL_GRID_BITWISE` (checked on the GPU by ``tests/gpu/test_cuda_backend_gpu.py``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rlk_core.aot import specs as S
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops._triton_common import has_tma
from rlk_core.ops.linear import tiles as rule

SMALL_GRID_BITWISE = True
_RECORDS = cc.records()


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _manifest_sms(device: int) -> int | None:
    target = cc._device_target(device)
    return None if target is None else cc._manifest(target)[1].get("sms")


def _flags(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> tuple[bool, str]:
    """``(tma, layout)`` of a call as the Triton launcher decides them, the output being a fresh contiguous
    ``[M, N]`` allocation (16-byte aligned: the caching allocator's blocks are 512-byte aligned)."""
    n, k = w.shape
    esz = x.element_size()
    tma = (
        has_tma(x.device.index)
        and (n * esz) % 16 == 0
        and all(t.stride(1) == 1 and (t.stride(0) * esz) % 16 == 0 and t.data_ptr() % 16 == 0 for t in (x, w))
    )
    if tma:  # descriptors carry no divisibility; b_ptr (bias, or y as a placeholder), N and K do
        return True, "aligned" if cc.aligned(n, k) and (b is None or cc.aligned(b)) else "generic"
    ok = (
        x.stride(1) == 1
        and w.stride(1) == 1
        and cc.aligned(x, w, n, k, x.stride(0), w.stride(0))
        and (b is None or cc.aligned(b))
    )
    return False, "aligned" if ok else "generic"


@functools.cache
def _plan(
    device: int, dtype: torch.dtype, m: int, n: int, k: int, bias: bool, tma: bool, layout: str
) -> tuple[tuple[Any, ...], ...] | str:
    """The launches of one call: ``(row0, row1, handle, grid, names, kind)`` per part, or why none."""
    sms = _num_sms(device)
    specs = S.linear_launch_specs(dtype, m, n, k, tma, sms=sms, bias=bias, layout=layout)
    cfg = rule.config(dtype, m, n, k, tma, sms)
    rows = cfg.get("SPLIT_ROWS", 0)
    bounds = [(0, rows), (rows, m)] if rows else [(0, m)]
    parts = []
    for (r0, r1), spec in zip(bounds, specs, strict=True):
        if spec.kernel == "_linear_tma_kernel" and _manifest_sms(device) != sms:
            return f"the persistent GEMM is built for {_manifest_sms(device)} SMs, the device has {sms}"
        const = {**dict(spec.constexprs), **{o: 1 for o in spec.ones}}
        entry = cc.lookup(device, spec.kernel, spec.dtype, layout, const)
        if entry is None:
            return f"no AOT variant {spec.name}"
        c = dict(spec.constexprs)
        if spec.kernel == "_linear_tma_kernel":
            tiles = -(-(r1 - r0) // (c["BLOCK_M"] + c["TAIL_M"])) * -(-n // c["BLOCK_N"])
            if tiles < sms and not SMALL_GRID_BITWISE:
                return f"{tiles} tiles < {sms} SMs: the JIT builds NUM_PROGRAMS={tiles}, the AOT set {sms}"
            grid, kind = min(tiles, sms), "tma"
        else:
            grid, kind = -(-(r1 - r0) // c["BLOCK_M"]) * -(-n // c["BLOCK_N"]), "ptr"
        names = tuple(a["name"] for a in entry["signature"] if a["type"] != "constexpr")
        parts.append((r0, r1, cc.handle(device, entry), grid, names, kind))
    return tuple(parts)


def _decide(key: tuple, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    if _stored(x, weight, bias):
        return cc.remember(_RECORDS, key, _decide_stored(x, weight))
    said = supports_general(x, weight, bias)
    launch = None
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    lead = x.shape[:-1]
    m = lead.numel()
    if said[0] and m and n and k:
        try:
            x2 = x.view(m, k)  # forward_general's reshape, where it is a view (no copy)
        except RuntimeError:
            x2 = None
        plan = None
        if x2 is not None:
            tma, layout = _flags(x2, weight, bias)
            plan = _plan(x.device.index, x.dtype, m, n, k, bias is not None, tma, layout)
        if plan is not None and not isinstance(plan, str) and len(plan) == 1:  # one part: xs = x2, ys = y
            _, _, hdl, grid, names, kind = plan[0]
            b = (cc.T, 2) if bias is not None else (cc.O, 0)
            if kind == "tma":
                vals = {"x_desc": (cc.V, 0), "w_desc": (cc.T, 1), "y_desc": (cc.O, 0), "xt_desc": (cc.V, 0),
                        "yt_desc": (cc.O, 0), "b_ptr": b, "M": (cc.C, m), "N": (cc.C, n), "K": (cc.C, k)}
            else:
                vals = {"x_ptr": (cc.T, 0), "w_ptr": (cc.T, 1), "b_ptr": b, "y_ptr": (cc.O, 0), "M": (cc.C, m),
                        "N": (cc.C, n), "K": (cc.C, k), "stride_xm": (cc.C, x2.stride(0)),
                        "stride_xk": (cc.C, x2.stride(1)), "stride_wn": (cc.C, weight.stride(0)),
                        "stride_wk": (cc.C, weight.stride(1)), "stride_ym": (cc.C, n), "stride_yn": (cc.C, 1)}
            # y: a fresh [m, n]; forward_general assumes it 16-byte aligned without looking
            launch = cc.Launch(hdl, (grid, 1, 1), (m, n), (*lead, n), 0, False, tuple(vals[a] for a in names))
    return cc.remember(_RECORDS, key, (said, launch, False))


def _signature(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple:
    """The call signature a decision is kept under: shapes, strides, dtypes, device, pointer alignment."""
    return (x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15, weight.shape, weight.stride(),
            weight.dtype, weight.data_ptr() & 15,
            None if bias is None else (bias.shape, bias.stride(), bias.dtype, bias.data_ptr() & 15))


def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    key = _signature(x, weight, bias)
    decision = _RECORDS.get(key) or _decide(key, x, weight, bias)
    launch = decision[1]
    if decision[2]:  # the stored-layout kernels: the record's inputs are the operands and their transposes
        if launch is not None:
            return cc.run(launch, x, weight, x.t(), weight.t())
        return forward_stored_general(x, weight)
    if launch is not None:
        return cc.run(launch, x, weight, bias)
    return forward_general(x, weight, bias)


def supports(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, str]:
    if cc.without_storage(x, weight, bias):
        return cc.NO_STORAGE
    key = _signature(x, weight, bias)
    return (_RECORDS.get(key) or _decide(key, x, weight, bias))[0]


def forward_general(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m and n:
        if k == 0:
            y.copy_(bias.float().expand(m, n) if bias is not None else torch.zeros_like(y))
        else:
            tma, layout = _flags(x2, weight, bias)
            _run(x2, weight, bias, y, _plan(x.device.index, x.dtype, m, n, k, bias is not None, tma, layout))
    return y.reshape(*lead, n)


def _run(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor, plan: tuple) -> None:
    if isinstance(plan, str):
        raise RuntimeError(f"rlk.cuda linear called on a launch it declines: {plan}")
    n, k = w.shape
    for r0, r1, hdl, grid, names, kind in plan:
        xs, ys = (x, y) if r0 == 0 and r1 == x.shape[0] else (x[r0:r1], y[r0:r1])
        if kind == "tma":
            vals = {
                "x_desc": xs,
                "w_desc": w,
                "y_desc": ys,
                "xt_desc": xs,
                "yt_desc": ys,
                "b_ptr": b if b is not None else ys,
                "M": r1 - r0,
                "N": n,
                "K": k,
            }
        else:
            vals = {
                "x_ptr": xs,
                "w_ptr": w,
                "b_ptr": b if b is not None else ys,
                "y_ptr": ys,
                "M": r1 - r0,
                "N": n,
                "K": k,
                "stride_xm": xs.stride(0),
                "stride_xk": xs.stride(1),
                "stride_wn": w.stride(0),
                "stride_wk": w.stride(1),
                "stride_ym": ys.stride(0),
                "stride_yn": ys.stride(1),
            }
        cc.launch(hdl, grid, 1, 1, *[vals[a] for a in names])


def supports_general(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[bool, str]:
    if x.dtype not in S.TRITON_TYPE or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return False, f"no AOT variant for x {x.dtype}, weight {weight.dtype}, bias {getattr(bias, 'dtype', None)}"
    if bias is not None and bias.stride(0) != 1:
        return False, "bias with a non-unit stride"
    x2 = x.reshape(x.shape[:-1].numel(), x.shape[-1])
    m, k = x2.shape
    n = weight.shape[0]
    if m == 0 or n == 0 or k == 0:
        return True, ""
    if not cc.fits_i32(m, n, k, x2.stride(0), weight.stride(0), m * n, m * k, n * k):
        return False, "sizes past int32 (the JIT's i64 variant)"
    tma, layout = _flags(x2, weight, bias)
    if layout == "generic" and "linear" not in cc.GENERIC_BITWISE:
        return False, "operands not 16-byte aligned / sizes not multiples of 16: the JIT's own variant serves"
    plan = _plan(x.device.index, x.dtype, m, n, k, bias is not None, tma, layout)
    if isinstance(plan, str):
        return False, plan
    return True, ""


# -- the stored-layout kernels (the backward's dx / dW / db: operands given as transposed views) ----------------------
def _stored(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether rlk.triton runs the call on its stored-layout kernels (``triton.stored_layout`` of the 2-D view)."""
    from rlk_core.ops.linear import triton as lt

    if bias is not None or weight.dim() != 2:
        return False
    if x.dim() != 2:
        try:
            x = x.view(-1, x.shape[-1])
        except RuntimeError:  # reshape copies it: a contiguous copy, read as the forward's
            return False
    return lt.stored_layout(x, weight, None)


def stored_call(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, dev: int
                ) -> tuple[Any, tuple[int, int, int], dict[str, Any], dict[str, int], str, list]:
    """``triton._launch_stored`` of ``out = x @ weight^T`` (``x [M, K]``, ``weight [N, K]``, ``out [M, N]``, any of
    them a meta stand-in; ``K > 0``) on device ``dev``, as its launcher makes it: ``(kernel, grid, args, options,
    dtype, [a, b])`` — every argument by name (:func:`~rlk_core.ops._cuda_calls.positional`), the variant's dtype
    string (``bf16``; ``bf16->fp32`` for an fp32 output, ``linear_2d_into``'s) and ``a``, ``b`` the operands as
    the kernel reads them. The tile from ``triton._stored_config_for``'s rule (TMA where the device has it and
    both operands as stored suit it)."""
    from rlk_core.ops import _cuda_calls as cl
    from rlk_core.ops.linear import triton as lt

    m, k = x.shape
    n = weight.shape[0]
    sms = _num_sms(dev)
    a_km, b_kn = lt._transposed(x), lt._transposed(weight)
    a, b = (x.t() if a_km else x), (weight.t() if b_kn else weight)
    f32_out = out.dtype != x.dtype
    cfg = rule.stored_config(x.dtype, m if a_km else None, n, has_tma(dev) and lt._tma_compatible(a, b), sms, f32_out)
    common = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"])
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    tiles = -(-m // cfg["BLOCK_M"]) * -(-n // cfg["BLOCK_N"])
    if cfg["TMA"]:
        y_tma = not f32_out and out.stride(1) == 1 and (out.stride(0) * out.element_size()) % 16 == 0 and (
            cl.address_low_bits(out) == 0)
        args = cl.positional(lt._linear_bwd_tma_kernel, cl.Desc(a), cl.Desc(b), cl.Desc(out) if y_tma else None, out,
                             m, n, k, out.stride(0), out.stride(1), A_KM=a_km, B_KN=b_kn, Y_TMA=y_tma,
                             NUM_PROGRAMS=sms, **common)
        kernel, grid = lt._linear_bwd_tma_kernel, (min(tiles, sms), 1, 1)
    else:
        args = cl.positional(lt._linear_bwd_kernel, x, weight, out, m, n, k, x.stride(0), x.stride(1),
                             weight.stride(1), weight.stride(0), out.stride(0), out.stride(1), IEEE=cfg["IEEE"],
                             **common)
        kernel, grid = lt._linear_bwd_kernel, (tiles, 1, 1)
    dtype = S.TRITON_TYPE[x.dtype] + (f"->{S.TRITON_TYPE[out.dtype]}" if f32_out else "")
    return kernel, grid, args, options, dtype, [a, b]


def stored_launch(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> tuple[Any, tuple, list] | str:
    """:func:`stored_call` resolved as the JIT specialises it: ``(resolved, grid, [a, b])``, or why no AOT variant
    is that binary."""
    from rlk_core.ops import _cuda_calls as cl

    dev = x.device.index or 0
    kernel, grid, args, options, dtype, ab = stored_call(x, weight, out, dev)
    r = cl.resolve(dev, kernel, dtype, args, options)
    return r if isinstance(r, str) else (r, grid, ab)


def stored_into(calls: Any, x: Any, weight: Any, out: Any) -> None:
    """``triton.linear_2d_into(x, weight, out)`` of a stored-layout call on a
    :class:`~rlk_core.ops._cuda_calls.Calls` (its launch made or decided; declined where the operands are not
    the stored-layout kernels' — ``linear_2d_into`` would run the forward's kernels on them)."""
    from rlk_core.ops.linear import triton as lt

    m, k = x.shape
    if m == 0 or weight.shape[0] == 0 or k == 0:  # the callers' GEMMs all have work; no zero-fill launch here
        calls.reason = calls.reason or f"a stored-layout GEMM with an empty dimension ({m}, {weight.shape[0]}, {k})"
        return
    if not lt.stored_layout(x, weight, None):
        calls.reason = calls.reason or "a GEMM whose operands are not transposed views runs the forward kernels"
        return
    kernel, grid, args, options, dtype, _ = stored_call(x, weight, out, calls.index)
    calls.launch(kernel, grid, args, options, dtype)


def _decide_stored(x: torch.Tensor, weight: torch.Tensor) -> tuple:
    """``(said, launch, True)`` of a stored-layout call: a :class:`~rlk_core.ops._cuda_common.Launch` over the inputs
    ``(x, weight, x.t(), weight.t())`` and a fresh ``[M, N]`` output where every size is nonzero, else None (the
    Triton launcher launches nothing: :func:`forward_stored_general`)."""
    from rlk_core.ops import _cuda_calls as cl

    said = supports_stored(x, weight)
    if not said[0] or x.dim() != 2 or 0 in (*x.shape, weight.shape[0]):
        return said, None, True
    m, n = x.shape[0], weight.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device="meta")
    (entry, values, _), grid, _ = stored_launch(x, weight, out)
    xt, wt = x.t(), weight.t()  # the record's inputs 2 and 3 (forward passes x.t(), weight.t() again)
    inputs = (x, weight, xt, wt)
    ops = []
    for v in values:
        t = v.source if isinstance(v, cl.Desc) else v
        if t is out:
            ops.append((cc.O, 0))
        elif isinstance(t, torch.Tensor):
            ops.append((cc.T, next((j for j, u in enumerate(inputs) if u is t or _same_view(u, t)), None)))
        else:
            ops.append((cc.C, int(t)))
    assert all(kind != cc.T or i is not None for kind, i in ops), "an operand that is no input"
    return said, cc.Launch(cc.handle(x.device.index, entry), grid, (m, n), (m, n), 0, False, tuple(ops)), True


def _same_view(u: torch.Tensor, t: torch.Tensor) -> bool:
    """``t`` is a view with ``u``'s address, shape and strides (``x.t().t()`` for ``x``)."""
    return u.data_ptr() == t.data_ptr() and u.shape == t.shape and u.stride() == t.stride() and u.dtype == t.dtype


def supports_stored(x: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    if x.dtype not in S.TRITON_TYPE or weight.dtype != x.dtype:
        return False, f"no AOT variant for x {x.dtype}, weight {weight.dtype}"
    if x.dim() != 2:
        return False, "a stored-layout call with x of more than two dims (the backward's are 2-D)"
    m, k = x.shape
    n = weight.shape[0]
    if 0 in (m, n, k):
        return True, ""
    r = stored_launch(x, weight, torch.empty((m, n), dtype=x.dtype, device="meta"))
    return (False, r) if isinstance(r, str) else (True, "")


def forward_stored_general(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``triton.linear_2d`` of a stored-layout call, its launch made from Python."""
    from rlk_core.ops import _cuda_calls as cl

    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    r = stored_launch(x, weight, y)
    if isinstance(r, str):
        raise RuntimeError(f"rlk.cuda linear called on a stored-layout launch it declines: {r}")
    resolved, grid, _ = r
    cl.launch_resolved(x.device.index, resolved, grid)
    return y
