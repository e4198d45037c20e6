"""``rlk-repro matrix``: the operator ablation matrix as cell directories of one matrix root.

A new root records the options its cells run with (:data:`~rlk_validate.evidence.MATRIX_OPTIONS`) and is
locked by the one process writing it (:func:`rlk_repro.lifecycle.lock_matrix_root`). ``--resume ROOT`` runs
those options again: a flag that differs from them, or an environment that changes a cell's configuration,
exits 2 naming the difference (a cell run with other options would fail the matrix's provenance for good).
A cell is finished when its run ended with status 0 or 1 and wrote its bitwise file; any other cell (absent,
interrupted, failed) is run again, its files moved to ``<cell>.interrupted-<id>/`` first, never deleted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro import lifecycle
from rlk_repro.progress import Progress
from rlk_validate import evidence

EXIT_OK, EXIT_MISMATCH, EXIT_FAILED = 0, 1, 3
#: parsed options that are not the experiment's: where the matrix lives and how this process reports
NOT_RECORDED = ("command", "output", "resume", "debug")
#: configuration keys that follow from a cell's routes or from this invocation, not from the matrix's options
_CELL_KEYS = ("plan", "plan_sources", "command", "require_exact")


def cells_of(spec: str | None) -> list[str]:
    from rlk_validate.matrix import REQUIRED_CELLS, expected_plan

    cells = [*REQUIRED_CELLS, "native-PP"] if spec is None else [c.strip() for c in spec.split(",") if c.strip()]
    bad = [c for c in cells if expected_plan(c) is None]
    if bad or not cells:
        raise RlkConfigError(f"--cells: {bad or spec!r} not matrix cells; allowed: "
                             f"{', '.join([*REQUIRED_CELLS, 'native-PP'])}")
    return list(dict.fromkeys(cells))


def cell_finished(path: Path) -> bool:
    """A cell whose run ended with a verdict (exit 0: done, 1: mismatch) and wrote its bitwise file; a cell that
    was interrupted (130, 143), failed (2, 3) or never ended is not finished, whatever else it wrote."""
    try:
        code = (path / evidence.EXIT_CODE).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return False
    return code in ("0", "1") and (path / evidence.BITWISE).is_file()


def _options(a: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in sorted(vars(a).items()) if k not in NOT_RECORDED}


def _route_free(cfg) -> dict[str, Any]:
    """A cell's configuration without what its routes or this invocation decide: the same for every cell."""
    return {k: v for k, v in asdict(cfg).items() if k not in _CELL_KEYS}


