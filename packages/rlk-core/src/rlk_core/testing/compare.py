"""Bitwise and tolerance comparisons with reports a person can act on."""

from __future__ import annotations

import torch

# Tolerances against a float64 formula, by the dtype the op computed in. One place, no magic numbers.
_TOLS = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (1e-5, 1e-6),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float16: (2e-3, 1e-5),
}


def dtype_tols(dtype: torch.dtype) -> dict[str, float]:
    """``{"rtol": ..., "atol": ...}`` for comparing an op in ``dtype`` with a float64 formula."""
    try:
        rtol, atol = _TOLS[dtype]
    except KeyError:
        raise KeyError(f"no tolerances for {dtype}; known: {list(_TOLS)}") from None
    return {"rtol": rtol, "atol": atol}


def bitwise_diff_report(
    actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor", limit: int = 5
) -> str | None:
    """None when ``torch.equal`` holds on the bytes; otherwise a short report of where and by how much."""
    if actual.shape != expected.shape:
        return f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    if actual.dtype != expected.dtype:
        return f"{name}: dtype {actual.dtype} != {expected.dtype}"
    a, e = actual.detach().cpu(), expected.detach().cpu()
    if a.is_floating_point():
        # compare bytes: NaNs with equal payloads are equal, +0 and -0 are not
        ia = a.contiguous().view(_int_view(a.dtype))
        ie = e.contiguous().view(_int_view(e.dtype))
        neq = ia != ie
    else:
        neq = a != e
    count = int(neq.sum())
    if count == 0:
        return None
    idx = neq.nonzero()[:limit]
    lines = [f"{name}: {count} of {a.numel()} elements differ ({100.0 * count / max(a.numel(), 1):.3g}%)"]
    if a.is_floating_point():
        diff = (a.double() - e.double()).abs()
        finite = diff[torch.isfinite(diff)]
        lines.append(f"  max abs diff {float(finite.max()) if finite.numel() else float('nan'):.6g}")
    for i in idx.tolist():
        t = tuple(i)
        lines.append(f"  at {t}: actual {a[t].item()!r} expected {e[t].item()!r}")
    return "\n".join(lines)


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}[dtype]


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, name: str = "tensor") -> None:
    """Assert identical bits (``torch.equal`` on the bytes); the error says where and by how much."""
    report = bitwise_diff_report(actual, expected, name)
    if report is not None:
        raise AssertionError(report)


def assert_close_to_formula(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype | None = None,
                            name: str = "tensor") -> None:
    """Compare with a float64 formula within :func:`dtype_tols` of ``dtype`` (default: actual's)."""
    tols = dtype_tols(dtype or actual.dtype)
    torch.testing.assert_close(actual.double(), expected64.double(), msg=lambda m: f"{name}: {m}", **tols)
