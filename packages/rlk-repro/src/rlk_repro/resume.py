"""``rlk-repro run --resume RUN_DIR``: a new attempt that continues an interrupted run from its last round state.

A run saves its *round state* every ``--state-every`` rounds (local engine: default 1; ``--engine frameworks``:
default 0, opt-in, TP 1): after round ``r``'s weight update, ``round-state/state.pt`` holds what the next round
starts from — the trainer's fp32 master weights and the optimizer's state, with the local rollout engine's KV-block
free list, or, for the frameworks engine, the Megatron trainer's masters (Megatron names), AdamW state and every
RNG stream of the process (torch CPU / CUDA, Megatron's CUDA RNG tracker, Python, NumPy; vLLM samples with
per-request seeds derived from the run seed and the round, so nothing of vLLM carries over) — written atomically, then
``round-state/state.json`` (``rlk.round-state.v1``: ``next_round``, the file's sha256 and size) names it. The state
is replaced as the run goes (one per run).

``--resume RUN_DIR`` never writes into ``RUN_DIR`` (append-only): it creates a new attempt directory beside it,
with the parent's recorded options (a conflicting flag exits 2 naming it), that

- inherits the parent's rounds ``0 .. k-1`` (``k = next_round``): their train-data files copied byte for byte
  and their ``metrics.jsonl`` lines verbatim, so the attempt holds every round and validates on its own;
- starts round ``k`` from the state, and runs to the end;
- records the link in its manifest's ``resume`` block: the parent's run id and directory name, ``from_round``,
  the state file's sha256, and the sha256 of every inherited file and of the inherited metrics lines.

``rlk-validate`` checks that chain (:mod:`rlk_validate.chain`): the parent is there, is the run named, has the
same plan, seeds, inputs and configuration, still holds that very state, and the inherited rounds are its own;
the bitwise claim is then over all rounds of the attempt. A continuation is bit-identical to the uninterrupted
run (tests/repro/test_resume.py checks both an R/R and a P/P run).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from rlk_core.errors import RlkConfigError
from rlk_core.plan import RoutePlan
from rlk_repro.runs import file_sha256
from rlk_validate import evidence

STATE_DIR = "round-state"
STATE_FILE = "state.pt"
STATE_DOC = "state.json"
STATE_SCHEMA = "rlk.round-state.v1"


#: the engines whose runs save round state (a manifest's ``engine``)
ENGINES = ("local", "frameworks")


def save_state(run_dir: Path, next_round: int, master: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer,
               kv_free: list[int]) -> None:
    """Write the local engine's state that round ``next_round`` starts from."""
    write_state(run_dir, next_round, {"master": {k: v.detach().cpu() for k, v in master.items()},
                                      "optimizer": optimizer.state_dict(), "kv_free": list(kv_free)})


def write_state(run_dir: Path, next_round: int, contents: dict[str, Any]) -> None:
    """Write the state that round ``next_round`` starts from: ``{"next_round": next_round, **contents}`` (file first,
    atomically, then the document naming it)."""
    if "next_round" in contents:
        raise ValueError("write_state: the round is its next_round argument, not a key of contents")
    folder = run_dir / STATE_DIR
    folder.mkdir(exist_ok=True)
    tmp = folder / f".{STATE_FILE}.tmp"
    torch.save({"next_round": next_round, **contents}, tmp)
    os.replace(tmp, folder / STATE_FILE)
    doc = {"schema": STATE_SCHEMA, "next_round": next_round, "file": STATE_FILE,
           "sha256": file_sha256(folder / STATE_FILE), "bytes": (folder / STATE_FILE).stat().st_size}
    evidence.write_json_atomic(folder / STATE_DOC, doc)


@dataclass
class Parent:
    """An interrupted run, read for resuming: its manifest, the state it saved, its inherited rounds."""

    path: Path
    manifest: dict[str, Any]
    next_round: int
    state_sha256: str
    train_files: list[str]  # train-data file names of rounds < next_round
    metrics_lines: list[str]  # metrics.jsonl lines of rounds < next_round, verbatim

    def load_state(self) -> dict[str, Any]:
        """The state file, checked against the hash the parent recorded (it must not have changed)."""
        path = self.path / STATE_DIR / STATE_FILE
        if file_sha256(path) != self.state_sha256:
            raise RlkConfigError(f"{path} changed after {STATE_DOC} recorded it; not resuming from it")
        return torch.load(path, map_location="cpu", weights_only=True)

    def peek_state(self) -> dict[str, Any]:
        """The state file memory-mapped (only what is looked at is read; not checked against its hash: that is
        :meth:`load_state`'s), to check what it is before anything is created; one line if it is not readable."""
        path = self.path / STATE_DIR / STATE_FILE
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            why = (str(exc).splitlines() or [""])[0]
            raise RlkConfigError(f"--resume {self.path}: {STATE_DIR}/{STATE_FILE} is not readable "
                                 f"({type(exc).__name__}: {why})") from None

    def rows(self) -> list[dict[str, Any]]:
        """The inherited rounds as the engine's summary rows (metrics line + the comparison's names)."""
        out = []
        for line in self.metrics_lines:
            m = json.loads(line)
            out.append({"round": m["round"], "element_count": m["compared_tokens"],
                        "informative_count": m["informative_tokens"], **{k: v for k, v in m.items() if k != "schema"}})
        return out


