"""``rlk-repro ladder``: the mismatch-knob ladder (issue 38, ``docs/ladder.md``) as rung directories of one root.

Each rung is a full run of the chosen engine (``local`` or ``frameworks``) with the ladder's one configuration —
same prompts, seeds, checkpoint and batch layout — and the rung's knobs: its routes (``case``, or one module's),
the sampling filters (``top_p``, ``top_k``, ``min_p``), the temperature and the rollout quantization. The default
rungs turn one knob on at a time (:func:`default_rungs`); ``--rung NAME:KNOB=V,...`` adds one. A rung that needs
what this machine or engine lacks (FP8 rollout) is skipped and says why in ``<rung>.skipped.json``; it is never
run another way. The cells' machinery of :mod:`rlk_repro.matrix` runs the rungs: the lock of the root, the options
recorded once (``ladder-options.json``), ``--resume`` running only what has not finished and moving an interrupted
rung aside, never deleting it. Then ``rlk-validate ladder`` checks the root and writes ``ladder-report.json/.md``
(each rung's drift metrics, delta against its reference rung and drift class), and one figure per metric goes to
``report/``.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro import lifecycle, matrix
from rlk_repro.progress import Progress
from rlk_validate import evidence
from rlk_validate.evidence import LADDER_OPTIONS, LADDER_OPTIONS_SCHEMA
from rlk_validate.evidence import LADDER_SKIP_SCHEMA as SKIP_SCHEMA
from rlk_validate.evidence import LADDER_SKIP_SUFFIX as SKIP_SUFFIX

EXIT_OK, EXIT_MISMATCH, EXIT_FAILED = 0, 1, 3
MODULES = ("attention", "ffn", "logp")
CASES = ("P/P", "P/R", "R/P", "R/R")
QUANTIZATIONS = ("none", "fp8")
#: what a rung may set (``--rung NAME:KNOB=VALUE,...``); ``vs`` names the rung its delta is taken against
KNOBS = ("case", *MODULES, "top_p", "top_k", "min_p", "temperature", "quantization", "vs")
#: the run configuration's keys that a rung's knobs set (they differ between rungs; everything else is shared)
KNOB_KEYS = ("top_p", "top_k", "min_p", "temperature", "rollout_quantization")


@dataclass(frozen=True)
class Rung:
    name: str
    knobs: tuple[tuple[str, Any], ...]  # sorted (knob, value) pairs, vs left out
    vs: str | None = None

    @property
    def k(self) -> dict[str, Any]:
        return dict(self.knobs)

    @property
    def plan(self) -> dict[str, str]:
        k = self.k
        return {m: k.get(m) or k["case"] for m in MODULES}

    @property
    def needs(self) -> list[str]:
        """What the rung needs beyond what every run of the engine has: ``fp8`` (an FP8 rollout)."""
        return ["fp8"] if self.k["quantization"] == "fp8" else []

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "knobs": self.k, "plan": self.plan, "vs": self.vs, "needs": self.needs}


def _rung(name: str, vs: str | None = None, **knobs: Any) -> Rung:
    return Rung(name, tuple(sorted(knobs.items())), vs)


def default_rungs(top_p: float, top_k: int, temperature: float) -> list[Rung]:
    """The seeds' ladder: 0 near-aligned (P/P, no filter, fixed temperature), 1 FP8 rollout only, 2 top-p only,
    3 top-k only, 4 FP8 with both filters; and the rlk rungs, R/R at 0, 2 and 3. Each compares with the rung that
    differs from it by the one knob it turns on."""
    base = {"case": "P/P", "top_p": 1.0, "top_k": 0, "min_p": 0.0, "temperature": temperature, "quantization": "none"}
    return [
        _rung("0-aligned", None, **base),
        _rung("1-fp8", "0-aligned", **{**base, "quantization": "fp8"}),
        _rung("2-top-p", "0-aligned", **{**base, "top_p": top_p}),
        _rung("3-top-k", "0-aligned", **{**base, "top_k": top_k}),
        _rung("4-fp8-filters", "1-fp8", **{**base, "quantization": "fp8", "top_p": top_p, "top_k": top_k}),
        _rung("rr-0-aligned", "0-aligned", **{**base, "case": "R/R"}),
        _rung("rr-2-top-p", "2-top-p", **{**base, "case": "R/R", "top_p": top_p}),
        _rung("rr-3-top-k", "3-top-k", **{**base, "case": "R/R", "top_k": top_k}),
    ]


def _value(knob: str, text: str) -> Any:
    try:
        if knob in ("case", *MODULES):
            value = text.strip().upper()
            if value not in CASES:
                raise ValueError(f"one of {', '.join(CASES)}")
            return value
        if knob == "quantization":
            if text not in QUANTIZATIONS:
                raise ValueError(f"one of {', '.join(QUANTIZATIONS)}")
            return text
        if knob == "top_k":
            return int(text)
        if knob == "vs":
            return text
        value = float(text)
        if not math.isfinite(value):
            raise ValueError("a finite number")
        return value
    except ValueError as exc:
        raise RlkConfigError(f"--rung: {knob}={text!r} is not {exc if 'one of' in str(exc) else 'a number'}") from None


def parse_rung(spec: str, base: dict[str, Any], names: Sequence[str]) -> Rung:
    """``NAME:KNOB=VALUE,...`` (e.g. ``tp09-k20-rr:top_p=0.9,top_k=20,case=R/R``): a rung with ``base``'s knobs (rung
    0's) except those named; ``vs`` defaults to the rung before it."""
    name, sep, rest = spec.partition(":")
    name = name.strip()
    if not sep or not name or "/" in name or name.startswith(".") or name.endswith(SKIP_SUFFIX) \
            or ".interrupted-" in name or any(c.isspace() for c in name):
        raise RlkConfigError(f"--rung {spec!r}: expected NAME:KNOB=VALUE,... with a plain directory name")
    if name in names:
        raise RlkConfigError(f"--rung {spec!r}: a rung named {name} is already in the ladder")
    knobs = dict(base)
    vs = names[-1] if names else None
    for item in filter(None, (x.strip() for x in rest.split(","))):
        knob, eq, text = item.partition("=")
        knob = knob.strip().replace("-", "_")
        if not eq or knob not in KNOBS:
            raise RlkConfigError(f"--rung {spec!r}: {item!r} is not KNOB=VALUE with KNOB one of {', '.join(KNOBS)}")
        if knob == "vs":
            vs = _value(knob, text.strip())
            if vs not in names:
                raise RlkConfigError(f"--rung {spec!r}: vs={vs} is not a rung before it ({', '.join(names)})")
        else:
            knobs[knob] = _value(knob, text.strip())
    return _rung(name, vs, **knobs)


