"""A VIME run's artifact directory -> `rlk-validate import-vime` -> `rlk-validate`: fixtures written as a
VIME run leaves them (vime_builders.py). Torch-free: runs in .venv-validate."""

from __future__ import annotations

import os
from pathlib import Path

from validate_builders import PP, RR
from vime_builders import build_vime_run

from rlk_validate.cli import main


def _import(cli, src: Path) -> Path:
    dst = src.with_name(src.name + ".rlk")
    r = cli("import-vime", src, dst, json_out=False)
    assert r.code == 0, r.err
    return dst


def test_passing_rr_run_imports_validates_and_seals(tmp_path: Path, cli) -> None:
    src = build_vime_run(tmp_path / "vime")
    before = {p: p.read_bytes() for p in src.rglob("*") if p.is_file()}
    dst = _import(cli, src)
    r = cli(dst, "--require-bitwise")
    assert r.code == 0, (r.out, r.codes)
    # 2 rounds x 2 record writers (TP-0 ranks of 4 GPUs at TP 2) x 2 calls x 14 unmasked tokens
    assert r.doc["bitwise"]["mismatch_count"] == 0 and r.doc["bitwise"]["element_count"] == 2 * 2 * 2 * 14
    assert sorted(os.listdir(dst / "train-data")) == [f"round-000{k}.rank{i}.safetensors" for k in (0, 1)
                                                      for i in range(2)]
    assert cli(dst, "--seal", json_out=False).code == 0 and (dst / "COMPLETE").is_file()
    assert {p: p.read_bytes() for p in src.rglob("*") if p.is_file()} == before  # SRC only read


def test_mismatching_run_fails(tmp_path: Path, cli) -> None:
    dst = _import(cli, build_vime_run(tmp_path / "vime", drift=2.0 ** -10))
    r = cli(dst)
    assert r.code == 1 and "BITWISE_MISMATCH" in r.codes, r.codes
    assert r.doc["bitwise"]["mismatch_count"] == 2 * 2 * 2 * 5


def test_vime_metric_contradicting_the_records_fails(tmp_path: Path, cli) -> None:
    zero_claimed = _import(cli, build_vime_run(tmp_path / "a", drift=2.0 ** -10, vime_diff=0.0))
    assert "VIME_METRIC_DISAGREES" in cli(zero_claimed).codes
    drift_claimed = _import(cli, build_vime_run(tmp_path / "b", vime_diff=0.25))
    r = cli(drift_claimed)
    assert r.code == 1 and r.codes == ["VIME_METRIC_DISAGREES"] * 2, r.codes


def test_rollout_env_not_forwarded_to_ray_fails(tmp_path: Path, cli) -> None:
    """The rollout side's vLLM processes never saw RL_KERNEL_*: no readback, though the job finished (and
    its records look equal, e.g. a short run whose sampled tokens happened to agree): FAILED, not incomplete."""
    dst = _import(cli, build_vime_run(tmp_path / "vime", rollout_readbacks=False))
    r = cli(dst)
    assert r.code == 1, r.codes
    assert r.codes == ["READBACKS_SIDE_SILENT"], r.codes
    assert "runtime env" in r.findings("READBACKS_SIDE_SILENT")[0]["message"]


def test_rollout_saw_readback_dir_but_not_the_cases_fails(tmp_path: Path, cli) -> None:
    """Half-forwarded environment: the rollout processes ran the default plan (P/P) and said so."""
    dst = _import(cli, build_vime_run(tmp_path / "vime", rollout_plan=PP, drift=2.0 ** -10))
    r = cli(dst)
    assert r.code == 1 and "READBACK_PLAN_MISMATCH" in r.codes, r.codes


def test_unfinished_run_is_incomplete_not_silent(tmp_path: Path, cli) -> None:
    src = build_vime_run(tmp_path / "vime", rollout_readbacks=False)
    (src / "exit-code").unlink()
    r = cli(_import(cli, src))
    assert r.code == 2 and "READBACKS_SIDE_SILENT" not in r.codes and "READBACKS_MISSING" in r.codes


def test_multi_node_run_with_colliding_pids(tmp_path: Path, cli) -> None:
    """Two nodes, 8 training ranks at TP 2 / CP 2, one TP-2 vLLM engine per node; both nodes' processes have
    the same pids, kept apart by readbacks/<hostname>/."""
    src = build_vime_run(tmp_path / "vime", hosts=("node0", "node1"), gpus_per_node=4)
    assert (src / "readbacks" / "node0" / "megatron-training-4000.json").is_file()
    assert (src / "readbacks" / "node1" / "megatron-training-4000.json").is_file()
    dst = _import(cli, src)
    r = cli(dst, "--require-bitwise")
    assert r.code == 0, r.codes
    assert len(r.doc["readbacks"]["sides"]["train"]["processes"]) == 8
    assert len(r.doc["readbacks"]["sides"]["rollout"]["processes"]) == 4
    assert r.doc["bitwise"]["element_count"] == 2 * 4 * 2 * 14  # 8 ranks at TP 2: 4 record writers


def test_multi_node_readback_under_the_wrong_host_fails(tmp_path: Path, cli) -> None:
    src = build_vime_run(tmp_path / "vime", hosts=("node0", "node1"))
    os.rename(src / "readbacks" / "node1" / "vllm-rollout-7000.json", src / "readbacks" / "node0" / "x.json")
    r = cli(_import(cli, src))
    assert r.code == 1 and "READBACK_NAME_MISMATCH" in r.codes, r.codes


def test_mixed_cell_mismatch_is_a_diagnostic(tmp_path: Path, cli) -> None:
    plan = {**RR, "attention": "P/R"}
    r = cli(_import(cli, build_vime_run(tmp_path / "vime", plan, drift=2.0 ** -10)))
    assert r.code == 0, r.codes


def test_import_refuses_bad_input_in_one_line(tmp_path: Path, capsys) -> None:
    src = build_vime_run(tmp_path / "vime")
    dst = tmp_path / "out"
    dst.mkdir()
    assert main(["import-vime", str(src), str(dst)]) == 3
    assert "exists" in capsys.readouterr().err
    (src / "rlk-launch.json").write_text("{}")
    assert main(["import-vime", str(src), str(tmp_path / "out2")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rlk.vime-launch.v1" in err
    assert not (tmp_path / "out2").exists()
