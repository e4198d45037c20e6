"""``rlk-repro run --phase P --pair``: a phase's native / consistency pairs in one phase root (issue 37).

For every seed of the phase, in the phase's order (:data:`rlk_repro.phases.PHASES`), a native run (all P/P) and
then a consistency run (all R/R), each the run ``rlk-repro run --phase P --mode M --seed S`` would make, as the
directories ``seed<S>-native`` and ``seed<S>-consistency`` of one new root ``<output>/phase-<P>-<id>/``. The root's
``phase-pair.json`` names the phase, its seeds and its cells; ``rlk-repro report ROOT`` pairs the cells by seed and
gives the paired estimates (:mod:`rlk_repro.report_pairs`). Every cell's configuration is built (and its errors
said) before the first run; a cell that fails does not stop the others (the exit status says so).

Exit codes: 0 every cell ran and every consistency run was exact; 1 a consistency run found mismatches or
fallbacks; 2 bad arguments; 3 a cell failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro.phases import PHASES

PAIR_FILE = "phase-pair.json"
PAIR_SCHEMA = "rlk.phase-pair.v1"
MODES = ("native", "consistency")  # the order within a seed
EXIT_OK, EXIT_MISMATCH, EXIT_FAILED = 0, 1, 3
_REFUSED = ("--mode", "--attention-case", "--ffn-case", "--logp-case", "--seed", "--resume", "--run-name")


def cell_name(seed: int, mode: str) -> str:
    return f"seed{seed}-{mode}"


def cells(phase: str) -> list[tuple[int, str, str]]:
    """``(seed, mode, directory name)`` of every run of ``phase``'s pairs, in the order they run."""
    if phase not in PHASES:
        raise RlkConfigError(f"--phase {phase!r} is not one of {', '.join(PHASES)}")
    return [(seed, mode, cell_name(seed, mode)) for seed in PHASES[phase]["seeds"] for mode in MODES]


def _given(argv: Sequence[str], flag: str) -> bool:
    return any(x == flag or x.startswith(f"{flag}=") for x in argv)


def _without(argv: Sequence[str], flag: str, takes_value: bool) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
        elif x == flag:
            skip = takes_value
        elif not x.startswith(f"{flag}="):
            out.append(x)
    return out


def cell_argv(argv: Sequence[str], seed: int, mode: str, root: Path | None) -> list[str]:
    """The ``rlk-repro`` arguments of one cell: the pair's own, without ``--pair`` (and ``--output`` where ``root``
    is given), with the cell's ``--mode`` and ``--seed`` (and ``--output ROOT``)."""
    out = _without(argv, "--pair", takes_value=False)
    if root is not None:
        out = _without(out, "--output", takes_value=True) + ["--output", str(root)]
    return out + ["--mode", mode, "--seed", str(seed)]


