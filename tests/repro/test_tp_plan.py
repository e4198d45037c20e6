"""`rlk-repro plan --engine frameworks` with a train TP other than the rollout TP (issues 35 and 39): every
multi-GPU command of docs/ops/linear_tp.md ("The multi-GPU runs") dry-run here — the printed plan has TP-invariant
mode on with its G, the variable exported, the layout checked against the model and the launch's process count —
and the strict-mode rule: train TP != rollout TP without RL_KERNEL_TP_INVARIANT refused, saying what to set."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from rlk_repro import cli
from rlk_repro.model.config import Qwen3Config

DOC = Path(__file__).resolve().parents[2] / "docs" / "ops" / "linear_tp.md"
# the Qwen3-8B shape (config.json of Qwen/Qwen3-8B, the fields rlk-repro reads)
QWEN3_8B = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=151645)


def doc_commands() -> list[list[str]]:
    """The commands of the doc's block between the markers, one per line (comments dropped)."""
    text = DOC.read_text(encoding="utf-8")
    block = re.search(r"<!-- issue-39-commands -->\n```bash\n(.*?)```", text, re.S)
    assert block, "docs/ops/linear_tp.md lost its block of issue 39's commands"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def plan_of(argv: list[str], capsys, monkeypatch, tmp_path) -> tuple[int, dict, list[str]]:
    """``torchrun --nproc-per-node N -m rlk_repro run ARGS`` -> ``rlk-repro plan ARGS`` (--output dropped): the
    exit code, the printed plan, and N."""
    assert argv[:2] == ["torchrun", "--nproc-per-node"] and argv[3:6] == ["-m", "rlk_repro", "run"], argv
    nproc, args = int(argv[2]), argv[6:]
    ckpt = tmp_path / "qwen3-8b"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text(json.dumps(QWEN3_8B.to_hf()), encoding="utf-8")
    args = [str(ckpt) if a == "$QWEN3_8B" else a for a in args]
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    monkeypatch.delenv("RL_KERNEL_MODE", raising=False)
    code = cli.main(["plan", *args])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == cli.EXIT_OK else {"stderr": out.err}), nproc


def _value(args: list[str], flag: str, default: int = 1) -> int:
    return int(args[args.index(flag) + 1]) if flag in args else default


def test_the_doc_lists_issue_39_s_layouts():
    layouts = {(_value(c, "--train-tp"), _value(c, "--context-parallel"), _value(c, "--rollout-tp"),
                "--sequence-parallel" in c, "--tp-invariant" in c) for c in doc_commands()}
    # x2: TP 2 (SP on) / rollout TP 1, TP 1 / rollout TP 2, the control without invariant mode; x4 / x8: the 8B shape
    assert {(2, 1, 1, True, True), (1, 1, 2, False, True), (2, 1, 1, False, False), (4, 1, 2, False, True),
            (4, 2, 2, False, True), (4, 2, 1, False, True)} <= layouts


