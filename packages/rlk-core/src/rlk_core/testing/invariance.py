"""Invariance checks users can run on their own hardware.

Each check returns ``(ok, detail)`` and never asserts, so it can drive both tests
(``assert ok, detail``) and :mod:`rlk_core.selfcheck`'s table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rlk_core.testing.compare import bitwise_diff_report

DEFAULT_BATCH_SIZES = (1, 2, 3, 7, 16, 33, 64)


def _take(rows, idx):
    return tuple(r[idx] for r in rows) if isinstance(rows, tuple) else rows[idx]


def _length(rows) -> int:
    return (rows[0] if isinstance(rows, tuple) else rows).shape[0]


def check_batch_invariance(
    fn: Callable[..., torch.Tensor],
    rows: torch.Tensor | tuple[torch.Tensor, ...],
    batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
    probe: int = 0,
) -> tuple[bool, str]:
    """``fn`` maps a batch of rows to one output row per input row. ``rows`` is a tensor ``[N, ...]`` or a
    tuple of tensors indexed together along dim 0 (e.g. tokens and their positions); ``fn`` receives the
    same structure. Row ``probe`` computed alone must equal the same row placed at the first, middle and
    last position of batches of every size (the other rows drawn from ``rows``)."""
    n = _length(rows)
    call = (lambda b: fn(*b)) if isinstance(rows, tuple) else fn
    alone = call(_take(rows, torch.tensor([probe])))
    others = torch.tensor([i for i in range(n) if i != probe] or [probe])
    for m in batch_sizes:
        for pos in sorted({0, m // 2, m - 1}):
            filler = others[torch.arange(m - 1) % others.numel()]
            idx = torch.cat([filler[:pos], torch.tensor([probe]), filler[pos:]])
            out = call(_take(rows, idx))[pos : pos + 1]
            report = bitwise_diff_report(out, alone, f"row alone vs row {pos} of a batch of {m}")
            if report is not None:
                return False, report
    return True, f"batch sizes {list(batch_sizes)}, rows at first/middle/last position"


def check_run_to_run(fn: Callable[[], torch.Tensor | Sequence[torch.Tensor]], repeats: int = 10) -> tuple[bool, str]:
    """``fn()`` repeated gives identical bits every time (outputs may be a tensor or a sequence)."""
    def as_list(out):
        return [out] if isinstance(out, torch.Tensor) else [t for t in out if t is not None]

    first = [t.detach().clone() for t in as_list(fn())]
    for r in range(1, repeats):
        for i, (a, b) in enumerate(zip(as_list(fn()), first, strict=True)):
            report = bitwise_diff_report(a, b, f"output {i}, repeat {r} vs repeat 0")
            if report is not None:
                return False, report
    return True, f"{repeats} repeats identical"
