"""Builders of run directories, written exactly as docs/evidence.md says producers write them.

``build_run`` writes what the local engine / the VIME adapters write: manifest.json, run.log,
exit-code, readbacks/ (atomic temp + os.replace), train-data/ (safetensors with metadata),
metrics.jsonl and bitwise-validation.json computed from the train-data the way a producer does
(float32 arithmetic). Helpers mutate such a directory for the broken-input corpus and hash a tree
to prove the validator changed nothing.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from rlk_validate.evidence import (
    BITWISE_SCHEMA,
    MANIFEST_SCHEMA,
    METRICS_SCHEMA,
    MODULES,
    READBACK_SCHEMA,
    TRAIN_DATA_SCHEMA,
    write_json_atomic,
)

RR = {m: "R/R" for m in MODULES}
PP = {m: "P/P" for m in MODULES}
SHA = "0123456789abcdef0123456789abcdef01234567"
H64 = "sha256:" + "ab" * 32


def write_json(path: Path, obj: Any) -> None:
    """Atomic write, as producers do: through rlk_validate.evidence.write_json_atomic."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, obj)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def mutate_json(path: Path, fn) -> None:
    obj = read_json(path)
    fn(obj)  # mutates in place
    write_json(path, obj)


def module_record(module: str, letter: str, calls: int = 96) -> dict[str, Any]:
    if letter == "R":
        backend, contract, impl = "rlk.reference", f"rlk.{module}.v1", "rlk"
    else:
        backend, contract, impl = f"production.torch.{module}", None, "production"
    op = {
        "backend_id": backend,
        "contract_id": contract,
        "call_count": calls,
        "execution_mode": "eager",
        "fallback": False,
        "fallback_reason": None,
        "provenance": {"device": "cpu", "dtype": "float32"},
    }
    return {
        "case": letter,
        "implementation": impl,
        "backend_id": backend,
        "contract_id": contract,
        "call_count": calls,
        "execution_mode": "eager",
        "fallback": False,
        "fallback_reason": None,
        "ops": {f"{module}.main": op},
    }


def readback(
    framework: str,
    target: str,
    pid: int,
    plan: dict[str, str],
    run_id: str | None,
    rank: int = 0,
    world_size: int = 1,
) -> dict[str, Any]:
    side = "train" if target == "training" else "rollout"
    idx = 0 if side == "train" else 2
    return {
        "schema": READBACK_SCHEMA,
        "framework": framework,
        "target": target,
        "side": side,
        "pid": pid,
        "rank": rank,
        "world_size": world_size,
        "hostname": "node0",
        "run_id": run_id,
        "mode": "strict",
        "created_at": "2026-11-29T12:00:00Z",
        "updated_at": "2026-11-29T12:01:00Z",
        "plan": dict(plan),
        "hooks": [{"name": "rlk.rms_norm", "target": "vllm.RMSNorm", "kind": "custom_op", "installed": True}],
        "modules": {m: module_record(m, c[idx]) for m, c in plan.items()},
    }


def make_round(
    rng: np.random.Generator, samples: int, positions: int, drift: float, rewards: bool = True
) -> dict[str, np.ndarray]:
    token_ids = rng.integers(0, 32000, size=(samples, positions), dtype=np.int64)
    mask = np.zeros((samples, positions), dtype=bool)
    prompt = positions // 3
    for s in range(samples):
        end = int(rng.integers(prompt + 1, positions + 1))
        mask[s, prompt:end] = True
    rollout = (-rng.exponential(1.0, size=(samples, positions))).astype(np.float32)
    train = rollout.copy()
    if drift:
        noise = rng.normal(0.0, drift, size=train.shape).astype(np.float32)
        hit = rng.random(train.shape) < 0.5
        train = np.where(hit, np.minimum(train + noise, np.float32(0.0)), train).astype(np.float32)
    rollout[~mask] = 0.0
    train[~mask] = 0.0
    out = {
        "token_ids": token_ids,
        "response_mask": mask.astype(np.uint8),
        "rollout_logprobs": rollout,
        "train_logprobs": train,
    }
    if rewards:
        r = rng.integers(0, 3, size=samples).astype(np.float32) / np.float32(2)
        out["rewards"] = r
        out["advantages"] = (r - r.mean()).astype(np.float32)
    return out