def run_pairs(a: argparse.Namespace, argv: Sequence[str], build_parser: Callable[[], argparse.ArgumentParser],
              resolve: Callable[..., Any], config_of: Callable[..., Any], preflight: Callable[..., None],
              needs: Callable[[argparse.Namespace], None]) -> int:
    """Run the pairs of ``a.phase`` (``argv``: the command's arguments, ``run ... --phase P --pair``). The CLI hands
    in its parser, route resolution, configuration builder, pre-flight check and frameworks requirement check."""
    from rlk_repro.lifecycle import utc_now
    from rlk_repro.runs import new_run_id, write_json_atomic

    if a.phase is None:
        raise RlkConfigError("--pair runs the pairs of a phase: give --phase short, precision or convergence")
    given = [f for f in _REFUSED if _given(argv, f)]
    if given:
        raise RlkConfigError(f"--pair sets each run's mode and seed from the phase; {given[0]} is not taken with it")
    frameworks = a.engine == "frameworks"
    if frameworks:
        needs(a)
    plan = cells(a.phase)
    first = build_parser().parse_args(cell_argv(argv, plan[0][0], plan[0][1], None))
    config_of(first, cell_argv(argv, plan[0][0], plan[0][1], None), resolve(first))  # resolves --workspace's output
    root = Path(first.output) / f"phase-{a.phase}-{new_run_id()}"
    configs = {}
    for seed, mode, name in plan:  # every cell's configuration, and its errors, before any run
        args = cell_argv(argv, seed, mode, root)
        ns = build_parser().parse_args(args)
        cfg = config_of(ns, args, resolve(ns))
        if cfg.mode != mode:
            raise RlkConfigError(f"the {mode} run of seed {seed} would run plan {cfg.plan.as_dict()} (an "
                                 "RL_KERNEL_<MODULE>_CASE variable overrides --mode); unset it for a phase pair")
        configs[name] = (args, cfg)
    preflight(configs[plan[0][2]][1], str(root.parent))
    root.mkdir(parents=True)
    rounds = configs[plan[0][2]][1].rounds  # the phase's, or --phase-rounds' shortened count
    write_json_atomic(root / PAIR_FILE, {
        "schema": PAIR_SCHEMA, "created_at": utc_now(), "command": ["rlk-repro", *argv], "phase": a.phase,
        "rounds": rounds, "phase_steps": PHASES[a.phase]["steps"], "seeds": list(PHASES[a.phase]["seeds"]),
        "engine": a.engine, "cells": [{"seed": seed, "mode": mode, "dir": name} for seed, mode, name in plan]})
    print(f"rlk-repro: phase {a.phase}, {len(plan) // 2} native / consistency pair(s) of {rounds} rounds into {root}",
          file=sys.stderr)
    return _run_cells(root, plan, configs, frameworks)


def _run_cells(root: Path, plan: list[tuple[int, str, str]], configs: dict[str, Any], frameworks: bool) -> int:
    from rlk_repro.engine.local import run_local
    from rlk_repro.progress import Progress

    failed, mismatched = [], []
    for _, _, name in plan:
        args, cfg = configs[name]
        try:
            bitwise = _frameworks_cell(args, name, root) if frameworks else run_local(
                cfg, root, run_name=name, progress=Progress()).bitwise
        except KeyboardInterrupt:
            raise
        except Exception as exc:  # one run failing does not lose the others; the report pairs what ran
            failed.append(name)
            print(f"  {name:24s} FAILED to run: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        if cfg.exact_required and bitwise["mismatch_count"]:
            mismatched.append(name)
        print(f"  {name:24s} {bitwise['mismatch_count']} of {bitwise['element_count']} tokens differ",
              file=sys.stderr)
    print(f"phase root: {root}\nreport it with: rlk-repro report {root}")
    if failed:
        print(f"rlk-repro: {len(failed)} run(s) of the phase failed ({', '.join(failed)}); see their run.log",
              file=sys.stderr)
        return EXIT_FAILED
    return EXIT_MISMATCH if mismatched else EXIT_OK


def _frameworks_cell(args: list[str], name: str, root: Path) -> dict[str, Any]:
    """One frameworks run in its own process (vLLM's plugin and the Megatron provider read the routes once per
    process), then its bitwise file."""
    proc = subprocess.run([sys.executable, "-m", "rlk_repro", *args, "--run-name", name], check=False)
    path = root / name / "bitwise-validation.json"
    if proc.returncode not in (EXIT_OK, EXIT_MISMATCH) or not path.is_file():
        raise RuntimeError(f"`rlk-repro {' '.join(args)} --run-name {name}` exited {proc.returncode}")
    return json.loads(path.read_text(encoding="utf-8"))


def read_pair_root(root: str | Path) -> dict[str, Any] | None:
    """A phase root's ``phase-pair.json`` (None when ``root`` is not a phase root); unreadable: exit 2."""
    path = Path(root) / PAIR_FILE
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RlkConfigError(f"{path}: unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != PAIR_SCHEMA or not isinstance(doc.get("cells"), list):
        raise RlkConfigError(f"{path} is not a {PAIR_SCHEMA} document")
    return doc
