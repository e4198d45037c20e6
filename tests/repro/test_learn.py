"""The synthetic learning run's CPU side (issue 37, "a model that learns"): the synthetic math generator (deterministic,
disjoint splits, its gold answers graded right by the deepscaler rule and perturbed ones wrong), the tokenizer and
random checkpoint, the supervised warm start on the tiny shape (it must lower the held-out loss and teach the answer
format within seconds), and its checkpoint through ``--model-path`` in the local engine (R/R exact, labelled
synthetic). The GPU run is ``benchmarks/frameworks/learn_gpu.py`` (sitting stages learn, learn-a, learn-b)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
import torch

from rlk_core.plan import RoutePlan
from rlk_repro import cli, synthmath
from rlk_repro.deepscaler import reward
from rlk_repro.engine.local import run_local
from rlk_repro.model.tokenizer import HFTokenizer
from rlk_repro.model.weights import load_checkpoint, weights_sha256
from rlk_repro.workspace import checks

pytest.importorskip("tokenizers", reason="the synthetic model's tokenizer is trained with tokenizers")
EOS = "<|im_end|>"
COUNTS = {"sft": 400, "rl": 60, "heldout": 60}


def test_generator_is_deterministic_with_disjoint_splits():
    a, b = synthmath.generate(COUNTS, 7), synthmath.generate(COUNTS, 7)
    assert json.dumps(a) == json.dumps(b)
    assert json.dumps(synthmath.generate(COUNTS, 8)) != json.dumps(a)
    questions = {s: {r["prompt"][0]["content"] for r in rows} for s, rows in a.items()}
    assert {s: len(q) for s, q in questions.items()} == COUNTS  # no repeat inside a split
    assert not (questions["sft"] & questions["rl"] or questions["sft"] & questions["heldout"]
                or questions["rl"] & questions["heldout"])
    assert {r["metadata"]["family"] for r in a["sft"]} == set(synthmath.FAMILIES)
    row = a["sft"][0]
    assert set(row) == {"prompt", "label", "metadata"} and row["prompt"][0]["role"] == "user"
    assert row["metadata"]["data_source"] == synthmath.DATA_SOURCE and synthmath.INSTRUCTION in \
        row["prompt"][0]["content"]


def _perturbed(label: str) -> str:
    """Another answer: an integer plus one, a fraction's numerator plus one."""
    if "\\frac" not in label:
        return str(int(label) + 1)
    sign = "-" if label.startswith("-") else ""
    num, den = label.removeprefix("-").removeprefix("\\frac{").removesuffix("}").split("}{")
    return f"{sign}\\frac{{{int(num) + 1}}}{{{den}}}"


