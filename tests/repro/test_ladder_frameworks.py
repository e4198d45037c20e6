"""``rlk-repro ladder --engine frameworks`` on the CPU (issue 38): ``--dry-run`` prints each rung's ``rlk-repro run
--engine frameworks`` command; the FP8 rungs run there when the GPU has FP8 tensor cores (``--rollout-quantization
fp8``, rollout side P) and are skipped with the reason otherwise; an FP8 rung with an R rollout side, and FP8 on the
local engine, exit 2. The runs themselves need the GPU: the sitting's ``ladder`` stage."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from rlk_repro import cli

SMALL = ["--rounds", "1", "--prompts-per-round", "2", "--samples-per-prompt", "2", "--max-new-tokens", "8"]


def _gpu(monkeypatch, capability: tuple[int, int] | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    if capability is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H200" if capability >= (9, 0)
                            else "NVIDIA A100")


def _dry(capsys, tmp_path, *args: str) -> dict[str, dict]:
    out = tmp_path / "out"
    assert cli.main(["ladder", "--engine", "frameworks", "--dry-run", "--model", "qwen3-0.6b", "--output", str(out),
                     *SMALL, *args]) == cli.EXIT_OK
    assert not out.exists()
    return {g["name"]: g for g in json.loads(capsys.readouterr().out)["rungs"]}


def _flags(command: str) -> dict[str, str]:
    words = shlex.split(command)
    assert words[:4] == ["rlk-repro", "run", "--engine", "frameworks"], words
    return {w: words[i + 1] for i, w in enumerate(words) if w.startswith("--") and i + 1 < len(words)}


def test_fp8_rungs_run_on_an_fp8_gpu_with_their_knobs(monkeypatch, capsys, tmp_path):
    _gpu(monkeypatch, (9, 0))
    rungs = _dry(capsys, tmp_path)
    assert all(g["action"] == "run" for g in rungs.values()), {n: g["skip_reason"] for n, g in rungs.items()}
    for name, g in rungs.items():
        f = _flags(g["command"])
        assert f["--run-name"] == name
        assert f["--rollout-quantization"] == ("fp8" if "fp8" in name else "none"), name
        case = "R/R" if name.startswith("rr-") else "P/P"
        assert (f["--attention-case"], f["--ffn-case"], f["--logp-case"]) == (case, case, case), name
        assert (f["--top-p"], f["--top-k"]) == {"2-top-p": ("0.9", "0"), "3-top-k": ("1.0", "20"),
                                                "4-fp8-filters": ("0.9", "20"), "rr-2-top-p": ("0.9", "0"),
                                                "rr-3-top-k": ("1.0", "20")}.get(name, ("1.0", "0")), name
        assert f["--model"] == "qwen3-0.6b" and f["--rounds"] == "1"
    assert rungs["1-fp8"]["require_exact"] is False and rungs["rr-0-aligned"]["require_exact"] is True
    assert cli.build_parser().parse_args(shlex.split(rungs["1-fp8"]["command"])[1:]).rollout_quantization == "fp8"


@pytest.mark.parametrize("capability, why", [(None, "no CUDA GPU"), ((8, 0), "no FP8 tensor cores")])
def test_fp8_rungs_are_skipped_with_the_reason_without_fp8_hardware(monkeypatch, capsys, tmp_path, capability, why):
    _gpu(monkeypatch, capability)
    rungs = _dry(capsys, tmp_path)
    for name in ("1-fp8", "4-fp8-filters"):
        assert rungs[name]["action"] == "skip" and why in rungs[name]["skip_reason"], rungs[name]
        assert rungs[name]["command"] is None
    assert rungs["0-aligned"]["action"] == "run" and "--rollout-quantization none" in rungs["0-aligned"]["command"]


def test_local_ladder_still_skips_fp8_naming_the_frameworks_engine(capsys, tmp_path):
    out = tmp_path / "o"
    assert cli.main(["ladder", "--dry-run", "--output", str(out), *SMALL]) == cli.EXIT_OK
    rungs = {g["name"]: g for g in json.loads(capsys.readouterr().out)["rungs"]}
    assert rungs["1-fp8"]["action"] == "skip" and "--engine frameworks" in rungs["1-fp8"]["skip_reason"]
    assert "command" not in rungs["0-aligned"]


@pytest.mark.parametrize("args, message", [
    (["--engine", "frameworks", "--rung", "fp8-rr:quantization=fp8,case=R/R"], "X/P"),
    (["--engine", "frameworks", "--rung", "fp8-logp:quantization=fp8,logp=P/R"], "logp"),
    (["--engine", "frameworks", "--rollout-quantization", "fp8"], "per rung"),
])
def test_fp8_misuse_exits_2(monkeypatch, capsys, tmp_path, args, message):
    _gpu(monkeypatch, (9, 0))
    assert cli.main(["ladder", "--dry-run", "--output", str(tmp_path / "o"), *SMALL, *args]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_run_refuses_fp8_with_an_r_rollout_and_on_the_local_engine(monkeypatch, capsys, tmp_path):
    _gpu(monkeypatch, (9, 0))
    assert cli.main(["plan", "--engine", "frameworks", "--mode", "consistency", "--rollout-quantization", "fp8"]) \
        == cli.EXIT_USAGE
    assert "X/P" in capsys.readouterr().err
    assert cli.main(["run", "--rollout-quantization", "fp8", "--output", str(tmp_path / "o")]) == cli.EXIT_USAGE
    assert "--engine frameworks" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