def rungs_of(a: argparse.Namespace) -> list[Rung]:
    """The ladder's rungs: the defaults named by ``--rungs`` (all of them by default), then each ``--rung``."""
    defaults = default_rungs(a.filter_top_p, a.filter_top_k, a.temperature)
    if a.rungs is None:
        rungs = defaults
    else:
        by_name = {r.name: r for r in defaults}
        wanted = [x.strip() for x in a.rungs.split(",") if x.strip()]
        bad = [x for x in wanted if x not in by_name]
        if bad or (not wanted and not a.rung):
            raise RlkConfigError(f"--rungs: {bad or a.rungs!r} not default rungs; allowed: {', '.join(by_name)}")
        rungs = [by_name[x] for x in dict.fromkeys(wanted)]
        names = {r.name for r in rungs}
        rungs = [r if r.vs in names or r.vs is None else Rung(r.name, r.knobs, None) for r in rungs]
    base = defaults[0].k
    for spec in a.rung or []:
        rungs.append(parse_rung(spec, base, [r.name for r in rungs]))
    return rungs


def capability(need: str, engine: str, device: str) -> tuple[bool, str]:
    """Whether this engine on this machine has ``need``, and why not (a skip reason)."""
    if need != "fp8":
        return False, f"unknown need {need!r}"
    if engine == "local":
        return False, ("FP8 rollout: the local engine has none (its P ops are PyTorch in the run's dtype, its R ops "
                       "rlk's; there is no quantized path to run); run the ladder with --engine frameworks on a GPU "
                       "with FP8 tensor cores")
    from rlk_repro.engine.fp8 import device_problem

    why = device_problem() if device.startswith("cuda") else f"--device {device} is not a CUDA device"
    return (True, "") if why is None else (False, f"FP8 rollout (vLLM quantization='fp8'): {why}")


