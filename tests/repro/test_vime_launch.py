"""`plan --engine vime` is pasteable (issue 41): model arguments from the checkpoint's config.json, optimizer,
micro-batching and checkpoints, no placeholder paths (missing ones exit 2 naming them), resolved absolute paths
in the launch record, the seeds' 8-GPU profile by name, rlk's log-prob recorder composed with the user's own
TIS/MIS function, and no flag VIME would drop silently."""

from __future__ import annotations

import json
import shlex
import sys
import types

import pytest
import torch

from rlk_core.errors import RlkConfigError
from rlk_repro import vime_args
from rlk_repro.cli import main

CASE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE")
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "vocab_size": 151936,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "max_position_embeddings": 40960, "use_sliding_window": False}
# slime's scripts/models/qwen3-8B.sh (THUDM/slime @ 624b824) MODEL_ARGS, and qwen3-0.6B.sh: what the derivation
# must give for those two config.json files (values compared as numbers)
SLIME_QWEN3_8B = ["--swiglu", "--num-layers", "36", "--hidden-size", "4096", "--ffn-hidden-size", "12288",
                  "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
                  "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
                  "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936", "--kv-channels",
                  "128", "--qk-layernorm", "--untie-embeddings-and-output-weights"]
QWEN3_0_6B = {**QWEN3_8B, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
              "num_attention_heads": 16, "tie_word_embeddings": True}
