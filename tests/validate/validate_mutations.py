"""Mutations that break a valid run directory, for the broken-input corpus of test_corpus.py."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from validate_builders import build_run, load_round, mutate_json, train_data_path, tree_state, write_round

EXIT = {"passed": 0, "failed": 1, "incomplete": 2, "unusable": 3}
#: every case finishes within this many seconds (the slowest, an empty COMPLETE, waits ~3 s for a sealer)
CASE_SECONDS = 20.0

PR_ATTN = {"attention": "P/R", "ffn": "R/R", "logp": "R/R"}


@dataclass
class Case:
    id: str
    mutate: Callable[[Path, Path], None]
    verdict: str
    code: str
    needle: str  # must appear in the finding's message
    plan: dict[str, str] | None = None
    args: tuple[str, ...] = ()
    marks: list = field(default_factory=list)
    build: dict = field(default_factory=dict)  # extra keyword arguments of build_run


def _rb(run: Path, side: str = "training") -> Path:
    return run / "readbacks" / f"local-{side}-1000.json"


def _set(path_fn, fn):
    def mutate(run: Path, tmp: Path) -> None:
        mutate_json(path_fn(run), fn)

    return mutate


def _write(rel: str, data: bytes | str):
    def mutate(run: Path, tmp: Path) -> None:
        p = run / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(data, bytes) else p.write_text)(data)

    return mutate


def _truncate(rel: str, keep: float = 0.5):
    def mutate(run: Path, tmp: Path) -> None:
        p = run / rel
        b = p.read_bytes()
        p.write_bytes(b[: int(len(b) * keep)])

    return mutate


def _remove(rel: str):
    def mutate(run: Path, tmp: Path) -> None:
        p = run / rel
        shutil.rmtree(p) if p.is_dir() else p.unlink()

    return mutate


def _tensors(rnd: int, fn, metadata: dict[str, str] | None = None):
    def mutate(run: Path, tmp: Path) -> None:
        p = train_data_path(run, rnd)
        t = load_round(p)
        fn(t)  # mutates in place
        write_round(p, t, rnd, 0, metadata)

    return mutate


def _first_active(t) -> tuple[int, int]:
    s, p = np.nonzero(t["response_mask"])
    return int(s[0]), int(p[0])


def _poke(name: str, value: float):
    def fn(t):
        s, p = _first_active(t)
        t[name][s, p] = np.float32(value)

    return fn


def _ulp_flip(t):
    s, p = _first_active(t)
    t["train_logprobs"][s, p] = np.nextafter(t["train_logprobs"][s, p], np.float32(-np.inf), dtype=np.float32)


def _nested_fallback(doc):
    doc["modules"]["ffn"]["ops"]["ffn.main"]["provenance"]["fallback"] = True


def _symlink_out(rel: str, target_name: str = "secret.json"):
    def mutate(run: Path, tmp: Path) -> None:
        outside = tmp / target_name
        outside.write_text('{"schema": "rlk.readback.v1"}')
        (run / rel).symlink_to(outside)

    return mutate


def _symlink_dir_out(run: Path, tmp: Path) -> None:
    shutil.move(str(run / "train-data"), str(tmp / "elsewhere"))
    (run / "train-data").symlink_to(tmp / "elsewhere", target_is_directory=True)


def _sparse(rel: str, size: int):
    def mutate(run: Path, tmp: Path) -> None:
        with open(run / rel, "wb") as fh:
            fh.truncate(size)

    return mutate


def _fifo(run: Path, tmp: Path) -> None:
    os.mkfifo(run / "readbacks" / "vllm-rollout-77.json")


def _chmod000(rel: str):
    def mutate(run: Path, tmp: Path) -> None:
        os.chmod(run / rel, 0)

    return mutate


def _dup_readback(run: Path, tmp: Path) -> None:
    shutil.copy(_rb(run), run / "readbacks" / "local-training-1000-copy.json")


def _extra_round(run: Path, tmp: Path) -> None:
    t = load_round(train_data_path(run, 0))
    write_round(train_data_path(run, 3), t, 3, 0)


def _legacy_pt(run: Path, tmp: Path) -> None:
    shutil.rmtree(run / "train-data")
    (run / "train-data").mkdir()
    for r in range(3):
        (run / "train-data" / f"round-{r:04d}.rank0.pt").write_bytes(b"PK\x03\x04 legacy")


def _bitwise_liar(doc):
    doc["element_count"] += 7


def _metrics_line(run: Path, tmp: Path) -> None:
    p = run / "metrics.jsonl"
    lines = p.read_text().splitlines(keepends=True)
    p.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])


def _metrics_lie(run: Path, tmp: Path) -> None:
    p = run / "metrics.jsonl"
    rows = [json.loads(line) for line in p.read_text().splitlines()]
    rows[1]["compared_tokens"] += 1
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _metrics_drop(run: Path, tmp: Path) -> None:
    p = run / "metrics.jsonl"
    p.write_text("".join(p.read_text().splitlines(keepends=True)[:-1]))


def _complete_on_failure(run: Path, tmp: Path) -> None:
    (run / "exit-code").write_text("1\n")
    (run / "COMPLETE").write_text("")


def _plan_mismatch(doc):
    doc["plan"]["ffn"] = "P/R"


def _module_and_ops(module: str, **fields):
    """Set ``fields`` on a module record and on each of its ops, keeping the record self-consistent."""

    def fn(doc):
        rec = doc["modules"][module]
        rec.update(fields)
        for op in rec["ops"].values():
            op.update({k: v for k, v in fields.items() if k in op})

    return fn


def run_case(case: Case, tmp_path: Path, cli) -> None:
    """Build a valid run, break it, validate it: the expected verdict and finding, calmly (no traceback,
    no exit 4), quickly, and with the input tree unchanged."""
    run = build_run(tmp_path / "run", case.plan, **case.build)
    case.mutate(run, tmp_path)
    before = tree_state(run)
    t0 = time.monotonic()
    res = cli(run, *case.args)
    took = time.monotonic() - t0
    after = tree_state(run)
    assert before == after, "the validator changed the input tree"
    assert res.code != 4 and "internal error" not in res.err, res.err
    assert "Traceback" not in res.out + res.err
    assert took < CASE_SECONDS, f"took {took:.1f} s"
    assert res.doc is not None, res.err
    assert res.doc["verdict"] == case.verdict, res.out
    assert res.code == EXIT[case.verdict]
    hits = res.findings(case.code)
    assert hits, f"expected {case.code}; got {res.codes}\n{res.out}"
    assert any(case.needle in f["message"] for f in hits), [f["message"] for f in hits]
    assert case.code in res.out  # the human summary names the problem too
    assert res.doc["schema"] == "rlk.run-validation.v1"


# -- helpers of the hostile suite ------------------------------------------------------------------
def _raw(rel: str, fn):
    """Rewrite a file's text through ``fn(text) -> text`` (for JSON no parser would write)."""

    def mutate(run: Path, tmp: Path) -> None:
        p = run / rel
        p.write_text(fn(p.read_text()))

    return mutate