def write_round(
    path: Path, tensors: dict[str, np.ndarray], rnd: int, rank: int, metadata: dict[str, str] | None = None
) -> None:
    meta = {"schema": TRAIN_DATA_SCHEMA, "round": str(rnd), "rank": str(rank)}
    if metadata is not None:
        meta = metadata
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=meta)


def train_data_path(run: Path, rnd: int, rank: int = 0) -> Path:
    return run / "train-data" / f"round-{rnd:04d}.rank{rank}.safetensors"


def stats_of(tensors_list: list[dict[str, np.ndarray]]) -> dict[str, Any]:
    """What a producer computes in float32: torch.ne / (a - b).abs().max() / .mean()."""
    n = mm = 0
    mx = 0.0
    diffs = []
    for t in tensors_list:
        m = t["response_mask"].astype(bool)
        a, b = t["train_logprobs"][m], t["rollout_logprobs"][m]
        n += int(m.sum())
        mm += int((a != b).sum())
        d = np.abs(a - b)
        diffs.append(d)
        mx = max(mx, float(d.max()) if d.size else 0.0)
    allv = np.concatenate(diffs) if diffs else np.zeros(0, np.float32)
    return {
        "element_count": n,
        "mismatch_count": mm,
        "max_abs_diff": mx,
        "mean_abs_diff": float(allv.mean()) if allv.size else 0.0,
    }


def reward_mean(tensors_list: list[dict[str, np.ndarray]]) -> float:
    """What a producer writes as reward_mean: the mean of the round's rewards (0.5 when it records none)."""
    rs = [float(x) for t in tensors_list if "rewards" in t for x in t["rewards"]]
    return sum(rs) / len(rs) if rs else 0.5


