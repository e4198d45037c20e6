"""``rlk-selfcheck``: run each op's contract checks on the available device and report.

Runs the contract suite (:mod:`rlk_core.testing.contracts`) against what rlk dispatches on the device,
one line per check on stderr as it goes; then prints a table (op, backend, contract id, each check
pass/fail) and writes JSON (``rlk.selfcheck.v1``) with ``--json``. Exit status 0 when every check passed,
1 otherwise, 2 for bad arguments. Usage: ``rlk-selfcheck [--device cpu|cuda] [--json PATH] [--seed N]``.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

SCHEMA = "rlk.selfcheck.v1"
Progress = Callable[[str], None]


def _stderr_progress(stream: TextIO | None = None) -> Progress:
    def show(line: str) -> None:
        print(line, file=stream or sys.stderr, flush=True)
    return show


def run(device: str, seed: int = 0, progress: Progress | None = None) -> dict[str, Any]:
    """Run the suite on ``device``; ``progress(line)`` is called before and after each check. ``seed``
    seeds torch's global generator (the suite's inputs come from their own fixed generators)."""
    import torch

    import rlk_core
    import rlk_core.ops  # registers the built-in backends
    from rlk_core.contracts import OP_CONTRACTS
    from rlk_core.testing.contracts import SELFCHECK_OPS, SUITES, checks, dispatched, run_check

    torch.manual_seed(seed)
    plan = []
    for op in SELFCHECK_OPS:
        subject = dispatched(op, device)
        plan.append((op, subject, checks(subject, device)))
    total = sum(len(c) for _, _, c in plan)
    results, done = [], 0
    for op, subject, op_checks in plan:
        t0 = time.perf_counter()
        out = {}
        for check in op_checks:
            done += 1
            if progress:
                progress(f"[{done}/{total}] {op} {check.name} ...")
            t1 = time.perf_counter()
            ok, detail = run_check(check, subject, device)
            out[check.name] = {"passed": ok, "detail": detail}
            if progress:
                progress(f"[{done}/{total}] {op} {check.name}: {'pass' if ok else 'FAIL'} "
                         f"({time.perf_counter() - t1:.1f} s)")
        results.append({"op": op, "backend_id": subject.ids[op], "contract_id": OP_CONTRACTS[op], "checks": out,
                        "seconds": round(time.perf_counter() - t0, 3)})
    covered = {op for op, suite in SUITES.items() if any(suite is SUITES[s] for s in SELFCHECK_OPS)}
    return {
        "schema": SCHEMA,
        "rlk_core": rlk_core.__version__,
        "torch": torch.__version__,
        "device": device,
        "device_name": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "passed": all(c["passed"] for r in results for c in r["checks"].values()),
        "ops": results,
        "ops_without_checks": sorted(set(OP_CONTRACTS) - covered),
    }


def format_table(report: dict[str, Any]) -> str:
    rows = [("op", "backend", "contract", "check", "result")]
    for r in report["ops"]:
        for name, c in r["checks"].items():
            rows.append((r["op"], r["backend_id"], r["contract_id"], name, "pass" if c["passed"] else "FAIL"))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in report["ops"]:
        for name, c in r["checks"].items():
            if not c["passed"]:
                lines.append(f"\n{r['op']} {name}: {c['detail']}")
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines.append(f"\nrlk-selfcheck on {report['device']} ({report['device_name']}): {verdict}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rlk-selfcheck", description=__doc__.splitlines()[0],
        epilog="Takes seconds (about 10 s on a 2-core CPU); each check is shown on stderr as it runs.")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--json", type=Path, default=None, help="write the report as JSON to this path")
    parser.add_argument("--seed", type=int, default=0, help="seed of torch's global generator (default 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)  # before importing torch: --help and bad arguments answer at once
    if args.device not in (None, "cpu", "cuda"):
        parser.error(f"--device {args.device!r}: allowed cpu, cuda")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")
    report = run(device, args.seed, progress=_stderr_progress())
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        from rlk_validate.evidence import write_json_atomic

        write_json_atomic(args.json, report)
        print(f"report written to {args.json}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
