"""A synthetic math set in DAPO-Math-17k's prompt / label layout, generated here from a seed (issue 37, "a model that
learns").

Never data for a DAPO claim: every file's manifest says ``purpose: synthetic``, so a run on it records
``claims.experiment = false`` with that reason (:func:`rlk_repro.engine.prompts.claims`) and ``report`` repeats it.
It exists to give a small model something to learn in a device call: arithmetic and simple algebra whose answers
are integers or reduced fractions, written as the deepscaler rule reads them (``68``, ``-12``, ``\\frac{7}{2}``,
``-\\frac{3}{4}``).

Families (:data:`FAMILIES`): ``add`` / ``sub`` (operands of 1-3 digits), ``mul`` (a 1-2 digit number times a digit),
``linear`` (solve ``a x + b = c``; integer or fractional root), ``frac`` (the sum of two fractions of one-digit
denominators), ``eval`` (``a x - b`` at an integer ``x``). Each problem comes with a short worked solution in the
form the warm start teaches (:func:`completion`): ``<think>\\n<work>\\n</think>\\n\\n\\boxed{<answer>}``; the reward
reads only what follows ``</think>``.

Rows are VIME's JSONL as ``prepare`` writes them (``{"prompt": [{"role": "user", "content": ...}], "label": ...,
"metadata": {...}}``); the metadata adds ``family``, ``split`` and the worked ``solution``. The splits are disjoint
(no question text in two splits): ``sft`` (the warm start's), ``rl`` (GRPO's prompts) and ``heldout`` (evaluation
only). The same seed and counts give the same bytes (:func:`generate`).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError

GENERATOR = "rlk.synthetic-math.v1"
DATA_SOURCE = "rlk-synthetic-math"
PURPOSE = "synthetic"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
#: family -> its weight in the mix
FAMILIES: dict[str, int] = {"add": 3, "sub": 3, "mul": 2, "linear": 2, "frac": 1, "eval": 2}
SPLITS = ("sft", "rl", "heldout")


def latex(q: Fraction) -> str:
    """An integer or a reduced fraction as the deepscaler rule's graders compare it (sign in front)."""
    if q.denominator == 1:
        return str(q.numerator)
    sign = "-" if q < 0 else ""
    return f"{sign}\\frac{{{abs(q.numerator)}}}{{{q.denominator}}}"


def _plain(q: Fraction) -> str:
    return str(q.numerator) if q.denominator == 1 else f"{q.numerator}/{q.denominator}"


def _digits(rng: random.Random) -> int:
    return rng.choice((1, 2, 2, 3))


def _operand(rng: random.Random) -> int:
    return rng.randrange(10 ** _digits(rng))


def problem(rng: random.Random, family: str) -> tuple[str, Fraction, str]:
    """``(question, answer, worked lines)`` of one problem of ``family``."""
    if family == "add":
        a, b = _operand(rng), _operand(rng)
        return f"What is ${a} + {b}$?", Fraction(a + b), f"{a} + {b} = {a + b}"
    if family == "sub":
        a, b = _operand(rng), _operand(rng)
        return f"What is ${a} - {b}$?", Fraction(a - b), f"{a} - {b} = {a - b}"
    if family == "mul":
        a, b = rng.randrange(2, 100), rng.randrange(2, 10)
        return f"What is ${a} \\times {b}$?", Fraction(a * b), f"{a} * {b} = {a * b}"
    if family == "linear":
        a = rng.choice([k for k in range(-9, 10) if k not in (-1, 0, 1)])
        b, c = rng.randrange(-30, 31), rng.randrange(-30, 31)
        x = Fraction(c - b, a)
        bs = f"+ {b}" if b >= 0 else f"- {-b}"
        work = f"{a}x = {c} - ({b}) = {c - b}\nx = {c - b}/{a} = {_plain(x)}"
        return f"Solve ${a}x {bs} = {c}$ for $x$.", x, work
    if family == "frac":
        b, d = rng.randrange(2, 10), rng.randrange(2, 10)
        a, c = rng.randrange(1, b), rng.randrange(1, d)
        s = Fraction(a, b) + Fraction(c, d)
        work = f"{a}/{b} + {c}/{d} = {a * d + c * b}/{b * d} = {_plain(s)}"
        return f"Compute $\\frac{{{a}}}{{{b}}} + \\frac{{{c}}}{{{d}}}$.", s, work
    if family == "eval":
        a, b, x = rng.randrange(2, 10), rng.randrange(0, 50), rng.randrange(-9, 10)
        return (f"Evaluate ${a}x - {b}$ at $x = {x}$.", Fraction(a * x - b),
                f"{a} * ({x}) - {b} = {a * x} - {b} = {a * x - b}")
    raise RlkConfigError(f"family {family!r} is not one of {', '.join(FAMILIES)}")


