"""Builders of VIME artifact directories, written the way a VIME run launched by `rlk-repro plan --engine
vime` leaves them (docs/vime.md): rlk-launch.json and environment.json from the launch script, run.log with
slime/VIME's per-step lines and exit-code from `ray job submit ... | tee`, readbacks/ from every process
(flat, or readbacks/<hostname>/ per node), logprob-records/ from the record hook on each training rank."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from validate_builders import RR, SHA, readback

from rlk_validate.evidence import VIME_ENVIRONMENT_SCHEMA, VIME_LAUNCH_SCHEMA, VIME_LOGPROBS_SCHEMA


def _write(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1) + "\n")


def build_vime_run(path: Path, plan: dict[str, str] | None = None, *, rounds: int = 2,
                   hosts: tuple[str, ...] = ("node0",), tp: int = 2, cp: int = 2, gpus_per_node: int = 4,
                   drift: float = 0.0, rollout_readbacks: bool = True,
                   rollout_plan: dict[str, str] | None = None, vime_diff: float | None = None, exit_code: int = 0,
                   steps_per_round: int = 2, same_pids: bool = True, seed: int = 0) -> Path:
    """A VIME artifact directory. Training: len(hosts) x gpus_per_node ranks at TP x CP; the TP-0 rank of
    each (DP, CP) pair writes records, two calls (one per training step) per round. Rollout: one vLLM engine
    of TP ranks per host. ``drift`` is added to the train log-probs of the first sample of every call;
    ``vime_diff`` is what VIME logs (default: 0 when drift is 0, else drift / 2)."""
    plan = dict(plan or RR)
    run_id = "20261201T000000Z-vime01"
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True)
    world = len(hosts) * gpus_per_node
    all_rr = all(c == "R/R" for c in plan.values())
    _write(path / "rlk-launch.json", {
        "schema": VIME_LAUNCH_SCHEMA, "engine": "vime", "run_id": run_id, "run_dir": str(path),
        "mode": "consistency" if all_rr else "matrix", "plan": plan, "exact_required": all_rr,
        "command": ["rlk-repro", "plan", "--engine", "vime"], "rounds": rounds, "steps_per_round": steps_per_round,
        "seeds": {"train": 1234, "rollout": 42},
        "topology": {"nodes": len(hosts), "gpus_per_node": gpus_per_node, "tensor_parallel": tp,
                     "context_parallel": cp, "rollout_tensor_parallel": tp, "colocate": True},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "unfiltered_logprobs": False},
        "env": {"RL_KERNEL_RUN_ID": run_id}, "submit": ["ray", "job", "submit", "--", "python3", "train.py"],
        "config": {}})
    _write(path / "environment.json", {
        "schema": VIME_ENVIRONMENT_SCHEMA,
        "repos": [{"name": "rlk", "sha": SHA, "dirty": False}, {"name": "vime", "sha": SHA, "dirty": False}],
        "packages": {"rlk-core": "0.1.0", "vllm": "0.22.0", "megatron-core": "0.16.0"},
        "hardware": {"device": "cuda", "name": "NVIDIA H200", "driver": "570.00", "count": world},
        "inputs": {"prompts": "sha256:" + "ab" * 32, "checkpoint": "sha256:" + "cd" * 32}})
    multi = len(hosts) > 1
    for h, host in enumerate(hosts):
        rb = path / "readbacks" / host if multi else path / "readbacks"
        for local in range(gpus_per_node):
            rank = h * gpus_per_node + local
            pid = 4000 + local if same_pids else 4000 + rank
            doc = readback("megatron", "training", pid, plan, run_id, rank=rank, world_size=world)
            doc["hostname"] = host
            _write(rb / f"megatron-training-{pid}.json", doc)
        if rollout_readbacks:
            for local in range(tp):
                pid = 7000 + local
                doc = readback("vllm", "rollout", pid, rollout_plan or plan, run_id, rank=local, world_size=tp)
                doc["hostname"] = host
                _write(rb / f"vllm-rollout-{pid}.json", doc)
    writers = [r for r in range(world) if r % tp == 0]
    for rnd in range(rounds):
        for rank in writers:
            host = hosts[rank // gpus_per_node]
            out = path / "logprob-records" / host if multi else path / "logprob-records"
            out.mkdir(parents=True, exist_ok=True)
            for call in range(steps_per_round):
                lengths = np.array([5, 3, 7], np.int64)
                n = int(lengths.sum())
                roll = -rng.random(n).astype(np.float32) * 3 - np.float32(0.01)
                train = roll.copy()
                train[: lengths[0]] -= np.float32(drift)
                mask = np.ones(n, np.uint8)
                mask[-1] = 0
                save_file({"train_logprobs": train, "rollout_logprobs": roll, "loss_mask": mask,
                           "response_lengths": lengths, "token_ids": rng.integers(0, 1000, n).astype(np.int64)},
                          str(out / f"rollout-{rnd:06d}.rank{rank}.call{call}.safetensors"),
                          metadata={"schema": VIME_LOGPROBS_SCHEMA, "rollout_id": str(rnd), "rank": str(rank),
                                    "call": str(call)})
    diff = vime_diff if vime_diff is not None else (0.0 if drift == 0 else drift / 2)
    lines = ["(RayTrainGroup pid=1234) INFO: initialised"]
    for step in range(rounds * steps_per_round):
        d = {"train/loss": 0.01, "train/train_rollout_logprob_abs_diff": diff, "train/step": step}
        lines.append(f"(MegatronTrainRayActor pid=4000) [2026-12-01 00:00:0{step % 10}] model.py:915 - "
                     f"step {step}: {d!r}")
    (path / "run.log").write_text("\n".join(lines) + "\n")
    (path / "exit-code").write_text(f"{exit_code}\n")
    return path