@pytest.mark.parametrize("argv", doc_commands(), ids=lambda c: " ".join(c[2:3] + c[6:]))
def test_every_multi_gpu_command_plans(argv, capsys, monkeypatch, tmp_path):
    code, doc, nproc = plan_of(argv, capsys, monkeypatch, tmp_path)
    assert code == cli.EXIT_OK, doc
    par, args = doc["parallel"], argv[6:]
    assert par["train"]["tp"] == _value(args, "--train-tp") and par["rollout"]["tp"] == _value(args, "--rollout-tp")
    assert par["train"]["cp"] == _value(args, "--context-parallel")
    assert par["train"]["sequence_parallel"] is ("--sequence-parallel" in args)
    assert par["world"] == nproc  # the launch starts one process per GPU the layout takes
    assert par["engine_problem"]  # planned; the engine's run of it is issue 39's
    inv = par["tp_invariant"]
    if "--tp-invariant" in args:
        g = _value(args, "--tp-invariant")
        assert inv == {"on": True, "leaves_total": g, "contract": "rlk.gemm.tp.v1", "source": "flag --tp-invariant",
                       "leaves_per_rank": {"train": g // par["train"]["tp"], "rollout": g // par["rollout"]["tp"]}}
        assert doc["env"]["RL_KERNEL_TP_INVARIANT"] == str(g)
        assert doc["config"]["tp_invariant"] == g and par["layout_problem"] is None
    else:  # the negative control: planned in audit mode, the problem recorded
        assert "--audit" in args and doc["readback_mode"]["mode"] == "audit"
        assert not inv["on"] and "RL_KERNEL_TP_INVARIANT" not in doc["env"]
        assert "Set RL_KERNEL_TP_INVARIANT=8 on both sides" in par["layout_problem"]
    assert doc["env"]["RL_KERNEL_ATTENTION_CASE"] == "R/R"


def test_strict_mode_refuses_train_tp_other_than_rollout_tp_without_invariant_mode(capsys, monkeypatch, tmp_path):
    control = next(c for c in doc_commands() if "--tp-invariant" not in c)
    strict = [a for a in control if a != "--audit"]
    code, doc, _ = plan_of(strict, capsys, monkeypatch, tmp_path)
    assert code == cli.EXIT_USAGE
    assert "strict mode: train TP 2 != rollout TP 1" in doc["stderr"]
    assert "Set RL_KERNEL_TP_INVARIANT=8 on both sides" in doc["stderr"]
    monkeypatch.setenv("RL_KERNEL_TP_INVARIANT", "8")  # the variable does what the flag does
    assert cli.main(["plan", *strict[6:]]) == cli.EXIT_OK
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["tp_invariant"]["source"] == "RL_KERNEL_TP_INVARIANT"
    assert out["env"]["RL_KERNEL_TP_INVARIANT"] == "8"


@pytest.mark.parametrize("args,message", [
    (["--train-tp", "2", "--sequence-parallel"], "--sequence-parallel is covered in TP-invariant mode only"),
    (["--sequence-parallel", "--tp-invariant", "8"], "--sequence-parallel shards the tokens over the training TP"),
    (["--train-tp", "8", "--rollout-tp", "1", "--tp-invariant", "4"], "train TP 8 is not a power of two dividing"),
    (["--train-tp", "3", "--rollout-tp", "1", "--tp-invariant", "8"], "does not divide the model's"),
    (["--train-tp", "2", "--rollout-tp", "1", "--tp-invariant", "8", "--model", "tiny"], None),
    (["--tp", "2", "--rollout-tp", "1"], "--tp 2 sets both sides"),
    (["--tp-invariant", "3"], "power of two"),
])
def test_layouts_that_cannot_run_are_refused(args, message, capsys, monkeypatch):
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    code = cli.main(["plan", "--engine", "frameworks", "--model", "qwen3-0.6b", *args])
    err = capsys.readouterr().err
    if message is None:  # tiny: 320 / 8 rows per leaf, 2 KV heads of 16 -> k = 32 columns: fine at G = 8
        assert code == cli.EXIT_OK, err
    else:
        assert code == cli.EXIT_USAGE and message in err, err


def test_the_local_engine_refuses_the_layout_options(capsys):
    assert cli.main(["plan", "--train-tp", "2"]) == cli.EXIT_USAGE
    assert "--train-tp is an option of --engine frameworks" in capsys.readouterr().err


def test_run_refuses_a_layout_the_engine_does_not_run(monkeypatch):
    from rlk_core.errors import RlkConfigError
    from rlk_repro import tp_options
    from rlk_repro.engine import frameworks

    a = cli.build_parser().parse_args(["run", "--engine", "frameworks", "--model", "tiny", "--train-tp", "2",
                                       "--rollout-tp", "1", "--tp-invariant", "8"])
    cfg = cli._config(a, [], cli._resolve(a))
    assert "does not run train TP 2 with rollout TP 1" in tp_options.engine_problem(cfg)
    monkeypatch.setattr(frameworks, "requirements", lambda tp: None)  # a machine that has what the engine needs
    with pytest.raises(RlkConfigError, match="its multi-GPU run is issue 39"):
        frameworks.run_frameworks(cfg, "unused")
