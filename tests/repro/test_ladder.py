"""``rlk-repro ladder`` on the local engine: the default rungs run (FP8 ones skipped with their reason, never run),
the R/R rungs are bitwise equal while their P/P rungs are not, the report and figures are written, ``--resume``
runs only unfinished rungs, ``--rung`` adds one, ``--dry-run`` creates nothing, and a perturbed R/R rung fails."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlk_repro import cli
from rlk_repro.engine.trainer import Trainer

SMALL = ["--rounds", "1", "--prompts-per-round", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4",
         "--chunk-size", "8"]
RAN = {"0-aligned", "2-top-p", "3-top-k", "rr-0-aligned", "rr-2-top-p", "rr-3-top-k"}
SKIPPED = {"1-fp8", "4-fp8-filters"}


def _ladder(*args: str) -> tuple[int, Path, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = cli.main(["ladder", *args])
    text = out.getvalue()
    return code, Path(text.strip().splitlines()[-1].split(": ", 1)[1]), text


@pytest.fixture(scope="module")
def ladder(tmp_path_factory):
    return _ladder("--output", str(tmp_path_factory.mktemp("ladder")), *SMALL)


def _logprobs(run: Path) -> tuple[torch.Tensor, torch.Tensor]:
    rollout, train = [], []
    for f in sorted((run / "train-data").glob("*.safetensors")):
        t = load_file(str(f))
        rollout.append(t["rollout_logprobs"][t["response_mask"]])
        train.append(t["train_logprobs"][t["response_mask"]])
    return torch.cat(rollout), torch.cat(train)


def test_the_default_ladder_runs_skips_fp8_and_validates(ladder):
    code, root, out = ladder
    assert code == cli.EXIT_OK, out
    assert {p.name for p in root.iterdir() if p.is_dir() and p.name != "report"} == RAN
    for name in SKIPPED:
        skip = json.loads((root / f"{name}.skipped.json").read_text())
        assert skip["needs"] == ["fp8"] and "local engine has none" in skip["reason"]
    report = json.loads((root / "ladder-report.json").read_text())
    assert report["verdict"] == "passed"
    rungs = {g["name"]: g for g in report["rungs"]}
    assert {n for n, g in rungs.items() if g["status"] == "skipped"} == SKIPPED
    assert rungs["1-fp8"]["classification"]["class"] == "not run"


def test_rr_rungs_are_bitwise_equal_and_pp_rungs_are_not(ladder):
    _, root, _ = ladder
    for rr, pp in (("rr-0-aligned", "0-aligned"), ("rr-2-top-p", "2-top-p"), ("rr-3-top-k", "3-top-k")):
        rollout, train = _logprobs(root / rr)
        assert rollout.numel() > 0 and torch.equal(rollout, train), rr
        rollout, train = _logprobs(root / pp)  # the negative control: production kernels on CPU differ
        assert rollout.numel() > 0 and not torch.equal(rollout, train), pp
    rungs = {g["name"]: g for g in json.loads((root / "ladder-report.json").read_text())["rungs"]}
    assert rungs["rr-2-top-p"]["metrics"]["mismatch_count"] == 0
    assert rungs["rr-2-top-p"]["classification"]["class"] == "none"
    assert rungs["2-top-p"]["metrics"]["mismatch_count"] > 0
    assert rungs["2-top-p"]["classification"]["class"] == "expected numerical"
    assert rungs["2-top-p"]["metrics"]["sampling"]["top_p"] == 0.9 and rungs["3-top-k"]["knobs"]["top_k"] == 20
    d = rungs["2-top-p"]["delta"]
    m, ref = rungs["2-top-p"]["metrics"]["dlogp"], rungs["0-aligned"]["metrics"]["dlogp"]
    assert d["abs_mean"] == pytest.approx(m["abs_mean"] - ref["abs_mean"], abs=0, rel=1e-12)


def test_the_metrics_are_those_of_the_train_data(ladder):
    _, root, _ = ladder
    g = next(g for g in json.loads((root / "ladder-report.json").read_text())["rungs"] if g["name"] == "0-aligned")
    rollout, train = _logprobs(root / "0-aligned")
    d = train.double() - rollout.double()
    m = g["metrics"]
    assert m["tokens"] == d.numel() and m["mismatch_count"] == int((train != rollout).sum())
    assert m["dlogp"]["abs_mean"] == pytest.approx(float(d.abs().mean()), rel=1e-12)
    assert m["dlogp"]["mean"] == pytest.approx(float(d.mean()), rel=1e-9, abs=1e-15)
    assert m["dlogp"]["abs_max"] == float(d.abs().max())
    worst = m["worst_tokens"][0]
    assert abs(worst["diff"]) == m["dlogp"]["abs_max"] and worst["response_index"] >= 0
    assert worst["context_length"] == worst["prompt_length"] + worst["response_index"]
    assert m["batch_layout"]["config"]["chunk_size"] == 8 and m["batch_layout"]["scheduler"]["rollout_steps"] > 0
    assert m["backends"]["rollout"]["logp"]["backend_ids"] == ["production.torch"]
    assert m["backends"]["rollout"]["logp"]["fallbacks"] == []


def test_readbacks_in_a_host_folder_are_read(ladder, tmp_path):
    """The frameworks engine files its readbacks under ``readbacks/<hostname>/`` (the layout of a run on several
    nodes): the rung's backends must be read from there too (the H200 ladder's report said 'no readbacks' for
    every rung before the fix)."""
    import shutil

    from rlk_validate.ladder_metrics import _readback_backends
    from rlk_validate.safeio import Root

    _, root, _ = ladder
    flat = _readback_backends(Root(str(root / "rr-0-aligned")))
    assert flat["rollout"]["logp"]["backend_ids"] and flat["train"]["logp"]["backend_ids"]
    run = tmp_path / "rr-0-aligned"
    shutil.copytree(root / "rr-0-aligned", run)
    (run / "readbacks" / "node-a").mkdir()
    for p in list((run / "readbacks").glob("*.json")):
        p.rename(run / "readbacks" / "node-a" / p.name)
    assert not list((run / "readbacks").glob("*.json"))
    assert _readback_backends(Root(str(run))) == flat


def test_figures_one_per_metric(ladder):
    pytest.importorskip("matplotlib")
    _, root, _ = ladder
    names = {p.name for p in (root / "report").glob("ladder-*.png")}
    assert {"ladder-abs-mean.png", "ladder-k3-kl.png", "ladder-clip-fraction.png", "ladder-abs-p99.png"} <= names


def test_resume_runs_only_unfinished_rungs(ladder, capsys):
    _, root, _ = ladder
    (root / "3-top-k" / "exit-code").unlink()
    before = (root / "rr-0-aligned" / "manifest.json").stat().st_mtime_ns
    skip_before = (root / "1-fp8.skipped.json").read_bytes()
    assert cli.main(["ladder", "--resume", str(root)]) == cli.EXIT_OK
    err = capsys.readouterr().err
    assert "3-top-k          was interrupted" in err and "rr-0-aligned     finished earlier" in err
    assert (root / "rr-0-aligned" / "manifest.json").stat().st_mtime_ns == before
    assert (root / "3-top-k" / "exit-code").read_text() == "0\n"
    assert len(list(root.glob("3-top-k.interrupted-*"))) == 1
    assert (root / "1-fp8.skipped.json").read_bytes() == skip_before
    assert cli.main(["ladder", "--resume", str(root), "--rounds", "2"]) == cli.EXIT_USAGE
    assert "the ladder ran 1" in capsys.readouterr().err


def test_dry_run_lists_rungs_and_skips_and_creates_nothing(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["ladder", "--dry-run", "--output", str(out), "--rung", "mine:case=R/R,top_p=0.8,top_k=5",
                     *SMALL]) == cli.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    rungs = {g["name"]: g for g in doc["rungs"]}
    assert rungs["1-fp8"]["action"] == "skip" and "FP8" in rungs["1-fp8"]["skip_reason"]
    assert rungs["rr-0-aligned"]["action"] == "run" and rungs["rr-0-aligned"]["require_exact"] is True
    assert rungs["mine"]["knobs"]["top_p"] == 0.8 and rungs["mine"]["plan"]["ffn"] == "R/R"
    assert rungs["mine"]["vs"] == "rr-3-top-k"
    assert not out.exists()


def test_a_user_rung_runs_with_its_knobs(tmp_path):
    code, root, out = _ladder("--output", str(tmp_path), "--rungs", "rr-0-aligned", "--rung",
                              "ffn-pr-topk:case=R/R,ffn=P/R,top_k=7,vs=rr-0-aligned", *SMALL)
    assert code == cli.EXIT_OK, out
    manifest = json.loads((root / "ffn-pr-topk" / "manifest.json").read_text())
    assert manifest["plan"] == {"attention": "R/R", "ffn": "P/R", "logp": "R/R"}
    assert manifest["sampling"]["top_k"] == 7
    g = json.loads((root / "ladder-report.json").read_text())["rungs"][1]
    assert g["vs"] == "rr-0-aligned" and g["delta"] is not None


@pytest.mark.parametrize("args", [["--rung", "bad"], ["--rung", "x:top_q=1"], ["--rung", "x:case=Q/Q"],
                                  ["--rungs", "nope"], ["--top-p", "0.9"], ["--rung", "x:vs=nowhere"],
                                  ["--filter-top-p", "1.5"]])
def test_bad_ladder_arguments_exit_2(args, tmp_path, capsys):
    assert cli.main(["ladder", "--output", str(tmp_path / "o"), *args, *SMALL]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.strip() and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_an_rr_rung_that_mismatches_fails_the_ladder(tmp_path, monkeypatch):
    real_step = Trainer.step

    def perturbed(self, samples):
        res = real_step(self, samples)
        res.train_logprobs = [torch.nextafter(t, torch.full_like(t, -1.0)) for t in res.train_logprobs]
        return res

    monkeypatch.setattr(Trainer, "step", perturbed)
    code, root, _ = _ladder("--output", str(tmp_path), "--rungs", "rr-0-aligned", *SMALL)
    assert code == cli.EXIT_MISMATCH
    report = json.loads((root / "ladder-report.json").read_text())
    assert report["verdict"] == "failed"
    assert report["rungs"][0]["classification"]["class"] == "candidate operator"


def test_attribute_after_the_ladder_names_rungs_boundaries_beside_the_root(ladder, capsys):
    """``ladder --attribute A,B``: ``rlk-repro attribute`` on each named rung, written beside the root (which
    rlk-validate ladder checks: nothing is added to it); the R/R rung names no boundary, the P/P one a boundary; a
    second call keeps them; a name that is not a rung exits 2."""
    _, root, _ = ladder
    before = sorted(p.name for p in root.iterdir())
    assert cli.main(["ladder", "--resume", str(root), "--attribute", "rr-0-aligned,0-aligned"]) == cli.EXIT_OK
    assert sorted(p.name for p in root.iterdir()) == before
    got = {n: json.loads((root.parent / f"{root.name}.attribution" / n / "attribution.json").read_text())
           for n in ("rr-0-aligned", "0-aligned")}
    assert got["rr-0-aligned"]["verdict"]["kind"] == "no_boundary"
    assert got["0-aligned"]["verdict"]["kind"] == "boundary"
    assert cli.main(["ladder", "--resume", str(root), "--attribute", "0-aligned"]) == cli.EXIT_OK
    assert "attributed earlier" in capsys.readouterr().err
    assert cli.main(["ladder", "--resume", str(root), "--attribute", "9-nope"]) == cli.EXIT_USAGE
    assert "'9-nope' is not a rung of this ladder" in capsys.readouterr().err
