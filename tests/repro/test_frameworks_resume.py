"""``rlk-repro run --resume RUN_DIR`` for ``--engine frameworks`` on the CPU (issue 41): the Megatron trainer's round
state (real megatron-core on gloo, bf16 with fp32 masters, as on the GPU) written through rlk_repro.resume and loaded
into a fresh trainer continues bit for bit — log-probs, bf16 weights, masters and AdamW moments of the next step equal
the uninterrupted trainer's; a fresh optimizer or the checkpoint's weights (the negative controls) do not — and the
CLI's refusals and recorded-options handling for a frameworks parent. The GPU continuation itself (real vLLM +
Megatron, resumed = uninterrupted, train-data and final weights): tests/frameworks/test_resume_frameworks.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlk_core.errors import RlkConfigError
from rlk_repro import cli
from rlk_repro.engine import frameworks
from rlk_repro.resume import STATE_DIR, read_parent, write_state
from rlk_repro.runs import file_sha256

ROUTE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "RL_KERNEL_MODE",
              "RL_KERNEL_READBACK_DIR", "RL_KERNEL_RUN_ID", "VLLM_PLUGINS", "WORLD_SIZE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in ROUTE_VARS:
        monkeypatch.delenv(k, raising=False)


MEGATRON_STATE = r'''
import os, sys, torch
sys.path.insert(0, os.environ['TEST_MEGATRON_DIR'])
from _cpu import gloo_world_of_one
gloo_world_of_one()
from pathlib import Path
from rlk_core.errors import RlkConfigError
from rlk_repro.engine.frameworks_megatron import MegatronTrainer, init_model_parallel, rng_state, set_rng_state
from rlk_repro.engine.trainer import Sample
from rlk_repro.model.config import PRESETS
from rlk_repro.model.weights import random_weights
from rlk_repro.resume import STATE_DIR, STATE_FILE, write_state
cpu = torch.device("cpu")
cfg = PRESETS["tiny"]; w = random_weights(cfg, 3)
init_model_parallel(1, 0)
dt = getattr(torch, os.environ["DTYPE"])
def build():
    return MegatronTrainer(cfg, w, tp=1, rank=0, device=cpu, dtype=dt, temperature=0.7, optimizer="adamw",
                           lr=1e-3, micro_tokens=40)
def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(0, 256, (5 + i,), generator=g).tolist(),
                   torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist(), [], float(i % 3 - 1)) for i in range(6)]
def snap(tr):
    opt = tr.optim.opt.state_dict()["state"]
    return ({n: p.detach().clone() for n, p in tr.params.items()},
            {n: m.detach().clone() for n, m in tr.master.items()},
            {i: {k: v.clone() for k, v in s.items()} for i, s in opt.items()})
def same(x, y):
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return (x.dtype == y.dtype and x.shape == y.shape
            and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
a = build()
a.step(batch(0))
a.step(batch(1))
run = Path(os.getcwd())
import random
import numpy as np
write_state(run, 2, {"engine": "frameworks", "tp": 1, **a.round_state(), "rng": rng_state(cpu)})
from megatron.core.tensor_parallel import get_cuda_rng_tracker
saved_rng, saved_py, saved_np = torch.get_rng_state(), random.getstate(), np.random.get_state()
saved_tracker = {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}
assert saved_tracker, "Megatron's RNG tracker holds no state"
with get_cuda_rng_tracker().fork():
    torch.rand(7)
assert any(not torch.equal(v, saved_tracker[k]) for k, v in get_cuda_rng_tracker().get_states().items())
torch.rand(5); random.random(); np.random.rand(3)  # the live generators move on; the state keeps them as they were
ra = a.step(batch(2)); after = snap(a)
state = torch.load(run / STATE_DIR / STATE_FILE, map_location="cpu", weights_only=True)
assert state["next_round"] == 2 and state["engine"] == "frameworks"
b = build()
b.load_round_state(state)
set_rng_state(state["rng"], cpu)
assert torch.equal(torch.get_rng_state(), saved_rng) and random.getstate() == saved_py
now = get_cuda_rng_tracker().get_states()
assert now.keys() == saved_tracker.keys() and all(torch.equal(now[k], saved_tracker[k]) for k in now)
got_np = np.random.get_state()
assert got_np[0] == saved_np[0] and (got_np[1] == saved_np[1]).all() and got_np[2:] == saved_np[2:]
rb = b.step(batch(2))
assert same(dict(enumerate(ra.train_logprobs)), dict(enumerate(rb.train_logprobs))), "log-probs"
assert same(after[0], snap(b)[0]) and same(after[1], snap(b)[1]) and same(after[2], snap(b)[2]), "weights / optimizer"
# negative controls: the same step from the masters with a fresh optimizer, and from the checkpoint, differ
c = build()
c.load_round_state({"master": state["master"], "optimizer": build().optim.opt.state_dict()})
rc = c.step(batch(2))
assert same(dict(enumerate(rc.train_logprobs)), dict(enumerate(rb.train_logprobs)))  # same weights before the step
assert not same(after[1], snap(c)[1]), "a fresh optimizer gave the same update"
d = build(); rd = d.step(batch(2))
assert not same(dict(enumerate(ra.train_logprobs)), dict(enumerate(rd.train_logprobs))), "the checkpoint's log-probs"
# another model's state exits 2 naming it
bad = dict(state["master"]); name = sorted(bad)[0]; bad[name] = bad[name][:1]
for broken, words in (({**state, "master": bad}, name), ({**state, "master": {}}, "missing")):
    try:
        build().load_round_state(broken)
    except RlkConfigError as exc:
        assert words in str(exc), exc
    else:
        raise AssertionError("a foreign state was loaded")
print("ok")
'''


@pytest.mark.megatron
@pytest.mark.slow
def test_megatron_round_state_continues_bit_for_bit(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ROUTE_VARS}
    env.update({"PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": "", "DTYPE": "bfloat16", "RL_KERNEL_MODE": "strict",
                "RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
                "TEST_MEGATRON_DIR": str(Path(__file__).resolve().parent.parent / "megatron")})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(MEGATRON_STATE)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]


# -- the CLI with a frameworks parent (a run directory as the engine leaves it after round 0, without the GPU) ------
def _plan_config(capsys, *args: str) -> dict:
    assert cli.main(["plan", *args]) == 0
    return json.loads(capsys.readouterr().out)


def _parent(root: Path, capsys, engine: str = "frameworks", state: dict | None = None, rounds: int = 3) -> Path:
    """An interrupted run's directory: manifest (the configuration `plan` resolves), round 0's train-data and metrics
    line, the round state for round 1 (``state``: its contents; None: no state saved)."""
    doc = _plan_config(capsys, *(["--engine", engine] if engine != "local" else []), "--rounds", str(rounds),
                       "--lr", "1e-4", "--state-every", "1" if state is not None else "0")
    run = root / "20261204T000000Z-000001"
    (run / "train-data").mkdir(parents=True)
    manifest = {"schema": "rlk.run-manifest.v1", "run_id": run.name, "engine": engine, "mode": doc["mode"],
                "plan": doc["plan"], "plan_sources": {m: "config" for m in doc["plan"]},
                "readback_mode": doc["readback_mode"], "rounds": rounds, "ranks": 1,
                "inputs": {"prompts": "sha256:" + "0" * 64, "checkpoint": "sha256:" + "1" * 64},
                "seeds": {"train": 1234, "rollout": 1234}, "config": doc["config"]}
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "train-data" / "round-0000.rank0.safetensors").write_bytes(b"")
    (run / "metrics.jsonl").write_text(json.dumps({"round": 0, "compared_tokens": 8, "informative_tokens": 8}) + "\n")
    if state is not None:
        write_state(run, 1, state)
    return run


FRAMEWORKS_STATE = {"engine": "frameworks", "tp": 1, "master": {}, "optimizer": {}, "rng": {}}


def _no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_resuming_a_frameworks_run_without_a_gpu_exits_2_and_creates_nothing(tmp_path, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    parent = _parent(tmp_path, capsys, state=FRAMEWORKS_STATE)
    files = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for extra in ([], ["--engine", "frameworks"]):
        assert cli.main(["run", "--resume", str(parent), *extra]) == cli.EXIT_USAGE
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--engine frameworks needs a CUDA GPU" in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == files  # nothing created or written


def test_resume_takes_a_frameworks_runs_recorded_options(tmp_path, monkeypatch, capsys):
    _no_gpu(monkeypatch)
    parent = _parent(tmp_path, capsys, state=FRAMEWORKS_STATE)
    a = cli.build_parser().parse_args(["run", "--resume", str(parent)])
    got, cfg = cli._resumed(a, ["run", "--resume", str(parent)])
    assert isinstance(cfg, frameworks.FrameworksRunConfig) and got.next_round == 1
    assert (cfg.rounds, cfg.tp, cfg.state_every, cfg.device, cfg.dtype, cfg.lr) == (3, 1, 1, "cuda", "bfloat16", 1e-4)
    for args, words in ((["--rounds", "9"], "--rounds 9 differs from the recorded 3"),
                        (["--tp", "2"], "--tp 2 differs from the recorded 1"),
                        (["--enforce-eager"], "--enforce-eager True differs from the recorded False"),
                        (["--mode", "native"], "--mode gives plan"),
                        (["--static-weights"], "--static-weights True differs")):
        assert cli.main(["run", "--resume", str(parent), *args]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert words in err and err.count("\n") == 1, err
    local = _parent(tmp_path / "local", capsys, engine="local", state={"master": {}, "optimizer": {}, "kv_free": []})
    assert cli.main(["run", "--resume", str(local), "--engine", "frameworks"]) == cli.EXIT_USAGE
    assert "--engine frameworks: the run is a local-engine run" in capsys.readouterr().err


def test_a_frameworks_run_without_round_state_says_so(tmp_path, capsys):
    parent = _parent(tmp_path, capsys, state=None)
    assert cli.main(["run", "--resume", str(parent)]) == cli.EXIT_USAGE
    assert "saved no round state" in (err := capsys.readouterr().err) and "frameworks engine's default" in err


def test_the_state_must_be_a_tp1_frameworks_state(tmp_path, monkeypatch, capsys):
    """A state of another engine, TP or round, or an unreadable one, is refused before anything is created (exit 2
    naming it; the machine's requirements taken as met); the run itself checks it again, with its hash."""
    monkeypatch.setattr(frameworks, "requirements", lambda tp: None)
    for i, contents in enumerate(({"master": {}, "optimizer": {}, "kv_free": []},  # a local engine's
                                  {**FRAMEWORKS_STATE, "tp": 2}, {**FRAMEWORKS_STATE, "next_round": 2},
                                  {k: v for k, v in FRAMEWORKS_STATE.items() if k != "rng"})):
        parent = _parent(tmp_path / str(i), capsys, state={k: v for k, v in contents.items() if k != "next_round"})
        if "next_round" in contents:  # a state file for another round than its (consistent) document names
            state = parent / STATE_DIR / "state.pt"
            torch.save(contents, state)
            doc = json.loads((parent / STATE_DIR / "state.json").read_text())
            doc.update(sha256=file_sha256(state), bytes=state.stat().st_size)
            (parent / STATE_DIR / "state.json").write_text(json.dumps(doc))
        before = sorted(tmp_path.rglob("*"))
        assert cli.main(["run", "--resume", str(parent)]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert "is not a TP-1 frameworks state for round 1" in err and err.count("\n") == 1, err
        assert sorted(tmp_path.rglob("*")) == before
        run = frameworks._Run(None, "x", tmp_path, 0, 1, torch.device("cpu"), tmp_path, None, read_parent(parent))
        with pytest.raises(RlkConfigError, match="not a TP-1 frameworks state for round 1"):
            run._resume_state()
    parent = _parent(tmp_path / "torn", capsys, state=FRAMEWORKS_STATE)
    (parent / STATE_DIR / "state.pt").write_bytes(b"torn")
    assert cli.main(["run", "--resume", str(parent)]) == cli.EXIT_USAGE
    assert "state.pt is not readable" in capsys.readouterr().err
    parent = _parent(tmp_path / "ok", capsys, state=FRAMEWORKS_STATE)
    state = frameworks._Run(None, "x", tmp_path, 0, 1, torch.device("cpu"), tmp_path, None,
                            read_parent(parent))._resume_state()
    assert state["engine"] == "frameworks" and state["next_round"] == 1
    (parent / STATE_DIR / "state.pt").write_bytes(b"changed")  # the state must be the one its document names
    with pytest.raises(RlkConfigError, match="changed after"):
        frameworks._Run(None, "x", tmp_path, 0, 1, torch.device("cpu"), tmp_path, None,
                        read_parent(parent))._resume_state()


@pytest.mark.parametrize("argv, message", [
    (["run", "--engine", "frameworks", "--tp", "2", "--state-every", "1"], "saves round state at --tp 1, not --tp 2"),
    (["run", "--engine", "frameworks", "--state-every", "-1"], "state-every must be >= 0"),
])
def test_state_every_arguments_exit_2_before_anything(tmp_path, monkeypatch, capsys, argv, message):
    _no_gpu(monkeypatch)
    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == cli.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
