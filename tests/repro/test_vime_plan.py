"""`rlk-repro plan --engine vime`: the launch printed for each route cell, its environment forwarding into
Ray, the errors, and the 8-GPU command of issue 22 (Qwen3-8B shape, TP 4 / CP 2, rollout TP 4); the model
arguments, profiles, required paths and TIS composition of issue 41 are in test_vime_launch.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from rlk_repro import vime
from rlk_repro.cli import main

CASE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for v in (*CASE_VARS, "RL_KERNEL_MODE"):
        monkeypatch.delenv(v, raising=False)


QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None, "vocab_size": 151936,
            "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
            "max_position_embeddings": 40960, "use_sliding_window": False}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("Qwen3-8B")
    (d / "config.json").write_text(json.dumps(QWEN3_8B))
    return str(d)


@pytest.fixture
def paths(model_dir) -> list[str]:
    """The four required paths (the launch's inputs on the cluster) and the provider ABI logp R needs."""
    return ["--model-path", model_dir, "--ref-load", "/models/Qwen3-8B_torch_dist", "--prompt-data",
            "/data/dapo.jsonl", "--vime-root", "/opt/vime", "--linear-logp-abi"]


@pytest.fixture
def plan_json(capsys, paths):
    def run(*args: str) -> dict:
        assert main(["plan", "--engine", "vime", "--json", "--run-id", "r1", "--run-dir", "/runs/r1", *paths,
                     *args]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)
    return run


def has(argv: list[str], *seq: str) -> bool:
    return any(argv[i:i + len(seq)] == list(seq) for i in range(len(argv)))


CELLS = ["R/R", "P/P", "P/R", "R/P"]


@pytest.mark.parametrize("module", ["attention", "ffn", "logp"])
@pytest.mark.parametrize("case", CELLS)
def test_each_route_cell(plan_json, module: str, case: str) -> None:
    doc = plan_json(f"--{module}-case", case)
    plan = {m: "R/R" for m in ("attention", "ffn", "logp")} | {module: case}
    argv, env = doc["submit"], doc["env"]
    assert doc["plan"] == plan
    # the environment: every case, the mode, readback dir and run id, exported and forwarded to Ray identically
    for m, c in plan.items():
        assert env[f"RL_KERNEL_{m.upper()}_CASE"] == c
    assert env["RL_KERNEL_MODE"] == "strict" and env["RL_KERNEL_RUN_ID"] == "r1"
    assert env["RL_KERNEL_READBACK_DIR"] == "/runs/r1/readbacks"
    assert doc["runtime_env"] == {"env_vars": env}
    assert json.loads(argv[argv.index("--runtime-env-json") + 1]) == {"env_vars": env}
    assert argv[:3] == ["ray", "job", "submit"]
    # train side
    assert has(argv, "--custom-megatron-init-path", "rlk_megatron_provider.install")
    train_r = any(plan[m][0] == "R" for m in plan)
    assert has(argv, "--spec", *vime.ENTRY_POINTS["megatron_spec"]) == train_r
    assert has(argv, "--linear-logp-provider", "rlk_megatron_provider.linear_logp",
               "--linear-logp-provider-mode", "strict") == (plan["logp"][0] == "R")
    # rollout side
    assert has(argv, "--vllm-attention-backend", "CUSTOM") == (plan["attention"][2] == "R")
    assert "--vllm-enable-deterministic-inference" in argv
    assert has(argv, "--rollout-top-p", "1.0") and has(argv, "--rollout-top-k", "-1")
    # the exact claim (checked by rlk-validate --require-bitwise after the run) only where it is the claim;
    # slime's in-run gate is not a flag of VIME
    assert doc["require_exact"] == (case == "R/R")
    assert "--ci-train-rollout-logprob-abs-diff-threshold" not in argv


def test_native_is_what_users_run_today(plan_json) -> None:
    doc = plan_json("--mode", "native")
    argv = doc["submit"]
    assert doc["mode"] == "native" and set(doc["plan"].values()) == {"P/P"}
    for flag in ("--spec", "--linear-logp-provider", "--vllm-attention-backend",
                 "--vllm-enable-deterministic-inference", "--ci-test", "--transformer-impl"):
        assert flag not in argv
    assert has(argv, "--custom-megatron-init-path", "rlk_megatron_provider.install")  # P sides are recorded too


def test_env_variables_and_flags_route_like_the_local_engine(plan_json, monkeypatch) -> None:
    monkeypatch.setenv("RL_KERNEL_FFN_CASE", "P/R")
    doc = plan_json("--attention-case", "R/P")
    assert doc["plan"] == {"attention": "R/P", "ffn": "P/R", "logp": "R/R"}
    assert doc["plan_sources"]["ffn"] == "RL_KERNEL_FFN_CASE"
    assert doc["plan_sources"]["attention"] == "flag --attention-case"


def test_audit_mode_uses_auto_provider_mode(plan_json) -> None:
    doc = plan_json("--audit")
    assert doc["env"]["RL_KERNEL_MODE"] == "audit"
    assert has(doc["submit"], "--linear-logp-provider-mode", "auto")


def test_script_is_bash_that_exports_and_forwards(capsys, paths) -> None:
    assert main(["plan", "--engine", "vime", "--run-id", "r1", "--run-dir", "/runs/r1", *paths]) == 0
    text = capsys.readouterr().out
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    for var in (*CASE_VARS, "RL_KERNEL_MODE", "RL_KERNEL_READBACK_DIR", "RL_KERNEL_RUN_ID"):
        assert f"export {var}=" in text
        runtime_line = next(line for line in text.splitlines() if line.startswith("RUNTIME_ENV_JSON="))
        assert var in runtime_line
    assert '--runtime-env-json "$RUNTIME_ENV_JSON"' in text
    assert 'rlk-validate import-vime "$RUN_DIR"' in text and "--seal --require-bitwise" in text


def test_the_forwarded_environment_is_the_exported_one(capsys, tmp_path, paths) -> None:
    """Run the script's RUNTIME_ENV_JSON line with the exports in front of it: Ray gets every variable."""
    assert main(["plan", "--engine", "vime", "--run-id", "r1", "--run-dir", str(tmp_path), *paths]) == 0
    lines = capsys.readouterr().out.splitlines()
    prog = [line for line in lines if line.startswith(("export ", "RUNTIME_ENV_JSON="))]
    out = subprocess.run(["bash", "-c", "\n".join(prog) + '\necho "$RUNTIME_ENV_JSON"'], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin"}, check=True).stdout
    env = json.loads(out)["env_vars"]
    assert env["RL_KERNEL_LOGP_CASE"] == "R/R" and env["RL_KERNEL_READBACK_DIR"] == f"{tmp_path}/readbacks"


@pytest.mark.parametrize(("args", "words"), [
    (["--top-p", "0.95", "--logp-case", "P/R"], "--top-p 0.95"),
    (["--top-k", "20", "--logp-case", "P/R"], "--top-k 20"),
    (["--temperature", "0"], "must be > 0"),
    (["--tensor-parallel", "3"], "does not divide"),
    (["--rollout-tensor-parallel", "3"], "rollout TP 3"),
    (["--mode", "native", "--unfiltered-logprobs"], "--unfiltered-logprobs needs logp R"),
    (["--rollout-gpus", "4"], "--colocate"),
    (["--logp-case", "X/R"], "logp"),
])
def test_bad_combinations_are_one_line_exit_2(capsys, paths, args, words) -> None:
    assert main(["plan", "--engine", "vime", *paths, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") <= 2 and words in err, err
    assert "Traceback" not in err


def test_filtered_sampling_rr_exports_the_filters_to_the_trainer(plan_json) -> None:
    doc = plan_json("--top-p", "0.95", "--top-k", "40")
    assert doc["env"]["RL_KERNEL_LOGP_SAMPLING"] == "top_k=40,top_p=0.95"
    assert "RL_KERNEL_VLLM_UNFILTERED_LOGPROBS" not in doc["env"]
    assert has(doc["submit"], "--rollout-top-p", "0.95") and has(doc["submit"], "--rollout-top-k", "40")
    assert "RL_KERNEL_LOGP_SAMPLING" not in plan_json()["env"]  # no filter: nothing to tell the trainer


def test_filtered_sampling_with_opt_in_or_production_logp(plan_json) -> None:
    doc = plan_json("--top-p", "0.95", "--unfiltered-logprobs")
    assert doc["env"]["RL_KERNEL_VLLM_UNFILTERED_LOGPROBS"] == "1" and has(doc["submit"], "--rollout-top-p", "0.95")
    doc = plan_json("--logp-case", "R/P", "--top-k", "20")
    assert has(doc["submit"], "--rollout-top-k", "20")


def test_run_engine_vime_says_where_it_runs(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--engine", "vime", "--tensor-parallel", "4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cluster" in err and "plan --engine vime" in err
    assert list(tmp_path.iterdir()) == []


def test_issue_22_qwen3_8b_tp4_cp2_on_8_gpus(plan_json, model_dir) -> None:
    doc = plan_json("--mode", "consistency", "--tensor-parallel", "4", "--context-parallel", "2",
                    "--rollout-tensor-parallel", "4", "--nodes", "1", "--gpus-per-node", "8",
                    "--rounds", "200", "--samples-per-prompt", "8", "--max-new-tokens", "7168")
    argv = doc["submit"]
    for seq in (("--tensor-model-parallel-size", "4"), ("--context-parallel-size", "2"),
                ("--pipeline-model-parallel-size", "1"), ("--rollout-num-gpus-per-engine", "4"),
                ("--actor-num-nodes", "1"), ("--actor-num-gpus-per-node", "8"), ("--rollout-num-gpus", "8"),
                ("--colocate",), ("--num-rollout", "200"), ("--rollout-max-response-len", "7168"),
                ("--hf-checkpoint", model_dir), ("--ref-load", "/models/Qwen3-8B_torch_dist")):
        assert has(argv, *seq), seq
    assert doc["topology"]["data_parallel"] == 1
    assert doc["plan"] == {"attention": "R/R", "ffn": "R/R", "logp": "R/R"}


def test_plan_local_unchanged(capsys) -> None:
    assert main(["plan", "--rounds", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "local"
    assert main(["plan", "--engine", "local", "--rounds", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "local"


def test_vime_module_imports_no_torch() -> None:
    code = "import sys, rlk_repro.vime; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([__import__("sys").executable, "-c", code], check=True)


# -- step 4 of the script: gathering the nodes' readbacks and records -------------------------------------
FAKE_REMOTE = r'''
ssh() { cat "$NODES_ROOT/$1/hostname"; }
scp() {  # NODE:PATH -> $NODES_ROOT/NODE/PATH (globbed, as the remote shell would), then cp with scp's flags
  local args=() a f
  for a in "$@"; do
    case "$a" in
      *:*) for f in $NODES_ROOT/${a%%:*}${a#*:}; do args+=("$f"); done ;;
      *) args+=("$a") ;;
    esac
  done
  cp "${args[@]}"
}
'''


def _copy_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# 4.")) + 1
    block = lines[start:lines.index("#    then:")]
    return [line[len("#      "):] for line in block if line.startswith("#      ")]


def _gather(tmp_path, monkeypatch, copy: list[str]):
    """Three nodes (head + two), each with the readback its process wrote through RL_KERNEL_READBACK_DIR
    (one pid on all three: pids are per host) and its record files; ``copy`` run on the head."""
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder

    run_dir = tmp_path / "head" / "run"
    nodes_root = tmp_path / "nodes"
    roots = {"head": run_dir} | {n: nodes_root / n / str(run_dir).lstrip("/") for n in ("nb", "nc")}
    for i, (node, root) in enumerate(roots.items()):
        host = f"host-{node}"
        (root / vime.RECORDS_DIR).mkdir(parents=True)
        if node != "head":
            (nodes_root / node / "hostname").write_text(host + "\n")
        monkeypatch.setenv("RL_KERNEL_READBACK_DIR", str(root / "readbacks"))
        monkeypatch.setattr("rlk_core.readback.socket.gethostname", lambda host=host: host)
        rec = ReadbackRecorder("megatron", "train", RoutePlan.preset("consistency"), mode="strict", rank=i,
                               world_size=3)
        assert rec.flush() == root / "readbacks" / host / f"megatron-training-{rec.pid}.json"
        (root / vime.RECORDS_DIR / f"rollout-000000.rank{i}.call0.safetensors").write_bytes(b"")
    prog = FAKE_REMOTE + f"RUN_DIR={str(run_dir)!r}\nNODES='nb nc'\nNODES_ROOT={str(nodes_root)!r}\n" + "\n".join(copy)
    subprocess.run(["bash", "-euo", "pipefail", "-c", prog], check=True, capture_output=True, text=True)
    return run_dir


def _what_validation_reads(run_dir) -> tuple[list[str], int, list[str], int]:
    from rlk_validate.readbacks import check_readbacks
    from rlk_validate.safeio import Root
    from rlk_validate.vime import _record_files

    findings, summary = check_readbacks(Root(run_dir), {"attention": "R/R", "ffn": "R/R", "logp": "R/R"})
    hosts = sorted(str(p.relative_to(run_dir / "readbacks").parent) for p in (run_dir / "readbacks").rglob("*.json"))
    return hosts, summary["files"], sorted({f.code for f in findings} - {"READBACKS_MISSING"}), len(_record_files(
        str(run_dir)))


def test_script_gathers_every_nodes_readbacks_one_host_level(capsys, tmp_path, monkeypatch, paths) -> None:
    """The copy lines the script prints, run against two fake remote nodes: the head's readbacks/ then holds
    readbacks/<hostname>/ of each node (one level), every readback is read, and the records are found."""
    assert main(["plan", "--engine", "vime", "--run-id", "r1", "--run-dir", "/runs/r1", *paths]) == 0
    copy = _copy_lines(capsys.readouterr().out)
    assert copy == list(vime.COPY_FROM_NODES)
    hosts, files, codes, records = _what_validation_reads(_gather(tmp_path, monkeypatch, copy))
    assert hosts == ["host-head", "host-nb", "host-nc"]
    assert (files, records) == (3, 3)
    assert not {"READBACK_NAME_MISMATCH", "READBACK_DUPLICATE"} & set(codes), codes


def test_copying_into_readbacks_hostname_nests_and_loses_the_node_negative_control(tmp_path, monkeypatch) -> None:
    """The old instruction (a node's readbacks/ into readbacks/<hostname>/) nests two host levels: the
    validator reads one, so those nodes' readbacks are not seen."""
    old = [line.replace('scp -rp "$NODE:$RUN_DIR/readbacks/$H" "$RUN_DIR/readbacks/"',
                        'mkdir -p "$RUN_DIR/readbacks/$H" && scp -rp "$NODE:$RUN_DIR/readbacks/*" '
                        '"$RUN_DIR/readbacks/$H/"') for line in vime.COPY_FROM_NODES]
    assert old != list(vime.COPY_FROM_NODES)
    hosts, files, _, _ = _what_validation_reads(_gather(tmp_path, monkeypatch, old))
    assert hosts == ["host-head", "host-nb/host-nb", "host-nc/host-nc"]
    assert files == 1


def test_train_tp_other_than_rollout_tp_needs_tp_invariant_mode(capsys, paths, plan_json, monkeypatch) -> None:
    """Issue 35: TP 4 training with TP 1 / TP 2 rollout engines — strict mode refuses it without
    RL_KERNEL_TP_INVARIANT (saying what to set); with --tp-invariant (or the variable) every Ray worker gets it."""
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT", raising=False)
    layout = ["--tensor-parallel", "4", "--context-parallel", "2", "--rollout-tensor-parallel", "1"]
    assert main(["plan", "--engine", "vime", "--json", *paths, *layout]) == 2
    err = capsys.readouterr().err
    assert "strict mode: train TP 4 != rollout TP 1" in err and "Set RL_KERNEL_TP_INVARIANT=8 on both sides" in err
    for rollout_tp in ("1", "2"):
        doc = plan_json(*layout[:-1], rollout_tp, "--tp-invariant", "8")
        assert doc["env"]["RL_KERNEL_TP_INVARIANT"] == "8"
        assert doc["runtime_env"]["env_vars"]["RL_KERNEL_TP_INVARIANT"] == "8"
        assert doc["topology"]["rollout_tensor_parallel"] == int(rollout_tp)
    monkeypatch.setenv("RL_KERNEL_TP_INVARIANT", "on")
    assert plan_json(*layout)["env"]["RL_KERNEL_TP_INVARIANT"] == "8"
    assert "RL_KERNEL_TP_INVARIANT" not in plan_json("--tp-invariant", "off")["env"]  # one TP: the mode is optional
    monkeypatch.delenv("RL_KERNEL_TP_INVARIANT")
    doc = plan_json(*layout, "--audit")  # audit mode plans it (the problem is the run's to record)
    assert "RL_KERNEL_TP_INVARIANT" not in doc["env"]