def build_run(
    path: Path,
    plan: dict[str, str] | None = None,
    *,
    rounds: int = 3,
    ranks: int = 1,
    samples: int = 4,
    positions: int = 12,
    engine: str = "local",
    mode: str | None = None,
    drift: float | None = None,
    seed: int = 0,
    run_id: str | None = None,
    rewards: bool = True,
) -> Path:
    """A complete, valid run directory; drift defaults to 0 for all-R/R plans and 1e-3 otherwise."""
    plan = dict(plan or RR)
    all_rr = all(v == "R/R" for v in plan.values())
    if drift is None:
        drift = 0.0 if all_rr else 1e-3
    if mode is None:
        mode = "consistency" if all_rr else ("native" if plan == PP else "matrix")
    run_id = run_id or f"20261129T120000Z-{path.name}"
    path.mkdir(parents=True)
    write_json(
        path / "manifest.json",
        {
            "schema": MANIFEST_SCHEMA,
            "run_id": run_id,
            "created_at": "2026-11-29T12:00:00Z",
            "engine": engine,
            "mode": mode,
            "command": ["rlk-repro", "run", "--mode", mode],
            "plan": plan,
            "rounds": rounds,
            "ranks": ranks,
            "repos": [{"name": "rlk", "path": "/src/rlk", "sha": SHA, "dirty": False}],
            "packages": {"torch": "2.13.0+cpu", "rlk-core": "0.1.0"},
            "hardware": {"device": "cpu", "name": "test", "driver": None},
            "inputs": {"prompts": H64, "checkpoint": H64},
            "seeds": {"train": 1234, "rollout": 42},
            "config": {},
        },
    )
    rb = path / "readbacks"
    if engine == "local":
        write_json(rb / "local-training-1000.json", readback("local", "training", 1000, plan, run_id))
        write_json(rb / "local-rollout-1000.json", readback("local", "rollout", 1000, plan, run_id))
    else:
        for r in range(ranks):
            pid = 2000 + r
            write_json(
                rb / f"megatron-training-{pid}.json",
                readback("megatron", "training", pid, plan, run_id, rank=r, world_size=ranks),
            )
        write_json(rb / "vllm-rollout-3000.json", readback("vllm", "rollout", 3000, plan, run_id))
    rng = np.random.default_rng(seed)
    metrics, per_round, everything = [], [], []
    for rnd in range(rounds):
        this = []
        for rank in range(ranks):
            t = make_round(rng, samples, positions, drift, rewards)
            write_round(train_data_path(path, rnd, rank), t, rnd, rank)
            this.append(t)
        everything += this
        s = stats_of(this)
        per_round.append({"round": rnd, **{k: s[k] for k in ("element_count", "mismatch_count", "max_abs_diff")}})
        metrics.append(
            {
                "schema": METRICS_SCHEMA,
                "round": rnd,
                "compared_tokens": s["element_count"],
                "mismatch_count": s["mismatch_count"],
                "max_abs_diff": s["max_abs_diff"],
                "mean_abs_diff": s["mean_abs_diff"],
                "reward_mean": reward_mean(this),
                "loss": 0.1,
                "rollout_tokens_per_s": 100.0,
                "train_tokens_per_s": 200.0,
                "peak_memory_bytes": 1 << 20,
                "weights_changed": True,
            }
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    tot = stats_of(everything)
    write_json(
        path / "bitwise-validation.json",
        {
            "schema": BITWISE_SCHEMA,
            "require_exact": all_rr,
            "torch_equal": tot["mismatch_count"] == 0,
            "element_count": tot["element_count"],
            "mismatch_count": tot["mismatch_count"],
            "max_abs_diff": tot["max_abs_diff"],
            "rounds": per_round,
            "fallback_failures": 0,
        },
    )
    (path / "run.log").write_text("".join(f"[round {r}] rollout ok, train ok\n" for r in range(rounds)) + "done\n")
    (path / "exit-code").write_text("0\n")
    return path


def matrix_cell_plan(name: str) -> dict[str, str]:
    if name == "control-RR":
        return dict(RR)
    if name == "native-PP":
        return dict(PP)
    module, xy = name.split("-")
    plan = dict(RR)
    plan[module] = f"{xy[0]}/{xy[1]}"
    return plan


MATRIX_CELLS = ("control-RR", *(f"{m}-{xy}" for m in MODULES for xy in ("PR", "RP", "PP")))


def build_matrix(root: Path, cells=MATRIX_CELLS, rounds: int = 2) -> Path:
    root.mkdir(parents=True)
    for i, name in enumerate(cells):
        build_run(root / name, matrix_cell_plan(name), rounds=rounds, seed=i)
    return root


def load_round(path: Path) -> dict[str, np.ndarray]:
    return load_file(str(path))


def tree_state(root: Path) -> dict[str, Any]:
    """Everything that identifies a tree byte for byte (content, type, mode, mtime, link targets)."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in sorted(dirnames + filenames):
            p = os.path.join(dirpath, name)
            rel = os.path.relpath(p, root)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                h = hashlib.sha256()
                if st.st_mode & 0o444 and os.access(p, os.R_OK):
                    with open(p, "rb") as fh:
                        for chunk in iter(lambda fh=fh: fh.read(1 << 22), b""):
                            h.update(chunk)
                out[rel] = ("file", st.st_mode, st.st_size, st.st_mtime_ns, h.hexdigest())
            else:
                out[rel] = ("other", st.st_mode, st.st_mtime_ns if stat.S_ISDIR(st.st_mode) else 0)
    return out


def run_subprocess(*args: str, check_torch: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter; with check_torch, fail (exit 97) if torch got imported."""
    code = (
        "import sys\n"
        "from rlk_validate.cli import main\n"
        f"rc = main({[str(a) for a in args]!r})\n"
        + ("if 'torch' in sys.modules: print('TORCH IMPORTED', file=sys.stderr); sys.exit(97)\n" if check_torch else "")
        + "sys.exit(rc)\n"
    )
    env = dict(os.environ)
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
