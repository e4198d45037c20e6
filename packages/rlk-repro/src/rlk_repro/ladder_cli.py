"""``rlk-repro ladder``'s options and command (the mismatch-knob ladder of :mod:`rlk_repro.ladder`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence


def _unit(value: str) -> float:
    v = float(value)
    if not 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1)")
    return v


def _top_k(value: str) -> int:
    v = int(value)
    if v < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return v


def add_parser(sub, experiment_options: Callable[[argparse.ArgumentParser], None]) -> None:
    """The ``ladder`` subcommand; ``experiment_options`` adds ``run``'s experiment options (rlk_repro.cli's, passed in:
    this module does not import the command line that imports it)."""
    from rlk_repro.ladder import default_rungs

    names = ", ".join(r.name for r in default_rungs(0.9, 20, 1.0))
    lp = sub.add_parser("ladder", help="run the mismatch-knob ladder (one knob at a time) and classify each rung's "
                        "drift", description="Run every rung of the ladder (docs/ladder.md) into one new ladder root "
                        "under --output (or finish an interrupted one with --resume), check it with rlk-validate "
                        "ladder, and write ladder-report.json/.md and one figure per metric. A rung that needs what "
                        "this machine or engine lacks is skipped with its reason, never faked.")
    lp.add_argument("--output", default="rlk-runs", help="directory under which the ladder root is created (rlk-runs)")
    lp.add_argument("--resume", metavar="ROOT", help="an existing ladder root: run only its unfinished rungs")
    lp.add_argument("--engine", choices=("local", "frameworks"), default="local",
                    help="local (default) or frameworks (each rung a `rlk-repro run --engine frameworks` process)")
    lp.add_argument("--rungs", default=None, metavar="A,B,...", help=f"default rungs to run (all: {names})")
    lp.add_argument("--rung", action="append", default=None, metavar="NAME:KNOB=V,...",
                    help="add a rung after the others; knobs: case (P/P, R/R, ...), attention / ffn / logp (one "
                    "module's case), top_p, top_k, min_p, temperature, quantization (none, fp8), vs (the rung its "
                    "delta is taken against; default the rung before it); unnamed knobs are rung 0's. Repeatable")
    lp.add_argument("--filter-top-p", type=_unit, default=0.9, help="top-p of the default filter rungs (0.9)")
    lp.add_argument("--filter-top-k", type=_top_k, default=20, help="top-k of the default filter rungs (20)")
    lp.add_argument("--attribute", default=None, metavar="A,B,...|auto",
                    help="after the rungs: `rlk-repro attribute` on round 0 of these rungs (auto: every rung "
                    "classified candidate operator), written to <root>.attribution/<rung>/ (docs/attribution.md)")
    lp.add_argument("--dry-run", action="store_true",
                    help="print the rungs, their routes and knobs and which would be skipped (and why) as JSON; "
                    "runs and writes nothing")
    experiment_options(lp)


def main(a: argparse.Namespace, argv: Sequence[str], config, frameworks_cell, needs, build_parser,
         cell_argv=None) -> int:
    """``rlk-repro ladder``: the command line's own config, frameworks-cell, needs, parser and cell-arguments functions
    passed in."""
    from rlk_repro.ladder import run_ladder

    return run_ladder(a, argv, config, frameworks_cell, needs, build_parser, cell_argv)
