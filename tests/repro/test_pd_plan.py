"""``rlk-repro plan --engine frameworks --pd`` (issue 37, the seeds' single-node Prefill/Decode split): the printed
layout (a prefill engine and a decode engine, kv_producer / kv_consumer, one connector, colocated on the rollout GPUs,
the same routes, the memory split), and every layout an exact run cannot take refused with exit 2 naming the problem;
``run --pd`` checks the same, then refuses, saying why and where the pair runs."""

from __future__ import annotations

import json

import pytest

from rlk_repro import cli, pd_options

FW = ["--engine", "frameworks", "--model", "tiny"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("RL_KERNEL_MODE", "RL_KERNEL_TP_INVARIANT", "RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE",
                "RL_KERNEL_LOGP_CASE"):
        monkeypatch.delenv(var, raising=False)


def _plan(capsys, *args: str) -> tuple[int, dict | str]:
    code = cli.main(["plan", *args])
    out = capsys.readouterr()
    return code, (json.loads(out.out) if code == cli.EXIT_OK else out.err)


def test_plan_records_the_layout(capsys):
    code, doc = _plan(capsys, *FW, "--pd", "--gpu-memory-utilization", "0.4")
    assert code == 0, doc
    pd = doc["pd"]
    assert (pd["prefill"]["kv_role"], pd["decode"]["kv_role"]) == ("kv_producer", "kv_consumer")
    assert pd["prefill"]["routes"] == pd["decode"]["routes"] == pd["shared"]["routes"] == {m: "R" for m in doc["plan"]}
    assert pd["prefill"]["gpu_memory_utilization"] == pd["decode"]["gpu_memory_utilization"] == 0.2
    assert pd["placement"]["gpus"] == pd["prefill"]["gpus"] == pd["decode"]["gpus"] == [0]
    kt = pd["decode"]["kv_transfer_config"]
    assert (kt["kv_connector"], kt["kv_connector_module_path"]) == ("RlkSharedStorageConnector",
                                                                    "rlk_vllm_plugin.kv_connector")
    assert pd["connector"]["lossless_for_rlk_layout"] is True and pd["layout_problems"] == []
    assert "contract digest" in pd["shared"]["contracts"] and pd["engine_problem"]
    code, doc = _plan(capsys, *FW, "--pd", "--cuda-graph-decode", "--prompts-per-round", "2",
                      "--samples-per-prompt", "2")
    assert doc["pd"]["decode"]["cuda_graphs"]["capture_sizes"] == [1, 2, 3, 4] and doc["pd"]["prefill"]["cuda_graphs"] \
        is None
    assert "pd" not in _plan(capsys, *FW)[1]


@pytest.mark.parametrize("args,says", [
    (["--model", "tiny", "--pd"], "needs --engine frameworks"),
    ([*FW, "--pd", "--pd-prefill-routes", "attention=P"], "routes differ from the decode engine's on attention"),
    ([*FW, "--pd", "--pd-prefill-routes", "attention=X"], "is not MODULE=P|R"),
    ([*FW, "--pd", "--pd-connector", "example"], "IndexError"),
    ([*FW, "--pd", "--pd-connector", "decode-bench"], "transfers no KV"),
    ([*FW, "--pd", "--pd-connector", "p2p-nccl"], "two ranks on one GPU"),
    ([*FW, "--pd", "--pd-connector", "nixl"], "not been checked"),
    ([*FW, "--pd", "--pd-prefill-gpu-memory-utilization", "0.3"], "must be in (0, 0.3)"),
    (["--engine", "frameworks", "--model", "qwen3-moe-tiny", "--pd"], "Qwen3-MoE"),
    ([*FW, "--pd-connector", "example"], "--pd-connector is an option of --pd"),
], ids=lambda v: v if isinstance(v, str) else " ".join(v))
def test_inconsistent_layouts_exit_2_naming_the_problem(capsys, args, says):
    code, err = _plan(capsys, *args)
    assert code == cli.EXIT_USAGE and says in err and "Traceback" not in err, err


def test_audit_plans_a_layout_an_exact_run_refuses_and_records_why(capsys):
    code, doc = _plan(capsys, *FW, "--pd", "--audit", "--pd-prefill-routes", "ffn=P", "--pd-connector", "example")
    assert code == 0, doc
    problems = doc["pd"]["layout_problems"]
    assert any("ffn (P vs R)" in p for p in problems) and any("ExampleConnector" in p for p in problems)
    assert doc["pd"]["shared"]["routes"] is None
    # a native run (every rollout letter P) takes vLLM's own example connector: FlashAttention's layout is its own
    code, doc = _plan(capsys, *FW, "--pd", "--mode", "native", "--pd-connector", "example")
    assert code == 0 and doc["pd"]["layout_problems"] == [], doc


def test_run_pd_checks_the_layout_then_refuses(capsys, tmp_path):
    code = cli.main(["run", *FW, "--pd", "--pd-connector", "example", "--output", str(tmp_path)])
    assert code == cli.EXIT_USAGE and "IndexError" in capsys.readouterr().err
    code = cli.main(["run", *FW, "--pd", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and pd_options.engine_problem() in err and "pd_worker.py" in err, err
    assert not any(tmp_path.iterdir())


def test_doctor_pd_says_what_the_connector_needs(capsys):
    from rlk_core.plan import RoutePlan

    assert cli.main(["doctor", "--device", "cpu", "--pd"]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "RlkSharedStorageConnector (rlk_vllm_plugin.kv_connector)" in out and "run --pd refuses" in out

    def status(connector, preset):
        return {c.name: c.status for c in pd_options.doctor_checks(connector, RoutePlan.preset(preset))}

    assert status("example", "consistency")["pd kv layout"] == "FAIL"
    assert status("example", "native")["pd kv layout"] == "ok"
    import importlib.util

    nixl = importlib.util.find_spec("nixl") is not None
    assert status("nixl", "native")["pd connector"] == ("ok" if nixl else "FAIL")  # NixlConnector needs nixl