def _rung_namespace(a: argparse.Namespace, rung: Rung) -> argparse.Namespace:
    k = rung.k
    return argparse.Namespace(**{**vars(a), "top_p": k["top_p"], "top_k": k["top_k"], "min_p": k["min_p"],
                                 "temperature": k["temperature"], **{f"{m}_case": None for m in MODULES},
                                 "mode": None, "rollout_quantization": k["quantization"]})


def _configs(a: argparse.Namespace, argv: Sequence[str], config_of, rungs: list[Rung], skips: dict[str, str]):
    """Every rung's run configuration (a rung to be skipped has none), built before anything runs: a bad knob stops
    the ladder here."""
    from rlk_core import routes
    from rlk_core.plan import RoutePlan

    out = {}
    for r in rungs:
        if r.name in skips:
            continue
        resolved = routes.Resolved(RoutePlan(**r.plan), dict.fromkeys(MODULES, f"ladder rung {r.name}"))
        out[r.name] = config_of(_rung_namespace(a, r), argv, resolved)
    return out


def _shared(cfg) -> dict[str, Any]:
    """A rung's configuration without what its routes, knobs or this invocation decide: the same for every rung."""
    return {k: v for k, v in asdict(cfg).items() if k not in (*matrix._CELL_KEYS, *KNOB_KEYS)}


def _options(a: argparse.Namespace) -> dict[str, Any]:
    return {k: v for k, v in sorted(vars(a).items()) if k not in (*matrix.NOT_RECORDED, "dry_run", "attribute")}


def _skips(rungs: list[Rung], engine: str, device: str) -> dict[str, str]:
    out = {}
    for r in rungs:
        for need in r.needs:
            ok, why = capability(need, engine, device)
            if not ok:
                out[r.name] = why
                break
    return out


def _check_knob_flags(a: argparse.Namespace) -> None:
    given = [f for f, v, d in (("--top-p", a.top_p, None), ("--top-k", a.top_k, 0), ("--min-p", a.min_p, 0.0))
             if v != d]
    if given:
        raise RlkConfigError(f"{', '.join(given)}: the ladder sets the filters per rung; use --filter-top-p / "
                             "--filter-top-k for the default rungs, or --rung NAME:top_p=...,top_k=...")
    if getattr(a, "rollout_quantization", "none") != "none":
        raise RlkConfigError("--rollout-quantization: the ladder sets it per rung (rungs 1-fp8 and 4-fp8-filters, or "
                             "--rung NAME:quantization=fp8)")


