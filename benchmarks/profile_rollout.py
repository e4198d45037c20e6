"""Where the local engine's rollout step spends its host time: one run under cProfile, the step split by callee.

    python benchmarks/profile_rollout.py --device cuda --model qwen3-0.6b --rounds 2 --out DIR [--mode native]

Runs the local engine in-process (R/R, or P/P with ``--mode native``) with cProfile on only inside the rollout
steps (``RolloutEngine._step``) of the rounds after round 0 (round 0 imports and warms up), and writes under
``--out``: ``rollout.prof`` (``pstats`` / snakeviz) and ``profile.md`` — the step split over what it calls directly,
the share of the step inside a few named layers (the model's op table, rlk's route call, the public op's dispatch,
host-to-device tensor building, syncs), and the functions with the most own time in the steps. cProfile charges
every Python call a fixed cost, so its absolute times are inflated, the Python-heavy parts the most: read the
shares, and the engine's own ``rollout_step_ms`` (in ``metrics.jsonl``) for the times.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _pkg in ("rlk-core", "rlk-repro", "rlk-validate"):  # the checkout's packages, also without an install
    _src = str(ROOT / "packages" / _pkg / "src")
    if _src not in sys.path:
        sys.path.insert(0, _src)

from rlk_core.plan import RoutePlan  # noqa: E402
from rlk_repro.engine.local import LocalRunConfig, run_local  # noqa: E402
from rlk_repro.engine.rollout import RolloutEngine  # noqa: E402

STEP = ("engine/rollout.py", "_step")
# (label, file suffix or "" for a builtin, function name): cumulative time of each, as a share of the step's; the
# layers nest (an op-table method contains the route call, which contains the op's dispatch)
LAYERS = (
    ("op table (model/ops.py Ops methods)", "model/ops.py", None),
    ("rlk route call (routes.SideRoutes.call)", "rlk_core/routes.py", "call"),
    ("public op dispatch (rlk_core.ops._dispatch.Op.__call__)", "rlk_core/ops/_dispatch.py", "__call__"),
    ("torch.tensor from host lists", "", "<built-in method torch.tensor>"),
    ("tolist (waits for the device)", "", "<method 'tolist' of 'torch._C.TensorBase' objects>"),
)


def _is(key: tuple, suffix: str, name: str | None) -> bool:
    file, _, func = key
    if suffix == "":
        return file == "~" and func == name
    return file.endswith(suffix) and (name is None or func == name)


def _name(key: tuple) -> str:
    file, line, func = key
    if file == "~":
        return func
    parts = Path(file).parts
    return f"{'/'.join(parts[-2:])}:{line}({func})"


def summarise(stats: pstats.Stats, top: int = 30) -> str:
    """``profile.md``'s text from a profile that contains the rollout step."""
    steps = [k for k in stats.stats if k[0].endswith(STEP[0]) and k[2] == STEP[1]]
    if not steps:
        raise SystemExit("the profile holds no rollout step (RolloutEngine._step)")
    step = steps[0]
    calls, _, own, cum, _ = stats.stats[step]
    out = [f"Rollout step (`{_name(step)}`): {calls} calls, {cum:.2f} s under cProfile "
           f"({cum / calls * 1e3:.1f} ms a step), {own / cum:.0%} in its own lines.", "",
           "## The step by direct callee", "", "| callee | calls | s | share of the step |", "|---|---|---|---|"]
    direct = sorted(((k, v[4][step]) for k, v in stats.stats.items() if step in v[4]), key=lambda kv: -kv[1][3])
    for key, (n, _, _, ct) in direct:
        out.append(f"| `{_name(key)}` | {n} | {ct:.3f} | {ct / cum:.1%} |")
    out += ["", "## Layers (cumulative, nested: each contains the ones below it where they call each other)", "",
            "| layer | calls | s | share of the step |", "|---|---|---|---|"]
    for label, suffix, name in LAYERS:  # the profile holds the steps only: every function in it ran under one
        keys = [k for k in stats.stats if _is(k, suffix, name)]
        # the outermost calls only: time a function spends under another of the same layer is counted once
        n = sum(stats.stats[k][1] for k in keys)
        ct = sum(t for k in keys for caller, (_, _, _, t) in stats.stats[k][4].items() if not _is(caller, suffix, name))
        out.append(f"| {label} | {n} | {ct:.3f} | {ct / cum:.1%} |")
    out += ["", f"## The {top} functions with the most own time in the steps", "",
            "| function | calls | own s | share of the step |", "|---|---|---|---|"]
    for key in sorted(stats.stats, key=lambda k: -stats.stats[k][2])[:top]:
        n, _, tt, _, _ = stats.stats[key]
        out.append(f"| `{_name(key)}` | {n} | {tt:.3f} | {tt / cum:.1%} |")
    return "\n".join(out) + "\n"


def _profiled_steps(prof: cProfile.Profile, run):
    """``run()`` with ``prof`` enabled inside every rollout step of every ``generate`` call after the first."""
    generate, step = RolloutEngine.generate, RolloutEngine._step
    rounds = [0]

    def counting_generate(self, *args, **kwargs):
        try:
            return generate(self, *args, **kwargs)
        finally:
            rounds[0] += 1

    def profiled_step(self, *args, **kwargs):
        if rounds[0] == 0:
            return step(self, *args, **kwargs)
        prof.enable()
        try:
            return step(self, *args, **kwargs)
        finally:
            prof.disable()

    RolloutEngine.generate, RolloutEngine._step = counting_generate, profiled_step
    try:
        return run()
    finally:
        RolloutEngine.generate, RolloutEngine._step = generate, step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--mode", choices=("consistency", "native"), default="consistency")
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="tiny")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1234)
    a = p.parse_args(argv)
    if a.rounds < 2:
        raise SystemExit(f"--rounds must be >= 2 (round 0 imports and warms up and is not profiled), got {a.rounds}")
    case = "R/R" if a.mode == "consistency" else "P/P"
    cfg = LocalRunConfig(plan=RoutePlan(case, case, case), rounds=a.rounds, seed=a.seed, device=a.device,
                         dtype="bfloat16" if a.device.startswith("cuda") else "float32", model=a.model,
                         prompts_per_round=a.prompts, samples_per_prompt=a.samples, max_new_tokens=a.max_new_tokens,
                         max_num_seqs=a.max_num_seqs, chunk_size=a.chunk_size, page_size=a.page_size,
                         command=[sys.executable, *sys.argv])
    a.out.mkdir(parents=True, exist_ok=True)
    prof = cProfile.Profile()
    result = _profiled_steps(prof, lambda: run_local(cfg, a.out / "runs"))
    prof.dump_stats(a.out / "rollout.prof")
    commit = os.environ.get("RLK_COMMIT", "unknown")[:12]
    head = (f"# Rollout host profile: {a.mode}, {a.model} on {a.device}, {a.rounds} rounds of {a.prompts} x "
            f"{a.samples} samples, commit {commit}; run exit {result.exit_code}\n\n")
    text = head + summarise(pstats.Stats(prof))
    (a.out / "profile.md").write_text(text)
    print(text)
    return 0 if result.exit_code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