def test_deepscaler_grades_gold_right_and_perturbed_wrong():
    rows = synthmath.generate({"heldout": 300}, 11)["heldout"]
    fractions = [r for r in rows if "\\frac" in r["label"]]
    assert len(fractions) > 10 and any(r["label"].startswith("-") for r in rows)
    for r in rows:
        assert reward(r["metadata"]["solution"] + EOS, r["label"]) == 1, r
        assert reward(r["metadata"]["solution"].replace("</think>", "") + EOS, r["label"]) == 0  # no solution part
    for r in rows[:40] + fractions[:20]:  # the sympy grader runs on wrong answers: a sample of them
        wrong = r["metadata"]["solution"].rsplit("\\boxed{", 1)[0] + f"\\boxed{{{_perturbed(r['label'])}}}"
        assert reward(wrong + EOS, r["label"]) == 0, (wrong, r["label"])
    q = Fraction(-6, 8)
    assert synthmath.latex(q) == "-\\frac{3}{4}" and reward("</think>\\boxed{-\\frac{6}{8}}", "-\\frac{3}{4}") == 0


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A tiny synthetic workspace and its warm start (one thread: the check must not depend on a free core)."""
    w = tmp_path_factory.mktemp("learn") / "W"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli.main(["synthetic-math", "--workspace", str(w), "--shape", "synth-tiny", "--sft-rows", "2000",
                         "--rl-rows", "40", "--heldout-rows", "32", "--vocab-size", "512", "--seed", "5"]) == 0
        init = load_checkpoint(w / "models" / "synth-tiny-init")[1]
        assert cli.main(["warmstart", "--workspace", str(w), "--device", "cpu", "--steps", "150", "--batch-size",
                         "16", "--lr", "3e-3", "--warmup", "10", "--eval-rows", "32", "--eval-max-new-tokens", "44",
                         "--log-every", "50"]) == 0
    finally:
        torch.set_num_threads(threads)
    return w, init


def test_synthetic_workspace_is_recorded_and_doctor_passes(learned):
    w, _ = learned
    doc = json.loads((w / "workspace.json").read_text())
    assert doc["data"]["output"] == "data/synthetic-math.rl.vime.jsonl" and doc["data"]["purpose"] == "synthetic"
    assert doc["model"]["path"] == "models/synth-tiny-warm" and doc["model"]["kind"] == "warm start"
    man = json.loads((w / "data" / "synthetic-math.heldout.vime.manifest.json").read_text())
    assert man["source"]["kind"] == "synthetic" and man["output"]["rows"] == 32 and "never backs" in \
        man["purpose_reason"]
    found = checks(w)
    assert not [c for c in found if c.status == "FAIL"], found
    assert any("generated by rlk.synthetic-math.v1" in c.detail for c in found)
    tok = HFTokenizer(w / "models" / "synth-tiny-warm")
    assert [tok.decode([i]) for i in tok.encode("x = 407")][-3:] == ["4", "0", "7"]  # digits one by one


def test_warm_start_lowers_heldout_loss_and_teaches_the_format(learned):
    w, init = learned
    rec = json.loads((w / "models" / "synth-tiny-warm" / "warmstart.json").read_text())
    before, after = rec["before"], rec["after"]
    assert after["heldout_loss"] < 0.4 * before["heldout_loss"], (before, after)
    assert before["readable"] < 0.2 and after["readable"] >= 0.6, (before, after)  # </think> then \boxed{...}
    assert after["accuracy"] >= before["accuracy"]
    assert [c["step"] for c in rec["curve"]] == [50, 100, 150]
    warm = load_checkpoint(w / "models" / "synth-tiny-warm")[1]
    assert weights_sha256(warm) != weights_sha256(init)
    ck = json.loads((w / "models" / "synth-tiny-warm" / "rlk-checkpoint.json").read_text())
    assert ck["weights_sha256"] == weights_sha256(warm) and ck["kind"] == "warm start"


def test_warm_checkpoint_runs_through_model_path(learned, small_config, tmp_path):
    w, _ = learned
    model = w / "models" / "synth-tiny-warm"
    cfg = small_config(RoutePlan("R/R", "R/R", "R/R"), rounds=1, model_path=str(model),
                       prompt_data=str(w / "data" / "synthetic-math.rl.vime.jsonl"), apply_chat_template=True,
                       max_new_tokens=12, top_p=1.0)
    res = run_local(cfg, tmp_path)
    assert res.exit_code == 0 and res.bitwise["mismatch_count"] == 0 and res.bitwise["element_count"] > 0
    man = json.loads((res.run_dir / "manifest.json").read_text())
    assert man["model"]["kind"] == "checkpoint" and man["reward"]["rm_type"] == "deepscaler"
    assert man["data"]["purpose"] == "synthetic" and man["claims"]["experiment"] is False
    assert any("synthetic" in r for r in man["claims"]["reasons"])


def test_synthetic_math_keeps_out_of_a_prepared_workspace(dapo_parquet, tmp_path, capsys):
    from rlk_repro.prepare import prepare

    w = tmp_path / "W"
    prepare(w, source=dapo_parquet, download_data=False, model_path=None, convert=False)
    assert cli.main(["synthetic-math", "--workspace", str(w), "--shape", "synth-tiny", "--sft-rows", "10"]) == 2
    assert "workspace of its own" in capsys.readouterr().err
    assert json.loads((w / "workspace.json").read_text())["data"]["output"] == "data/dapo-math-17k.vime.jsonl"
    assert cli.main(["warmstart", "--workspace", str(w)]) == 2
    assert "no synthetic splits recorded" in capsys.readouterr().err


def test_gpu_driver_summaries_read_the_pair(learned, small_config, tmp_path):
    """benchmarks/frameworks/learn_gpu.py's summaries and checks over a tiny local pair on the warm checkpoint (the
    GPU runs are frameworks runs with the same files)."""
    import importlib.util
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "frameworks" / "learn_gpu.py"
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location("learn_gpu", path)
        driver = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(driver)
    finally:
        sys.path.remove(str(path.parent))
    w, _ = learned
    runs = {}
    for mode, case in (("native", "P/P"), ("consistency", "R/R")):
        cfg = small_config(RoutePlan(case, case, case), rounds=2, model_path=str(w / "models" / "synth-tiny-warm"),
                           prompt_data=str(w / "data" / "synthetic-math.rl.vime.jsonl"), apply_chat_template=True,
                           max_new_tokens=12, top_p=1.0)
        runs[mode] = driver._summary(run_local(cfg, tmp_path, run_name=f"seed1234-{mode}").run_dir)
    assert runs["consistency"]["mismatches"] == 0 < runs["consistency"]["compared_tokens"]
    assert runs["native"]["mismatches"] > 0 and len(runs["native"]["reward"]) == 2
    res = {"runs": {m: {**r, "validation": {"rc": 0}} for m, r in runs.items()}, "stages": {}}
    checks = driver._checks(SimpleNamespace(rounds=2), tmp_path, res)
    assert checks == {"rr_rounds_ge_100": False, "rr_zero_mismatches_whole_exposure": True,
                      "rr_rlk_validate_require_bitwise": True, "pp_rounds_ge_100": False, "pp_differs": True}
    warm = driver._warm(w)
    assert warm["after"]["heldout_loss"] < warm["before"]["heldout_loss"] and warm["rows"] == 32