SLIME_QWEN3_0_6B = ["--swiglu", "--num-layers", "28", "--hidden-size", "1024", "--ffn-hidden-size", "3072",
                    "--num-attention-heads", "16", "--group-query-attention", "--num-query-groups", "8",
                    "--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
                    "--norm-epsilon", "1e-6", "--rotary-base", "1000000", "--vocab-size", "151936",
                    "--kv-channels", "128", "--qk-layernorm"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in (*CASE_VARS, "RL_KERNEL_MODE", "RL_KERNEL_TIS_FUNCTION"):
        monkeypatch.delenv(v, raising=False)


def _model(tmp_path, config: dict, name: str = "model") -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return str(d)


def _paths(model: str) -> list[str]:
    return ["--model-path", model, "--ref-load", "/m/dist", "--prompt-data", "/d/p.jsonl", "--vime-root", "/opt/vime"]


def _plan(capsys, *args: str) -> dict:
    code = main(["plan", "--engine", "vime", "--json", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out)


def _as_pairs(argv: list[str]) -> list[tuple[str, float | str | None]]:
    """Options with their value (as a number where it is one), in order."""
    out, i = [], 0
    while i < len(argv):
        value = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
        try:
            value = float(value) if value is not None else None
        except ValueError:
            pass
        out.append((argv[i], value))
        i += 2 if value is not None else 1
    return out


@pytest.mark.parametrize(("config", "expected"), [(QWEN3_8B, SLIME_QWEN3_8B), (QWEN3_0_6B, SLIME_QWEN3_0_6B)],
                         ids=["qwen3-8b", "qwen3-0.6b"])
def test_model_arguments_from_config_json_are_slimes(tmp_path, config, expected) -> None:
    args, info = vime_args.model_args(_model(tmp_path, config))
    assert _as_pairs(args) == _as_pairs(expected)
    assert info["architecture"] == "Qwen3ForCausalLM"


def test_the_launch_carries_the_model_optimizer_batching_and_checkpoints(tmp_path, capsys) -> None:
    model = _model(tmp_path, QWEN3_8B)
    doc = _plan(capsys, *_paths(model), "--logp-case", "P/R", "--run-dir", str(tmp_path / "run"),
                "--max-new-tokens", "7168", "--context-parallel", "2", "--rounds", "120")
    flags = doc["flags"]
    assert flags["model"][:4] == ["--hf-checkpoint", model, "--ref-load", "/m/dist"]
    assert _as_pairs(flags["model"][4:]) == _as_pairs(SLIME_QWEN3_8B)
    assert _as_pairs(flags["optimizer"]) == [("--optimizer", "adam"), ("--lr", 1e-6), ("--lr-decay-style", "constant"),
                                             ("--weight-decay", 0.1), ("--adam-beta1", 0.9), ("--adam-beta2", 0.98),
                                             ("--clip-grad", 1.0)]
    # one whole sample (2048 prompt + 7168 response tokens) per CP rank
    assert flags["batching"] == ["--use-dynamic-batch-size", "--max-tokens-per-gpu", "4608"]
    ckpt = str(tmp_path / "run" / "checkpoints")
    assert flags["checkpoints"] == ["--save", ckpt, "--load", ckpt, "--save-interval", "50"]
    assert doc["checkpoints"] == {"dir": ckpt, "interval": 50}


def test_missing_required_paths_exit_2_naming_every_one(tmp_path, capsys) -> None:
    model = _model(tmp_path, QWEN3_8B)
    assert main(["plan", "--engine", "vime", "--model-path", model, "--logp-case", "P/R"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") <= 2 and "Traceback" not in err
    for flag in ("--ref-load", "--prompt-data", "--vime-root"):
        assert flag in err, err
    assert "--model-path DIR" not in err  # the one given is not named
    assert main(["plan", "--engine", "vime", "--logp-case", "P/R"]) == 2
    assert "--model-path DIR" in capsys.readouterr().err


@pytest.mark.parametrize(("change", "words"), [
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128}, "not a dense decoder"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "RoPE scaling"),
    ({"hidden_act": "gelu"}, "SwiGLU"),
])
def test_a_model_the_plan_cannot_derive_is_refused(tmp_path, capsys, change, words) -> None:
    model = _model(tmp_path, {**QWEN3_8B, **change})
    assert main(["plan", "--engine", "vime", *_paths(model), "--logp-case", "P/R"]) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1


def test_paths_are_resolved_in_the_launch_record(tmp_path, capsys, monkeypatch) -> None:
    model = _model(tmp_path, QWEN3_8B)
    monkeypatch.chdir(tmp_path)
    args = ["--model-path", "model", "--ref-load", "dist", "--prompt-data", "p.jsonl", "--vime-root", "vime",
            "--logp-case", "P/R", "--run-id", "r9"]
    doc = _plan(capsys, *args)
    assert doc["run_dir"] == str(tmp_path / "rlk-runs" / "r9")
    assert doc["config"]["model_path"] == model and doc["config"]["ref_load"] == str(tmp_path / "dist")
    assert main(["plan", "--engine", "vime", *args]) == 0
    text = capsys.readouterr().out
    assert "$PWD" not in text and "$PWD" not in json.dumps(doc)
    launch = json.loads(text.split("<<'RLK_LAUNCH_EOF'\n", 1)[1].split("\nRLK_LAUNCH_EOF", 1)[0])
    assert launch["run_dir"] == str(tmp_path / "rlk-runs" / "r9") == launch["env"]["RL_KERNEL_RUN_ID"].join(
        [str(tmp_path / "rlk-runs") + "/", ""])


def test_the_8_gpu_profile_by_name_and_options_override_it(tmp_path, capsys) -> None:
    model = _model(tmp_path, QWEN3_8B)
    doc = _plan(capsys, *_paths(model), "--linear-logp-abi", "--profile", "qwen3-8b-8gpu")
    t = doc["topology"]
    assert (t["nodes"], t["gpus_per_node"], t["tensor_parallel"], t["context_parallel"],
            t["rollout_tensor_parallel"], t["colocate"]) == (1, 8, 4, 2, 4, True)
    assert doc["rounds"] == 200 and doc["profile"] == "qwen3-8b-8gpu"
    argv = doc["submit"]
    for seq in (["--no-offload-train", "--offload-rollout"], ["--rollout-max-response-len", "7168"],
                ["--n-samples-per-prompt", "8"], ["--rollout-batch-size", "1"],
                ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]):
        assert any(argv[i:i + len(seq)] == seq for i in range(len(argv))), seq
    graphs = json.loads(argv[argv.index("--vllm-compilation-config") + 1])
    assert graphs == {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": [1, 2, 3, 4, 5, 6, 7, 8],
                      # rollout TP 4 with R modules: the passes that bypass rlk's TP all-reduce off (issue 35)
                      "pass_config": {"fuse_allreduce_rms": False, "enable_sp": False, "fuse_gemm_comms": False}}
    doc = _plan(capsys, *_paths(model), "--linear-logp-abi", "--profile", "qwen3-8b-8gpu", "--rounds", "3",
                "--no-recompute")
    assert doc["rounds"] == 3 and "--recompute-granularity" not in doc["submit"]
    assert doc["topology"]["context_parallel"] == 2


def test_logp_r_on_the_train_side_needs_the_provider_abi(tmp_path, capsys) -> None:
    """The recorded VIME has no --linear-logp-provider: printing it would be dropped silently by VIME's parser."""
    model = _model(tmp_path, QWEN3_8B)
    assert main(["plan", "--engine", "vime", *_paths(model)]) == 2
    err = capsys.readouterr().err
    assert "--linear-logp-abi" in err and err.count("\n") == 1
    doc = _plan(capsys, *_paths(model), "--logp-case", "P/R")
    assert "--linear-logp-provider" not in doc["submit"]
    doc = _plan(capsys, *_paths(model), "--linear-logp-abi")
    argv = doc["submit"]
    assert argv[argv.index("--linear-logp-provider") + 1] == "rlk_megatron_provider.linear_logp"


def test_the_users_tis_function_is_composed_not_replaced(tmp_path, capsys) -> None:
    model = _model(tmp_path, QWEN3_8B)
    for extra in (["--tis-function", "mylab.mis.compute_mis_weights"],
                  ["--extra", "--use-tis --custom-tis-function-path mylab.mis.compute_mis_weights"]):
        doc = _plan(capsys, *_paths(model), "--logp-case", "P/R", *extra)
        argv = doc["submit"]
        assert argv.count("--custom-tis-function-path") == 1
        assert argv[argv.index("--custom-tis-function-path") + 1] == "rlk_megatron_provider.record_logprobs"
        assert doc["env"]["RL_KERNEL_TIS_FUNCTION"] == "mylab.mis.compute_mis_weights"
        assert json.loads(argv[argv.index("--runtime-env-json") + 1])["env_vars"]["RL_KERNEL_TIS_FUNCTION"] == \
            "mylab.mis.compute_mis_weights"
    assert ("--use-tis", None) in _as_pairs(doc["flags"]["extra"])
    assert main(["plan", "--engine", "vime", *_paths(model), "--logp-case", "P/R", "--tis-function", "a.b",
                 "--extra", "--custom-tis-function-path c.d"]) == 2
    assert "differ" in capsys.readouterr().err


def test_extra_flags_are_checked(tmp_path, capsys) -> None:
    model = _model(tmp_path, QWEN3_8B)
    assert main(["plan", "--engine", "vime", *_paths(model), "--logp-case", "P/R", "--extra", "--lr 1e-5"]) == 2
    assert "--extra repeats --lr" in capsys.readouterr().err
    assert main(["plan", "--engine", "vime", *_paths(model), "--logp-case", "P/R", "--json",
                 "--extra", "--use-wandb --use-wandbb"]) == 0
    out = capsys.readouterr()
    assert "--use-wandbb" in out.err and "drops unknown flags" in out.err and "--use-wandb " not in out.err
    assert json.loads(out.out)["vime_flags"]["not_recorded"] == ["--use-wandbb"]


# -- the recorder side of the composition (rlk_megatron_provider.record_logprobs) ---------------------------
def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = (5, 3)
    roll = [-torch.rand(n, generator=g) for n in lengths]
    return dict(args=types.SimpleNamespace(use_tis=True), pg_loss=torch.randn(8, generator=g),
                train_log_probs=[r.clone() for r in roll], rollout_log_probs=roll,
                loss_masks=[torch.ones(n, dtype=torch.int32) for n in lengths], total_lengths=[9, 7],
                response_lengths=list(lengths))


def users_tis(**kw):
    """A user's TIS function: scales the loss, drops a token from the masks, reports a metric."""
    USERS_TIS_CALLS.append(kw)
    masks = [m.clone() for m in kw["loss_masks"]]
    masks[0][0] = 0
    return kw["pg_loss"] * 0.5, masks, {"tis_weight": 0.5}


USERS_TIS_CALLS: list[dict] = []


def test_record_logprobs_records_then_returns_the_users_tis_result(tmp_path, monkeypatch) -> None:
    import rlk_megatron_provider
    from rlk_megatron_provider import slime_hooks

    slime_hooks.reset_calls()
    USERS_TIS_CALLS.clear()
    monkeypatch.setenv("RL_KERNEL_LOGPROB_RECORDS_DIR", str(tmp_path / "records"))
    monkeypatch.setenv("RL_KERNEL_TIS_FUNCTION", f"{__name__}.users_tis")
    monkeypatch.setitem(sys.modules, __name__, sys.modules[__name__])
    kw = _batch()
    pg_loss, masks, metrics = rlk_megatron_provider.record_logprobs(**kw, rollout_id=2)
    assert torch.equal(pg_loss, kw["pg_loss"] * 0.5) and metrics == {"tis_weight": 0.5} and masks[0][0] == 0
    (call,) = USERS_TIS_CALLS
    assert call["args"] is kw["args"] and call["pg_loss"] is kw["pg_loss"] and call["rollout_id"] == 2
    assert sorted(p.name for p in (tmp_path / "records").iterdir()) == ["rollout-000002.rank0.call0.safetensors"]
    slime_hooks.reset_calls()


@pytest.mark.parametrize("name", ["no_such_module_xyz.fn", "rlk_megatron_provider.record_logprobs"])
def test_a_tis_function_that_cannot_be_the_users_fails_before_recording(tmp_path, monkeypatch, name) -> None:
    import rlk_megatron_provider

    monkeypatch.setenv("RL_KERNEL_LOGPROB_RECORDS_DIR", str(tmp_path / "records"))
    monkeypatch.setenv("RL_KERNEL_TIS_FUNCTION", name)
    with pytest.raises(RlkConfigError, match="RL_KERNEL_TIS_FUNCTION"):
        rlk_megatron_provider.record_logprobs(**_batch(), rollout_id=0)
    assert not (tmp_path / "records").exists()


def test_the_script_line_of_train_py_is_the_documents_flags(tmp_path, capsys) -> None:
    model = _model(tmp_path, QWEN3_8B)
    assert main(["plan", "--engine", "vime", *_paths(model), "--logp-case", "P/R", "--profile", "qwen3-8b-8gpu",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert main(["plan", "--engine", "vime", *_paths(model), "--logp-case", "P/R", "--profile", "qwen3-8b-8gpu",
                 "--run-id", doc["run_id"], "--run-dir", doc["run_dir"]]) == 0
    text = capsys.readouterr().out
    job = text.split("\nray job submit", 1)[1].split("2>&1 | tee", 1)[0]
    argv = shlex.split(job.replace("\\\n", " "))
    train = argv[argv.index("--") + 3:]  # after "-- python3 train.py"
    assert train == [a for args in doc["flags"].values() for a in args]


def test_import_vime_reads_the_launchs_require_exact(tmp_path) -> None:
    """The launch names the exact claim require_exact now (one name, as manifests and bitwise files do);
    import-vime takes it from there (and still from exact_required, which launches printed before)."""
    import os

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "validate"))
    from vime_builders import build_vime_run

    from rlk_validate.vime import import_vime

    for key, value in (("require_exact", True), ("require_exact", False), ("exact_required", True)):
        src = build_vime_run(tmp_path / f"{key}-{value}")
        launch = json.loads((src / "rlk-launch.json").read_text())
        launch.pop("exact_required")
        launch[key] = value
        (src / "rlk-launch.json").write_text(json.dumps(launch))
        import_vime(str(src), str(tmp_path / f"{key}-{value}.rlk"))
        bitwise = json.loads((tmp_path / f"{key}-{value}.rlk" / "bitwise-validation.json").read_text())
        assert bitwise["require_exact"] is value, key
