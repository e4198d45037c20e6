"""``rlk-repro prepare`` (issue 37): DAPO-Math-17k Parquet -> VIME JSONL with its sibling manifest, the
developer-fixture rule, --download-data without network, the recorded workspace and ``doctor --workspace``."""

from __future__ import annotations

import hashlib
import json

import pytest

from rlk_repro import cli, prepare
from rlk_repro import workspace as ws


def _sha(path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def test_parquet_to_vime_jsonl_dedup_and_manifest(dapo_parquet, tmp_path, capsys):
    w = tmp_path / "W"
    assert cli.main(["prepare", "--workspace", str(w), "--source", str(dapo_parquet)]) == 0
    assert "5 problems" in capsys.readouterr().out
    out = w / "data" / "dapo-math-17k.vime.jsonl"
    lines = [json.loads(x) for x in out.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == 5  # 15 rows, 5 indices
    assert [x["metadata"]["index"] for x in lines] == [f"{i:08x}-dapo" for i in range(5)]
    first = lines[2]
    assert first["label"] == "\\frac{7}{2}" and first["prompt"][0]["role"] == "user"
    assert first["prompt"][0]["content"].startswith("Solve $2x = 7$") and set(first) == {"prompt", "label", "metadata"}
    man = json.loads((w / "data" / "dapo-math-17k.vime.manifest.json").read_text())
    assert man["schema"] == prepare.DATA_SCHEMA
    assert man["source"]["sha256"] == _sha(dapo_parquet) and man["source"]["rows"] == 15
    assert man["output"]["sha256"] == _sha(out) and man["output"]["rows"] == 5
    assert man["dedup"] == {"key": "extra_info.index", "kept": "first", "duplicates_dropped": 10}
    assert man["purpose"] == "developer-fixture" and "fewer than 17000" in man["purpose_reason"]
    doc = ws.read(w)
    assert doc["layout"] == ws.LAYOUT and doc["data"]["purpose"] == "developer-fixture"
    assert all((w / d).is_dir() for d in ws.LAYOUT.values())


def test_experiment_purpose_needs_the_full_set(monkeypatch, make_dapo_parquet, tmp_path):
    write, rows = make_dapo_parquet
    src = write(tmp_path / "d.parquet")
    monkeypatch.setattr(prepare, "MIN_EXPERIMENT_ROWS", 5)
    man = prepare.prepare_data(src, tmp_path / "a.vime.jsonl")
    assert man["purpose"] == "experiment"
    assert prepare.prepare_data(src, tmp_path / "b.vime.jsonl", forced_fixture=True)["purpose"] == "developer-fixture"
    monkeypatch.setattr(prepare, "MIN_EXPERIMENT_ROWS", 6)
    assert prepare.prepare_data(src, tmp_path / "c.vime.jsonl")["purpose"] == "developer-fixture"


def test_conflicting_duplicate_index_is_refused(make_dapo_parquet, tmp_path, capsys):
    write, rows = make_dapo_parquet
    r = rows()
    r[7]["reward_model"]["ground_truth"] = "999"  # index 2 again, with another answer
    src = write(tmp_path / "bad.parquet", r)
    assert cli.main(["prepare", "--workspace", str(tmp_path / "W"), "--source", str(src)]) == 2
    err = capsys.readouterr().err
    assert "extra_info.index 00000002-dapo repeats with a different prompt or ground truth" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "W" / "data" / "dapo-math-17k.vime.jsonl").exists()


def test_missing_column_names_the_layout(make_dapo_parquet, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "x.parquet"
    pq.write_table(pa.table({"question": ["1+1"], "answer": ["2"]}), src)
    assert cli.main(["prepare", "--workspace", str(tmp_path / "W"), "--source", str(src)]) == 2
    assert "no column 'prompt' (columns: question, answer)" in capsys.readouterr().err


def test_download_without_network_is_one_line_naming_the_file(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(prepare, "DAPO_URL", "http://127.0.0.1:9/dapo-math-17k.parquet")  # nothing listens there
    w = tmp_path / "W"
    assert cli.main(["prepare", "--workspace", str(w), "--download-data"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "cannot fetch http://127.0.0.1:9/dapo-math-17k.parquet" in err
    assert f"put it at {w / 'data' / 'dapo-math-17k.parquet'}" in err
    assert not (w / "data" / "dapo-math-17k.parquet.part").exists()


def test_download_data_uses_a_file_already_in_place(dapo_parquet, tmp_path):
    w = tmp_path / "W"
    (w / "data").mkdir(parents=True)
    (w / "data" / "dapo-math-17k.parquet").write_bytes(dapo_parquet.read_bytes())
    doc = prepare.prepare(w, source=None, download_data=True, model_path=None, convert=False)
    assert doc["data"]["rows"] == 5


@pytest.mark.parametrize("args, message", [
    ([], "nothing to prepare"),
    (["--convert-checkpoint"], "--convert-checkpoint needs --model-path"),
    (["--source", "/nonexistent.parquet"], "no such file"),
])
def test_bad_prepare_arguments(args, message, tmp_path, capsys):
    assert cli.main(["prepare", "--workspace", str(tmp_path / "W"), *args]) == 2
    assert message in capsys.readouterr().err


def test_doctor_checks_the_workspace(dapo_parquet, tmp_path, capsys):
    w = tmp_path / "W"
    prepare.prepare(w, source=dapo_parquet, download_data=False, model_path=None, convert=False)
    cli.main(["doctor", "--device", "cpu", "--workspace", str(w)])
    out = capsys.readouterr().out
    assert "workspace data" in out and "sha256 matches its manifest" in out and "developer-fixture" in out
    assert "FAIL" not in "\n".join(ln for ln in out.splitlines() if ln.lstrip().startswith("workspace"))
    jsonl = w / "data" / "dapo-math-17k.vime.jsonl"
    jsonl.write_text(jsonl.read_text() + "\n", encoding="utf-8")  # edited after prepare
    assert cli.main(["doctor", "--device", "cpu", "--workspace", str(w)]) == 1
    out = capsys.readouterr().out
    assert "changed after prepare" in out


def test_doctor_on_an_unprepared_workspace_fails(tmp_path, capsys):
    assert cli.main(["doctor", "--device", "cpu", "--workspace", str(tmp_path)]) == 1
    assert "is not a prepared workspace" in capsys.readouterr().out