def _resume(a: argparse.Namespace, root: Path, build_parser) -> argparse.Namespace:
    try:
        doc = json.loads((root / LADDER_OPTIONS).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RlkConfigError(f"--resume {root}: {LADDER_OPTIONS} is unreadable ({exc})") from None
    if not isinstance(doc, dict) or doc.get("schema") != LADDER_OPTIONS_SCHEMA:
        raise RlkConfigError(f"--resume {root}: {LADDER_OPTIONS} is not a {LADDER_OPTIONS_SCHEMA} document")
    defaults = vars(build_parser().parse_args(["ladder"]))
    attribute = getattr(a, "attribute", None)  # what to do after the rungs, not how they run: not recorded
    given = argparse.Namespace(**{k: v for k, v in vars(a).items() if k != "attribute"})
    merged = matrix.merge_recorded(given, root, doc, defaults, LADDER_OPTIONS, "every rung of a ladder shares one "
                                   "configuration. Drop the flag, or start a new ladder", what="ladder")
    merged.dry_run = a.dry_run
    merged.attribute = attribute
    merged._recorded_rungs = doc.get("rungs")
    return merged


def resume_command(root: Path) -> str:
    return f"rlk-repro ladder --resume {shlex.quote(str(root))}"


def run_ladder(a: argparse.Namespace, argv: Sequence[str], config_of, frameworks_cell, needs, build_parser,
               cell_argv=None) -> int:
    """``rlk-repro ladder``; the CLI hands in what :func:`rlk_repro.matrix.run_matrix` takes (``cli._config``, the
    frameworks cell runner, the engine check, the parser) and ``cell_argv(a, plan, root, cell)``, the
    ``rlk-repro run`` arguments of a frameworks rung (``--dry-run`` prints them)."""
    from rlk_core import envs
    from rlk_repro.engine.local import run_local
    from rlk_repro.lifecycle import utc_now
    from rlk_repro.runs import new_run_id, write_json_atomic

    root, a = matrix.root_and_options(a, lambda a, root: _resume(a, root, build_parser))
    _check_knob_flags(a)
    rungs = rungs_of(a)
    unknown = [n for n in (getattr(a, "attribute", None) or "auto").split(",")
               if n.strip() and n != "auto" and n.strip() not in {r.name for r in rungs}]
    if unknown:
        raise RlkConfigError(f"--attribute {a.attribute}: {unknown[0]!r} is not a rung of this ladder "
                             f"({', '.join(r.name for r in rungs)}; or auto)")
    if root is not None and a._recorded_rungs != [r.as_json() for r in rungs]:
        raise RlkConfigError(f"--resume {root}: the recorded rungs differ from those its options give now")
    frameworks = a.engine == "frameworks"
    if frameworks and not a.dry_run:
        needs(a)
    envs.snapshot()
    device = a.device or ("cuda" if frameworks else "cpu")
    problem = lifecycle.forced_backends_problem(device.split(":")[0])
    if problem:
        raise RlkConfigError(problem)
    skips = _skips(rungs, a.engine, device)
    configs = _configs(a, argv, config_of, rungs, skips)
    if not configs:
        raise RlkConfigError("every rung of this ladder would be skipped: " + "; ".join(skips.values()))
    shared = _shared(next(iter(configs.values())))
    if a.dry_run:
        commands = ({r.name: shlex.join(["rlk-repro", *cell_argv(_rung_namespace(a, r), configs[r.name].plan.as_dict(),
                                                                 Path(a.output) / "ladder-ID", r.name)])
                     for r in rungs if r.name in configs} if frameworks and cell_argv is not None else {})
        print(json.dumps(dry_run(a, rungs, skips, configs, shared, commands), indent=2))
        return EXIT_OK
    if a.samples_per_prompt == 1 and not a.static_weights:
        lifecycle.warn(matrix.static_weights_warning())
    if root is not None:
        matrix.check_config(root, a._recorded_config, shared)
        lock = lifecycle.lock_matrix_root(root, ["rlk-repro", *argv])
    else:
        root = Path(a.output) / f"ladder-{new_run_id()}"
        root.mkdir(parents=True)
        lock = lifecycle.lock_matrix_root(root, ["rlk-repro", *argv])
        write_json_atomic(root / LADDER_OPTIONS, {
            "schema": LADDER_OPTIONS_SCHEMA, "created_at": utc_now(), "command": ["rlk-repro", *argv],
            "engine": a.engine, "options": _options(a), "config": shared, "rungs": [r.as_json() for r in rungs]})
    try:
        for name, reason in skips.items():
            path = root / f"{name}{SKIP_SUFFIX}"
            if not path.exists():  # append-only: a skip recorded earlier stays as it was
                write_json_atomic(path, {"schema": SKIP_SCHEMA, "rung": name, "reason": reason,
                                         "needs": next(r.needs for r in rungs if r.name == name),
                                         "engine": a.engine, "device": device, "at": utc_now()})
            print(f"  {name:16s} skipped: {reason}", file=sys.stderr)

        def run_one(name: str):
            return (frameworks_cell(_rung_namespace(a, _by(rungs, name)), configs[name], root, name) if frameworks
                    else run_local(configs[name], root, run_name=name, progress=Progress()))

        def done(name: str, result) -> str:
            b = result.bitwise
            return f"{_by(rungs, name).k}: {b['mismatch_count']} of {b['element_count']} tokens differ"

        print(f"rlk-repro: ladder root {root}, {len(rungs)} rungs ({len(skips)} skipped), {a.rounds} rounds each",
              file=sys.stderr)
        failed = matrix.run_cells(root, list(configs), run_one, done, "ladder", resume_command(root))
        code = _finish(root, failed)
        if getattr(a, "attribute", None):
            attributed = attribute_rungs(root, a.attribute)
            if code == EXIT_OK and attributed:
                code = EXIT_FAILED
        return code
    finally:
        lock.release()


def attribute_rungs(root: Path, which: str) -> list[str]:
    """``ladder --attribute``: ``rlk-repro attribute`` on round 0 of the rungs ``which`` names (``A,B,...``), or of
    every rung the report classifies ``candidate operator`` (``auto``), each in its own process (a frameworks rung's
    replay starts vLLM and Megatron), written beside the root in ``<root>.attribution/<rung>/`` (the root is checked by
    ``rlk-validate ladder``: nothing is added to it). A rung attributed before is kept. Returns the rungs whose
    attribution failed."""
    import subprocess

    doc = json.loads((root / evidence.LADDER_REPORT_JSON).read_text(encoding="utf-8"))
    rungs = {g["name"]: g for g in doc.get("rungs", [])}
    if which == "auto":
        names = [n for n, g in rungs.items() if (g.get("classification") or {}).get("class") == "candidate operator"]
        print(f"rlk-repro ladder --attribute auto: {len(names)} rung(s) classified candidate operator"
              + (f" ({', '.join(names)})" if names else ""), file=sys.stderr)
    else:
        names = [n.strip() for n in which.split(",") if n.strip()]
    failed = []
    for name in names:
        run, out = root / name, root.parent / f"{root.name}.attribution" / name
        if not (run / evidence.MANIFEST).is_file():
            why = (rungs.get(name) or {}).get("status", "not a rung of this ladder")
            print(f"  {name:16s} not attributed: no run directory ({why})", file=sys.stderr)
            continue
        if (out / "attribution.json").is_file():
            print(f"  {name:16s} attributed earlier: {out}", file=sys.stderr)
            continue
        proc = subprocess.run([sys.executable, "-m", "rlk_repro", "attribute", str(run), "--output", str(out)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            failed.append(name)
            print(f"  {name:16s} attribution failed (exit {proc.returncode}): {proc.stderr.strip()[-600:]}",
                  file=sys.stderr)
            continue
        verdict = json.loads((out / "attribution.json").read_text(encoding="utf-8"))["verdict"]
        print(f"  {name:16s} attribution: {verdict['kind']}: {verdict['summary']}", file=sys.stderr)
        print(f"attribution: {out}/attribution.md")
    return failed


def _by(rungs: list[Rung], name: str) -> Rung:
    return next(r for r in rungs if r.name == name)


def _finish(root: Path, failed: list[str]) -> int:
    from rlk_validate.ladder import validate_ladder

    rep = validate_ladder(str(root), write=True)
    written, why = write_figures(rep.to_json(), root / evidence.REPORT_DIR)
    print(rep.summary())
    for p in written:
        print(f"wrote {p}")
    if why:
        print(f"rlk-repro ladder: figures skipped: {why}", file=sys.stderr)
    print(f"ladder root: {root}")
    if failed:
        print(f"rlk-repro ladder: {len(failed)} rung(s) failed ({', '.join(failed)}); after fixing the cause, run "
              f"them again with:\n  {resume_command(root)}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK if rep.exit_code == 0 else EXIT_MISMATCH


def dry_run(a: argparse.Namespace, rungs: list[Rung], skips: dict[str, str], configs: dict, shared: dict,
            commands: dict[str, str] | None = None) -> dict:
    """What ``rlk-repro ladder`` would do with these options: every rung, its routes and knobs, whether it would
    run or be skipped (and why), the variables that select its routes, and (``--engine frameworks``) the
    ``rlk-repro run`` command of its process (``commands``); nothing is created."""
    out = []
    for r in rungs:
        cfg = configs.get(r.name)
        out.append({**r.as_json(), "action": "skip" if r.name in skips else "run", "skip_reason": skips.get(r.name),
                    "env": cfg.plan.env() if cfg is not None else None,
                    "require_exact": cfg.exact_required if cfg is not None else None,
                    **({"command": (commands or {}).get(r.name)} if commands else {})})
    return {"engine": a.engine, "rounds": a.rounds, "rungs": out,
            "config": {k: v for k, v in shared.items() if k != "plan_sources"}}


# -- figures -----------------------------------------------------------------------------------------------------------
#: (metric key of rlk_validate.ladder_metrics, title, unit, log axis)
FIGURES = (
    ("abs_mean", "mean |train - rollout| log-prob (VIME's train_rollout_logprob_abs_diff)", "nats", True),
    ("mean", "mean (train - rollout) log-prob, signed", "nats", False),
    ("abs_max", "max |train - rollout| log-prob", "nats", True),
    ("abs_p50", "p50 |train - rollout| log-prob", "nats", True),
    ("abs_p90", "p90 |train - rollout| log-prob", "nats", True),
    ("abs_p99", "p99 |train - rollout| log-prob", "nats", True),
    ("mismatch_rate", "mismatch rate (tokens whose log-probs differ)", "fraction of compared tokens", False),
    ("k3_kl", "K3 estimate of KL(rollout || train) before the first update", "nats", True),
    ("clip_fraction", "clip fraction (|ratio - 1| > clip eps) before the first update", "fraction of tokens", False),
)
CLASS_COLORS = {"none": "#000000", "expected numerical": "#1f77b4", "semantic": "#ff7f0e", "framework": "#9467bd",
                "candidate operator": "#d62728", "not run": "#bbbbbb"}


def write_figures(doc: dict[str, Any], out: Path) -> tuple[list[Path], str | None]:
    """One figure per metric across the rungs (``ladder-<metric>.png`` in ``out``), bars coloured by drift class; a
    rung at exactly 0 is labelled so (a log axis cannot draw it) and a skipped rung says it was skipped. Returns the
    files written and why none were (matplotlib missing)."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        return [], "matplotlib is not installed (pip install 'rlk-validate[plot]')"
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from rlk_repro import report_meta
    from rlk_repro.report import _compact_log, save_png
    from rlk_validate.ladder_metrics import metric

    out.mkdir(parents=True, exist_ok=True)
    rungs = doc["rungs"]
    provs = []
    for g in rungs:
        try:
            provs.append(report_meta.provenance(json.loads((Path(doc["ladder_root"]) / g["name"] / "manifest.json")
                                                           .read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    footer = report_meta.footer(provs[:1], [f"engine {doc.get('engine')}; the rungs differ in their knobs (routes, "
                                            "filters, temperature, quantization) by design; classes: docs/ladder.md"])
    written = []
    for key, title, unit, log in FIGURES:
        values = [metric(g["metrics"], key) if g.get("metrics") else None for g in rungs]
        classes = [(g.get("classification") or {}).get("class", "not run") for g in rungs]
        fig = Figure(figsize=(max(6.5, 0.95 * len(rungs) + 2), 4.2), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        fig.suptitle(f"ladder: {title}", fontsize=10, x=0.01, ha="left", fontweight="bold")
        fig.supxlabel(footer, fontsize=7, x=0.01, ha="left", color="#444444")
        x = list(range(len(rungs)))
        positive = [v for v in values if v is not None and v > 0]
        use_log = log and bool(positive)
        heights = [v if v is not None and (v > 0 or not use_log) else float("nan") for v in values]
        ax.bar(x, heights, color=[CLASS_COLORS.get(c, "#7f7f7f") for c in classes], width=0.7)
        if use_log:
            ax.set_yscale("log")
            ax.set_ylim(min(positive) / 5, max(positive) * 5)
            _compact_log(ax.yaxis)
        for i, (v, g) in enumerate(zip(values, rungs, strict=True)):
            text = ("skipped" if g["status"] == "skipped" else "no data" if v is None
                    else "0 (bitwise equal)" if v == 0 else f"{v:.3g}")
            y = 0.02 if (v is None or v == 0 or (use_log and v <= 0)) else None
            ax.annotate(text, (i, y if y is not None else v), xytext=(0, 2), textcoords="offset points",
                        ha="center", fontsize=7, rotation=90 if v is None or v == 0 else 0,
                        xycoords=("data", "axes fraction") if y is not None else "data")
        ax.set_xticks(x, [g["name"] for g in rungs], rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.tick_params(labelsize=8)
        seen = list(dict.fromkeys(classes))
        ax.legend([Patch(color=CLASS_COLORS.get(c, "#7f7f7f")) for c in seen], seen, fontsize=7, title="drift class",
                  title_fontsize=7, loc="upper left")
        path = out / f"ladder-{key.replace('_', '-')}.png"
        save_png(fig, path)
        written.append(path)
    return written, None