def read_parent(run_dir: str | os.PathLike[str]) -> Parent:
    """``RUN_DIR`` as a resumable run, or one line (:class:`RlkConfigError`) saying why it is not."""
    path = Path(run_dir)
    if not path.is_dir():
        raise RlkConfigError(f"--resume {path}: not a directory")
    try:
        manifest = json.loads((path / evidence.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RlkConfigError(f"--resume {path}: no readable manifest.json ({exc}); not a run directory") from None
    if manifest.get("engine") not in ENGINES:
        raise RlkConfigError(f"--resume {path}: a {manifest.get('engine')!r} run; --resume continues runs of the "
                             f"{' and '.join(ENGINES)} engines")
    try:
        doc = json.loads((path / STATE_DIR / STATE_DOC).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        how = " (the frameworks engine's default)" if manifest.get("engine") == "frameworks" else ""
        raise RlkConfigError(f"--resume {path}: it saved no round state ({STATE_DIR}/{STATE_DOC}): it stopped before "
                             f"its first state was due, or ran with --state-every 0{how}") from None
    if doc.get("schema") != STATE_SCHEMA or not isinstance(doc.get("next_round"), int):
        raise RlkConfigError(f"--resume {path}: {STATE_DIR}/{STATE_DOC} is not {STATE_SCHEMA}")
    k, rounds = doc["next_round"], int(manifest.get("rounds", 0))
    if k >= rounds:
        raise RlkConfigError(f"--resume {path}: its state is after the last of its {rounds} rounds; nothing to resume")
    names = {evidence.train_data_name(r, 0) for r in range(k)}
    present = set(os.listdir(path / evidence.TRAIN_DATA_DIR)) if (path / evidence.TRAIN_DATA_DIR).is_dir() else set()
    if names - present:
        raise RlkConfigError(f"--resume {path}: train-data lacks {sorted(names - present)[0]} of a round its state "
                             "follows")
    lines, done = [], set()
    if (path / evidence.METRICS).is_file():
        for line in (path / evidence.METRICS).read_text(encoding="utf-8").splitlines():
            rnd = json.loads(line).get("round", -1) if line.strip() else -1
            done.add(rnd)
            if 0 <= rnd < k:
                lines.append(line)
    if done >= set(range(rounds)):
        raise RlkConfigError(f"--resume {path}: it finished all its {rounds} rounds; nothing to resume")
    if [json.loads(x)["round"] for x in lines] != list(range(k)):
        raise RlkConfigError(f"--resume {path}: metrics.jsonl does not hold rounds 0..{k - 1} once each, in order")
    return Parent(path, manifest, k, str(doc.get("sha256")), sorted(names), lines)


def recorded_config(parent: Parent, config_cls: type) -> dict[str, Any]:
    """The parent's options as keyword arguments of ``config_cls`` (its manifest's ``config``, plan, modes)."""
    m = parent.manifest
    cfg = m.get("config") or {}
    names = {f.name for f in fields(config_cls)}
    kw = {k: v for k, v in cfg.items() if k in names and k not in ("plan", "plan_sources", "command")}
    kw["plan"] = RoutePlan(**m["plan"])
    kw["plan_sources"] = dict(m.get("plan_sources") or {})
    rb = m.get("readback_mode") or {}
    kw["readback_mode"], kw["readback_mode_source"] = rb.get("mode", "strict"), rb.get("source", "default")
    return kw


def inherit(child: Path, parent: Parent) -> dict[str, Any]:
    """Copy the parent's rounds ``< next_round`` into the new attempt; the manifest's ``resume`` block."""
    inherited = {}
    for name in parent.train_files:
        src, dst = parent.path / evidence.TRAIN_DATA_DIR / name, child / evidence.TRAIN_DATA_DIR / name
        shutil.copyfile(src, dst)
        digest = file_sha256(dst)
        if digest != file_sha256(src):
            raise RlkConfigError(f"{src} changed while it was copied")
        inherited[f"{evidence.TRAIN_DATA_DIR}/{name}"] = digest
    text = "".join(line + "\n" for line in parent.metrics_lines)
    with open(child / evidence.METRICS, "a", encoding="utf-8") as fh:
        fh.write(text)
    return {"parent": {"run_id": parent.manifest.get("run_id"), "dir": parent.path.name},
            "from_round": parent.next_round,
            "state": {"file": f"{STATE_DIR}/{STATE_FILE}", "sha256": parent.state_sha256},
            "inherited": inherited,
            "inherited_metrics_sha256": "sha256:" + hashlib.sha256(text.encode()).hexdigest()}
