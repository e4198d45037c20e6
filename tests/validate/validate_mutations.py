"""Mutations that break a valid run directory, for the broken-input corpus of test_corpus.py."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from validate_builders import load_round, mutate_json, train_data_path, write_round

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