def _metrics(fn):
    """Apply ``fn(rows)`` to the parsed metrics.jsonl rows, then write them back."""

    def mutate(run: Path, tmp: Path) -> None:
        p = run / "metrics.jsonl"
        rows = [json.loads(line) for line in p.read_text().splitlines()]
        fn(rows)
        p.write_text("".join(json.dumps(r) + "\n" for r in rows))

    return mutate


def _bitwise(fn):
    return _set(lambda r: r / "bitwise-validation.json", fn)


def _manifest(fn):
    return _set(lambda r: r / "manifest.json", fn)


def _all_tensors(fn):
    """Apply ``fn(t)`` to every round file of rank 0."""

    def mutate(run: Path, tmp: Path) -> None:
        for rnd in range(3):
            _tensors(rnd, fn)(run, tmp)

    return mutate


def _seal(run: Path) -> None:
    from rlk_validate import seal_run

    rep = seal_run(run)
    assert rep.seal["status"] == "sealed", rep.summary()


def _sealed_then(fn):
    """Seal the (valid) run with rlk-validate, then apply ``fn(run)``."""

    def mutate(run: Path, tmp: Path) -> None:
        _seal(run)
        fn(run)

    return mutate


def _forged_seal(report: dict) -> Callable[[Path, Path], None]:
    """A hand-made run-validation.json and a COMPLETE carrying its correct hash."""

    def mutate(run: Path, tmp: Path) -> None:
        data = (json.dumps(report) + "\n").encode()
        (run / "run-validation.json").write_bytes(data)
        (run / "COMPLETE").write_text(json.dumps({
            "schema": "rlk.complete.v1", "run_validation_sha256": hashlib.sha256(data).hexdigest(),
            "sealed_at": "2026-11-29T12:00:00Z", "validator": {"name": "rlk-validate", "version": "0.1.0"}}))

    return mutate


def _deep(depth: int, leaf: object = 1) -> object:
    obj = leaf
    for _ in range(depth):
        obj = {"x": obj}
    return obj


def _extra_ops(module: str, **op_fields):
    """Add a second op to ``module`` (keeping the module's call_count the sum of its ops)."""

    def fn(doc):
        rec = doc["modules"][module]
        main = next(iter(rec["ops"].values()))
        op = {**main, **op_fields}
        rec["ops"][f"{module}.extra"] = op
        rec["call_count"] += op["call_count"]

    return fn
