"""Every flag `rlk-repro plan --engine vime` prints for VIME's train.py is one VIME's own argument parser accepts,
per the list recorded from VIME's, vLLM's and Megatron-LM's argument sources at named commits
(packages/rlk-repro/src/rlk_repro/data/vime-train-flags.txt, issue 41). VIME parses with
ignore_unknown_args=True, so a flag outside that list would be dropped without a word: this is the check."""

from __future__ import annotations

import itertools
import json
import shlex

import pytest

from rlk_repro import vime_args
from rlk_repro.cli import main

QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 1024, "intermediate_size": 3072,
         "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
         "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 151936, "tie_word_embeddings": True}
CASES = ("R/R", "P/P", "P/R", "R/P")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for v in ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "RL_KERNEL_MODE"):
        monkeypatch.delenv(v, raising=False)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("qwen3")
    (d / "config.json").write_text(json.dumps(QWEN3))
    return ["plan", "--engine", "vime", "--model-path", str(d), "--ref-load", "/m/dist", "--prompt-data", "/d/p",
            "--vime-root", "/opt/vime", "--run-id", "r1"]


def _train_argv(capsys, argv: list[str]) -> tuple[list[str], dict]:
    """train.py's arguments as the printed script passes them (parsed from the script text), and the doc."""
    assert main([*argv, "--json"]) == 0, capsys.readouterr().err
    doc = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    text = capsys.readouterr().out
    job = text.split("\nray job submit", 1)[1].split("2>&1 | tee", 1)[0]
    tokens = shlex.split(job.replace("\\\n", " "))
    return tokens[tokens.index("--") + 3:], doc


def test_the_recorded_list_has_every_source_and_the_flags_vime_needs() -> None:
    sections = vime_args.recorded_flags()
    assert set(sections) == {"vime", "vime-vllm", "vllm", "megatron"}
    assert len(sections["megatron"]) > 500 and len(sections["vllm"]) > 200 and len(sections["vime"]) > 200
    for flag in ("--custom-megatron-init-path", "--custom-tis-function-path", "--rollout-batch-size"):
        assert flag in sections["vime"]
    assert "--vllm-enable-deterministic-inference" in sections["vime-vllm"]
    assert "--vllm-attention-backend" in sections["vllm"] and "--spec" in sections["megatron"]
    for absent in ("--linear-logp-provider", "--ci-train-rollout-logprob-abs-diff-threshold"):
        assert absent not in vime_args.accepted_flags()


@pytest.mark.parametrize(("attention", "ffn", "logp"), list(itertools.product(CASES, repeat=3))[::5])
def test_every_printed_flag_is_one_vime_accepts(capsys, base, attention, ffn, logp) -> None:
    argv = [*base, "--attention-case", attention, "--ffn-case", ffn, "--logp-case", logp]
    if logp.startswith("R"):
        argv.append("--linear-logp-abi")
    train, doc = _train_argv(capsys, argv)
    assert train and train == [a for args in doc["flags"].values() for a in args]
    unknown = vime_args.unknown_flags(train, linear_logp_abi=logp.startswith("R"))
    assert unknown == [], unknown
    assert doc["vime_flags"] == {"recorded_at": vime_args.VIME_COMMIT, "linear_logp_abi": logp.startswith("R"),
                                 "not_recorded": []}


@pytest.mark.parametrize("options", [
    ["--profile", "qwen3-8b-8gpu", "--logp-case", "P/R"],
    ["--mode", "native", "--audit", "--no-colocate", "--rollout-gpus", "4", "--top-p", "0.9", "--top-k", "50"],
    ["--logp-case", "P/R", "--tis-function", "lab.tis.fn", "--cuda-graph-decode", "--recompute",
     "--keep-actor-resident", "--unfiltered-logprobs", "--top-p", "0.95", "--save-dir", "/ckpt", "--save-interval",
     "7", "--max-tokens-per-gpu", "9000", "--global-batch-size", "4"],
], ids=["profile", "native-audit", "options"])
def test_every_printed_flag_is_one_vime_accepts_with_options(capsys, base, options) -> None:
    train, doc = _train_argv(capsys, [*base, *options])
    assert vime_args.unknown_flags(train) == []
    assert "--linear-logp-provider" not in train


def test_the_check_catches_a_flag_vime_does_not_have() -> None:
    """The negative control: the flags the launch printed before (slime's gate, the fork's provider ABI)."""
    old = ["--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", "0", "--linear-logp-provider", "x",
           "--linear-logp-provider-mode", "strict"]
    assert vime_args.unknown_flags(old) == ["--ci-train-rollout-logprob-abs-diff-threshold",
                                            "--linear-logp-provider", "--linear-logp-provider-mode"]
    assert vime_args.unknown_flags(old, linear_logp_abi=True) == ["--ci-train-rollout-logprob-abs-diff-threshold"]
