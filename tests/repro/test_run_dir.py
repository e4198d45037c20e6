"""The run directory holds everything docs/evidence.md lists, in its formats; rlk-validate accepts it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def test_layout_and_manifest(rr_run):
    d = rr_run.run_dir
    assert d.name == rr_run.run_id
    for name in ("manifest.json", "run.log", "exit-code", "metrics.jsonl", "bitwise-validation.json"):
        assert (d / name).is_file(), name
    for name in ("readbacks", "train-data", "report"):
        assert (d / name).is_dir(), name
    assert not (d / "COMPLETE").exists()  # only rlk-validate --seal writes it
    assert (d / "exit-code").read_text() == "0\n"
    assert "Traceback" not in (d / "run.log").read_text()
    m = _load(d / "manifest.json")
    assert m["schema"] == "rlk.manifest.v1" and m["engine"] == "local" and m["mode"] == "consistency"
    assert m["run_id"] == rr_run.run_id
    assert m["plan"] == {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}
    assert m["rounds"] == len(rr_run.rounds) and m["ranks"] == 1
    assert isinstance(m["command"], list) and all(isinstance(c, str) for c in m["command"])
    repo = m["repos"][0]
    assert repo["name"] == "rlk" and isinstance(repo["dirty"], bool)
    for key in ("torch", "rlk-core", "rlk-repro"):
        assert isinstance(m["packages"][key], str)
    assert m["hardware"]["device"] == "cpu"
    assert set(m["inputs"]) == {"prompts", "checkpoint"}
    assert all(v.startswith("sha256:") and len(v) == 71 for v in m["inputs"].values())
    assert m["seeds"] == {"train": 7, "rollout": 7}
    assert m["config"]["env"] == {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R",
                                  "RL_KERNEL_LOGP_CASE": "R/R"}


def test_readbacks_of_both_sides(rr_run):
    files = sorted((rr_run.run_dir / "readbacks").glob("*.json"))
    names = {f.name for f in files}
    assert names == {f"local-training-{os.getpid()}.json", f"local-rollout-{os.getpid()}.json"}
    sides = set()
    for f in files:
        doc = _load(f)
        assert doc["schema"] == "rlk.readback.v1" and doc["framework"] == "local"
        assert doc["run_id"] == rr_run.run_id and doc["mode"] == "strict"
        assert doc["plan"] == {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}
        sides.add(doc["side"])
        for module in ("attention", "ffn", "logp"):
            rec = doc["modules"][module]
            assert rec["case"] == "R" and rec["implementation"] == "rlk"
            assert rec["backend_id"].startswith("rlk.") and rec["contract_id"]
            assert rec["call_count"] > 0 and rec["fallback"] is False
        ops = set(doc["modules"]["attention"]["ops"])
        if doc["side"] == "train":
            assert "attention_varlen" in ops and "linear_logprobs" in doc["modules"]["logp"]["ops"]
        else:
            assert {"attention_decode", "attention_paged_prefill", "kv_cache_write"} <= ops
            assert "token_logprobs" in doc["modules"]["logp"]["ops"]
    assert sides == {"train", "rollout"}


def test_train_data_metrics_and_bitwise_file_agree(rr_run):
    d = rr_run.run_dir
    files = sorted((d / "train-data").iterdir())
    assert [f.name for f in files] == [f"round-{r:04d}.rank0.safetensors" for r in range(len(rr_run.rounds))]
    metrics = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
    bitwise = _load(d / "bitwise-validation.json")
    assert bitwise["schema"] == "rlk.bitwise-validation.v1" and bitwise["require_exact"] is True
    assert bitwise["fallback_failures"] == 0
    total = 0
    for r, (f, row) in enumerate(zip(files, metrics, strict=True)):
        with safe_open(str(f), framework="pt") as fh:
            meta = fh.metadata()
            t = {k: fh.get_tensor(k) for k in fh.keys()}
        assert meta == {"schema": "rlk.train-data.v1", "round": str(r), "rank": "0"}
        assert t["token_ids"].dtype == torch.int64 and t["response_mask"].dtype == torch.bool
        assert t["rollout_logprobs"].dtype == t["train_logprobs"].dtype == torch.float32
        per_token = {k: v.shape for k, v in t.items() if k not in ("rewards", "advantages")}
        assert len(set(per_token.values())) == 1 and len(per_token) == 4
        s = t["token_ids"].shape[0]
        assert t["rewards"].shape == t["advantages"].shape == (s,)
        assert t["rewards"].dtype == t["advantages"].dtype == torch.float32
        assert row["reward_mean"] == pytest.approx(float(t["rewards"].double().mean()), rel=1e-6)
        m = t["response_mask"]
        a, b = t["rollout_logprobs"][m], t["train_logprobs"][m]
        assert (a <= 0).all() and torch.isfinite(a).all()
        assert (t["rollout_logprobs"][~m] == 0).all() and (t["train_logprobs"][~m] == 0).all()
        mism = int((a.view(torch.int32) != b.view(torch.int32)).sum())
        assert row["schema"] == "rlk.metrics.v1" and row["round"] == r
        assert row["compared_tokens"] == int(m.sum()) == bitwise["rounds"][r]["element_count"]
        assert row["mismatch_count"] == mism == bitwise["rounds"][r]["mismatch_count"]
        for key in ("reward_mean", "loss", "rollout_tokens_per_s", "train_tokens_per_s", "peak_memory_bytes",
                    "max_abs_diff", "mean_abs_diff", "weights_changed"):
            assert key in row
        total += int(m.sum())
    assert bitwise["element_count"] == total and bitwise["torch_equal"] is True


def _validator() -> list[str] | None:
    exe = shutil.which("rlk-validate") or shutil.which("rlk-validate", path=str(Path(sys.executable).parent))
    if exe:
        return [exe]
    src = ROOT / "packages" / "rlk-validate" / "src"
    if (src / "rlk_validate" / "__main__.py").is_file():
        return [sys.executable, "-m", "rlk_validate"]
    return None


def test_rlk_validate_accepts_the_run(rr_run, tmp_path):
    cmd = _validator()
    if cmd is None:
        pytest.skip("rlk-validate is neither installed nor present in packages/rlk-validate")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "packages" / "rlk-validate" / "src"))
    out = tmp_path / "validation.json"
    proc = subprocess.run([*cmd, str(rr_run.run_dir), "--require-bitwise", "--json", str(out)], capture_output=True,
                          text=True, env=env, timeout=120)
    report = json.loads(out.read_text())
    errors = [f for f in report["findings"] if f["severity"] in ("error", "incomplete")]
    repo = _load(rr_run.run_dir / "manifest.json")["repos"][0]
    if repo["sha"] is None:  # a checkout without a commit cannot name its revision: the only allowed error
        errors = [f for f in errors if not (f["code"].startswith("MANIFEST_FIELD") and "repos" in f["message"])]
        assert not errors, proc.stdout
    else:
        assert proc.returncode == 0 and not errors, proc.stdout + proc.stderr


def test_repo_state_of_a_git_archive_reads_the_commit_git_wrote(tmp_path):
    """Source that is not a git checkout (a `git archive` shipped to a GPU machine) records the commit that
    `git archive` substituted into rlk_repro/REVISION (export-subst), clean; the unsubstituted placeholder
    (a copy made another way) leaves the revision unknown, as before."""
    import subprocess

    from rlk_repro import runs

    root = ROOT
    sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if sha.returncode != 0:
        pytest.skip("not run from a git checkout")
    rel = "packages/rlk-repro/src/rlk_repro/REVISION"
    tar = subprocess.run(["git", "-C", str(root), "archive", "HEAD", rel], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=tar, check=True)
    extracted = tmp_path / rel
    assert runs.archive_revision(extracted) == sha.stdout.strip()
    assert runs.archive_revision(runs.REVISION_FILE) is None  # the checkout's own file: the placeholder

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    state = runs.repo_state(outside)
    assert state["sha"] is None and state["dirty"] is None and "not a git checkout" in state["error"]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runs, "REVISION_FILE", extracted)
        state = runs.repo_state(outside)
    assert state["sha"] == sha.stdout.strip() and state["dirty"] is False and state["source"] == "git archive"


def test_run_mean_abs_diff_is_over_the_finite_pairs_of_every_round():
    """A round with a token outside one side's kept set (log-prob -inf) leaves that pair out of its mean; the run's
    mean weights each round by its finite pairs, as rlk-validate recomputes it (the H200 pp-processed run's
    bitwise-validation.json said 0.015050 where the validator found 0.015003: weighted by all pairs)."""
    import torch

    from rlk_repro import runs

    r0 = runs.compare(torch.tensor([-1.0, -2.0, -3.0, -4.0]), torch.tensor([-1.5, float("-inf"), float("-inf"), -4.0]))
    r1 = runs.compare(torch.tensor([-1.0, -1.0]), torch.tensor([-1.25, -1.0]))
    assert r0["nonfinite_diff_count"] == 2 and r0["mean_abs_diff"] == 0.25
    doc = runs.bitwise_document([{"round": 0, **r0}, {"round": 1, **r1}], require_exact=False, fallback_failures=0)
    assert doc["mean_abs_diff"] == (0.5 + 0.0 + 0.25 + 0.0) / 4
