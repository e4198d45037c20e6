"""Qualification of a backend against its contract before strict mode accepts it.

A backend that is not built into rlk (say, a Blackwell or ROCm kernel package registering itself
through the ``rlk.backends`` entry points) must show, on the device it will run on, that it keeps
the contract's invariances (batch invariance, run-to-run) and agrees with rlk's reference within
:func:`~rlk_core.testing.dtype_tols`. Inputs are small and random; the check takes seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlk_core.testing.compare import dtype_tols
from rlk_core.testing.invariance import check_batch_invariance, check_run_to_run


def _suites(op: str, device: str, gen: torch.Generator) -> list[tuple[Any, Callable[..., Any]]]:
    """``[(rows, make(fn) -> row-wise callable)]`` for ops with a generic row-wise suite, in fp32 and
    bf16 (the CPU's BLAS, for one, breaks batch invariance in fp32 at K=256 where bf16 holds)."""
    suites = []
    for dtype in (torch.float32, torch.bfloat16):
        def randn(*shape: int, dtype=dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        if op == "linear":
            w = randn(96, 256)
            suites.append((randn(64, 256), lambda f, w=w: (lambda x: f(x, w, None))))
        elif op == "rms_norm":
            w = randn(256)
            suites.append((randn(64, 256), lambda f, w=w: (lambda x: f(x, w, 1e-6))))
        elif op == "swiglu":
            suites.append((randn(64, 256), lambda f: (lambda x: f(x))))
        elif op == "rope":
            pos = torch.randint(0, 8192, (64,), generator=gen).to(device)
            suites.append(((randn(64, 4, 64), pos), lambda f: (lambda x, p: f(x, p, 1e6, 64))))
    return suites


def qualify_backend(backend, device_type: str, seed: int = 0) -> tuple[bool, str]:
    """Run the contract checks of ``backend.op`` with ``backend.fn`` on ``device_type``."""
    from rlk_core.backends import REGISTRY

    gen = torch.Generator().manual_seed(seed)
    suites = _suites(backend.op, device_type, gen)
    if not suites:
        return False, (f"no qualification suite for op {backend.op!r} yet; "
                       "strict mode accepts only rlk's built-in backends")
    reference = REGISTRY.get(backend.op, "rlk.reference").fn
    for rows, make in suites:
        fn, ref = make(backend.fn), make(reference)
        args = rows if isinstance(rows, tuple) else (rows,)
        dtype = args[0].dtype
        try:
            ok, detail = check_batch_invariance(fn, rows)
            if not ok:
                return False, f"batch invariance ({dtype}): {detail}"
            ok, detail = check_run_to_run(lambda fn=fn, args=args: fn(*args), repeats=5)
            if not ok:
                return False, f"run-to-run ({dtype}): {detail}"
            got, want = fn(*args), ref(*args)
            tols = dtype_tols(got.dtype)
            if not torch.allclose(got.double(), want.double(), **tols):
                err = float((got.double() - want.double()).abs().max())
                return False, f"differs from rlk.reference by up to {err:.3g} ({dtype}, tolerance {tols})"
        except Exception as exc:
            return False, f"raised {type(exc).__name__}: {exc}"
    return True, "batch invariance, run-to-run and reference tolerance passed in fp32 and bf16"