def completion(work: str, answer: str) -> str:
    """The response the warm start teaches (the EOS token follows it)."""
    return f"<think>\n{work}\n</think>\n\n\\boxed{{{answer}}}"


def generate(counts: dict[str, int], seed: int, families: tuple[str, ...] | None = None) -> dict[str, list[dict]]:
    """``{split: rows}`` for ``counts`` (split -> rows), drawn from one ``random.Random(seed)``; a question never
    repeats, within a split or across them."""
    fams = tuple(families or FAMILIES)
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        raise RlkConfigError(f"family {bad[0]!r} is not one of {', '.join(FAMILIES)}")
    for split, n in counts.items():
        if split not in SPLITS or n < 1:
            raise RlkConfigError(f"split {split!r}: {n} rows; splits are {', '.join(SPLITS)}, each >= 1 row")
    rng = random.Random(f"{GENERATOR}:{seed}")
    weights = [FAMILIES[f] for f in fams]
    seen: set[str] = set()
    out: dict[str, list[dict]] = {}
    for split, n in counts.items():
        rows: list[dict] = []
        misses = 0
        while len(rows) < n:
            family = rng.choices(fams, weights)[0]
            question, answer, work = problem(rng, family)
            if question in seen:
                misses += 1
                if misses > 100 * n + 1000:
                    raise RlkConfigError(f"{family}: too few distinct problems for {n} rows of {split}")
                continue
            seen.add(question)
            label = latex(answer)
            rows.append({"prompt": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}], "label": label,
                         "metadata": {"index": f"{split}-{len(rows):06d}", "data_source": DATA_SOURCE,
                                      "family": family, "split": split, "solution": completion(work, label)}})
        out[split] = rows
    return out


def file_name(split: str) -> str:
    return f"synthetic-math.{split}.vime.jsonl"


def write(data_dir: Path, counts: dict[str, int], seed: int, families: tuple[str, ...] | None = None
          ) -> dict[str, dict[str, Any]]:
    """Write each split's JSONL and sibling manifest (``rlk.prepare-data.v1``, purpose ``synthetic``) into
    ``data_dir``; returns ``{split: manifest}``."""
    from rlk_repro import lifecycle, runs
    from rlk_repro.prepare import _tool
    from rlk_repro.workspace import DATA_SCHEMA, manifest_path

    data = generate(counts, seed, families)
    data_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for split, rows in data.items():
        path = data_dir / file_name(split)
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
            for row in rows:
                fh.write(json.dumps(row, ensure_ascii=False) + "\n")
        tmp.replace(path)
        fams: dict[str, int] = {}
        for row in rows:
            fams[row["metadata"]["family"]] = fams.get(row["metadata"]["family"], 0) + 1
        doc = {"schema": DATA_SCHEMA, "created_at": lifecycle.utc_now(), "tool": _tool(),
               "source": {"kind": "synthetic", "generator": GENERATOR, "seed": seed, "split": split,
                          "counts": dict(counts), "families": sorted(families or FAMILIES), "path": None,
                          "sha256": None, "rows": len(rows)},
               "output": {"name": path.name, "sha256": runs.file_sha256(path), "bytes": path.stat().st_size,
                          "rows": len(rows), "format": "vime-jsonl", "input_key": "prompt", "label_key": "label",
                          "metadata_key": "metadata", "families": fams},
               "dedup": {"key": "question text", "kept": "first", "duplicates_dropped": 0},
               "purpose": PURPOSE,
               "purpose_reason": (f"synthetic arithmetic / algebra generated by {GENERATOR} (seed {seed}, split "
                                  f"{split}): never backs a DAPO-Math-17k experiment or reward claim")}
        runs.write_json_atomic(manifest_path(path), doc)
        out[split] = doc
    return out


def read_rows(path: Path) -> list[dict]:
    """The rows of a synthetic split (its manifest checked: a file edited after it was written is refused)."""
    from rlk_repro.workspace import read_data_manifest

    man = read_data_manifest(path)
    if man is None or man.get("purpose") != PURPOSE:
        raise RlkConfigError(f"{path} is not a synthetic-math split (no manifest with purpose {PURPOSE!r} beside it)")
    rows = [json.loads(x) for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
    for n, row in enumerate(rows):
        if not isinstance((row.get("metadata") or {}).get("solution"), str):
            raise RlkConfigError(f"{path} line {n + 1}: no metadata.solution (the warm start's target)")
    return rows