def _recorded(root: Path, build_parser) -> dict[str, Any]:
    """The options of matrix root ``root``: its ``matrix-options.json``, or (a root from before it was written)
    the command recorded in a cell's manifest (parsed by ``build_parser()``, rlk-repro's parser)."""
    path = root / evidence.MATRIX_OPTIONS
    if path.is_file():
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RlkConfigError(f"--resume {root}: {path.name} is unreadable ({exc})") from None
        if not isinstance(doc, dict) or doc.get("schema") != evidence.MATRIX_OPTIONS_SCHEMA:
            raise RlkConfigError(f"--resume {root}: {path.name} is not a {evidence.MATRIX_OPTIONS_SCHEMA} document")
        return doc
    for cell in sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            command = json.loads((cell / evidence.MANIFEST).read_text(encoding="utf-8"))["command"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if command[1:2] == ["matrix"]:
            a = build_parser().parse_args(command[1:])
            return {"schema": evidence.MATRIX_OPTIONS_SCHEMA, "options": _options(a), "config": None}
    raise RlkConfigError(f"--resume {root}: not a matrix root that rlk-repro wrote (no {evidence.MATRIX_OPTIONS}, "
                         "no cell manifest)")


def _resume_options(a: argparse.Namespace, root: Path, build_parser) -> argparse.Namespace:
    """The recorded options of ``root``, after refusing a flag given now that differs from them."""
    recorded = _recorded(root, build_parser)
    return merge_recorded(a, root, recorded, vars(build_parser().parse_args(["matrix"])), evidence.MATRIX_OPTIONS,
                          "every cell of a matrix shares one configuration. Drop the flag, or start a new matrix")


def merge_recorded(a: argparse.Namespace, root: Path, recorded: dict[str, Any], defaults: dict[str, Any],
                   name: str, why: str, what: str = "matrix") -> argparse.Namespace:
    """``--resume ROOT``: the options ``recorded`` in ``ROOT/name`` (over the command's ``defaults``), after refusing
    a flag of ``a`` that differs from them (``why`` says what would break); the recorded configuration is kept as
    ``_recorded_config`` for :func:`check_config`. Shared by the matrix and the ladder (:mod:`rlk_repro.ladder`)."""
    options = recorded.get("options")
    if not isinstance(options, dict):
        raise RlkConfigError(f"--resume {root}: {name} records no options")
    given = {k: v for k, v in vars(a).items() if k not in NOT_RECORDED and v != defaults.get(k)}
    differ = [k for k, v in given.items() if options.get(k, defaults.get(k)) != v]
    if differ:
        shown = "; ".join(f"--{k.replace('_', '-')} {given[k]!r} (the {what} ran {options.get(k, defaults.get(k))!r})"
                          for k in differ)
        raise RlkConfigError(f"--resume {root} runs the {what}'s recorded options, and {shown} differs: {why}")
    merged = argparse.Namespace(**{**defaults, **options})
    for k in NOT_RECORDED:
        setattr(merged, k, getattr(a, k))
    merged._recorded_config = recorded.get("config")
    return merged


def check_config(root: Path, recorded: dict[str, Any] | None, now: dict[str, Any]) -> None:
    """The configuration this process would run the cells with must be the one the matrix recorded (an
    environment variable such as ``RL_KERNEL_MODE`` or ``RLK_BACKENDS`` may have changed it)."""
    if recorded is None:
        return
    keys = sorted(k for k in set(recorded) | set(now) if recorded.get(k) != now.get(k))
    if keys:
        shown = "; ".join(f"{k}: {now.get(k)!r} now, {recorded.get(k)!r} recorded" for k in keys[:5])
        raise RlkConfigError(f"--resume {root}: the cells would run another configuration than the matrix's "
                             f"({shown}); restore the environment the matrix was started with")


def run_matrix(a: argparse.Namespace, argv: Sequence[str], config_of, frameworks_cell, needs, build_parser) -> int:
    """``rlk-repro matrix``; ``config_of(a, argv, resolved)`` builds a cell's run configuration (``cli._config``),
    ``frameworks_cell`` runs a cell of ``--engine frameworks``, ``needs(a)`` checks that engine's requirements,
    ``build_parser()`` is rlk-repro's argument parser (the CLI hands them in: this module does not import it)."""
    from rlk_core import envs, routes
    from rlk_core.plan import MODULES, RoutePlan
    from rlk_repro.engine.local import run_local
    from rlk_repro.lifecycle import utc_now
    from rlk_repro.runs import new_run_id, write_json_atomic
    from rlk_validate.matrix import expected_plan, validate_matrix
    from rlk_validate.validate import Options

    root, a = root_and_options(a, lambda a, root: _resume_options(a, root, build_parser))
    frameworks = a.engine == "frameworks"
    cells = cells_of(a.cells)
    if frameworks:
        needs(a)
    envs.snapshot()  # a bad RL_KERNEL_* / RLK_* variable stops the matrix before any cell
    device = a.device or ("cuda" if frameworks else "cpu")
    problem = lifecycle.forced_backends_problem(device.split(":")[0])
    if problem:
        raise RlkConfigError(problem)
    ignored = [v for v in routes.CASE_VARS.values() if os.environ.get(v, "") != ""]
    if ignored:
        print(f"rlk-repro: note: each matrix cell sets its own routes; {', '.join(ignored)} not used",
              file=sys.stderr)
    configs = {c: config_of(a, argv, routes.Resolved(RoutePlan(**expected_plan(c)[1]),
                                                      dict.fromkeys(MODULES, f"matrix cell {c}")))
               for c in cells}  # all errors before any run
    shared = _route_free(next(iter(configs.values())))
    if a.samples_per_prompt == 1 and not a.static_weights:
        lifecycle.warn(static_weights_warning())
    if root is not None:
        check_config(root, a._recorded_config, shared)
        lock = lifecycle.lock_matrix_root(root, ["rlk-repro", *argv])
    else:
        root = Path(a.output) / f"matrix-{new_run_id()}"
        root.mkdir(parents=True)
        lock = lifecycle.lock_matrix_root(root, ["rlk-repro", *argv])
        write_json_atomic(root / evidence.MATRIX_OPTIONS, {
            "schema": evidence.MATRIX_OPTIONS_SCHEMA, "created_at": utc_now(), "command": ["rlk-repro", *argv],
            "options": _options(a), "config": shared})
    try:
        return _run_cells(a, root, cells, configs, frameworks, frameworks_cell, run_local, validate_matrix,
                          Options)
    finally:
        lock.release()


def root_and_options(a: argparse.Namespace, resume_options) -> tuple[Path | None, argparse.Namespace]:
    """``--resume ROOT``: the existing root and its recorded options (``resume_options(a, root)``); else None (a new
    root goes under ``--output``) and ``a``. An unusable path exits 2 before anything is created."""
    if a.resume:
        root = Path(a.resume)
        if not root.is_dir():
            raise RlkConfigError(f"--resume {root}: not a directory")
        lifecycle.refuse_inside_run_dir(root, "--resume")
        return root, resume_options(a, root)
    out = Path(a.output)
    if out.exists() and not out.is_dir():
        raise RlkConfigError(f"--output {out} exists and is not a directory")
    lifecycle.refuse_inside_run_dir(out, "--output")
    return None, a


def resume_command(root: Path) -> str:
    return f"rlk-repro matrix --resume {shlex.quote(str(root))}"


def _run_cells(a, root: Path, cells: list[str], configs: dict, frameworks: bool, frameworks_cell, run_local,
               validate_matrix, Options) -> int:
    print(f"rlk-repro: matrix root {root}, {len(cells)} cells, {a.rounds} rounds each", file=sys.stderr)

    def run_one(cell: str):
        return (frameworks_cell(a, configs[cell], root, cell) if frameworks
                else run_local(configs[cell], root, run_name=cell, progress=Progress()))

    def done(cell: str, result) -> str:
        b = result.bitwise
        return f"{configs[cell].plan.as_dict()}: {b['mismatch_count']} of {b['element_count']} tokens differ"

    failed = run_cells(root, cells, run_one, done, "matrix", resume_command(root))
    rep = validate_matrix(str(root), Options(), allow_partial=a.cells is not None, write=True)
    print(rep.summary())
    print(f"matrix root: {root}")
    if failed:
        print(f"rlk-repro matrix: {len(failed)} cell(s) failed ({', '.join(failed)}); after fixing the cause, run "
              f"them again with:\n  {resume_command(root)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK if rep.exit_code == 0 else EXIT_MISMATCH


def run_cells(root: Path, cells: list[str], run_one, done, what: str, resume: str) -> list[str]:
    """Run each cell (``run_one(cell)``, a run directory ``root/cell``) that has not finished; one line each on
    stderr (``done(cell, result)`` for a cell that ran). A cell that was interrupted or failed is run afresh, its
    files moved to ``<cell>.interrupted-<id>/`` first, never deleted; one that fails to run does not stop the others.
    Returns the cells that failed. Shared by the matrix and the ladder (``what`` names it, ``resume`` is the command
    that finishes it)."""
    from rlk_repro.runs import new_run_id

    failed = []
    for cell in cells:
        path = root / cell
        if cell_finished(path):
            print(f"  {cell:16s} finished earlier, kept", file=sys.stderr)
            continue
        if path.exists():  # an interrupted or failed cell: keep its files for inspection, run the cell afresh
            kept = path.with_name(f"{cell}.interrupted-{new_run_id()}")
            path.rename(kept)
            print(f"  {cell:16s} was interrupted or failed; its files moved to {kept.name}", file=sys.stderr)
        try:
            result = run_one(cell)
        except KeyboardInterrupt as exc:
            print(f"rlk-repro {what}: {lifecycle.signal_name(exc)} in cell {cell}; finish the {what} with:\n  {resume}",
                  file=sys.stderr)
            raise
        except Exception as exc:  # one cell failing does not lose the others; validation reports it
            failed.append(cell)
            print(f"  {cell:16s} FAILED to run: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        print(f"  {cell:16s} {done(cell, result)}", file=sys.stderr)
    return failed


def static_weights_warning() -> str:
    return ("--samples-per-prompt 1: every GRPO advantage is 0, so the weights never change and a bitwise claim "
            "over rounds holds vacuously (rlk-validate --require-bitwise fails such a run); use 2 or more, or "
            "--static-weights to ask for a fixed-weight run explicitly")
