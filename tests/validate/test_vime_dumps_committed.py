"""VIME's debug dumps read without torch: the committed ``torch.save`` files of ``data/vime-debug`` (written by
vime_dump_builders.write_committed with torch; test_vime_dumps.py checks they still are what it writes), read by
rlk_validate.ptfile / vime_dump in the torch-free suite too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from vime_builders import build_vime_run

from rlk_validate.vime_dump import compare_dumps, read_dump

DATA = Path(__file__).parent / "data" / "vime-debug"
EXPECTED = json.loads((DATA / "expected.json").read_text())


def test_committed_dumps_read_without_torch() -> None:
    rows = {r["file"]: r for r in compare_dumps(str(DATA))}
    assert sorted(rows) == sorted(EXPECTED) == ["0_8.pt", "1_8.pt"]
    for name, want in EXPECTED.items():
        assert (rows[name]["compared_tokens"], rows[name]["mismatch_count"], rows[name]["samples"]) == (
            want["compared_tokens"], want["mismatch_count"], want["samples"])
        got = read_dump(str(DATA / name))["samples"][0]["log_probs"]
        assert np.array_equal(got, np.array(want["first_log_probs"], np.float32))
    assert rows["0_8.pt"]["mismatch_count"] == 0 < rows["1_8.pt"]["mismatch_count"]


def test_vime_dumps_cli_and_import_on_the_committed_dumps(tmp_path: Path, cli) -> None:
    r = cli("vime-dumps", DATA, json_out=False)
    assert r.code == 1 and f"{EXPECTED['1_8.pt']['mismatch_count']} of" in r.out, r.out
    src = build_vime_run(tmp_path / "vime")
    shutil.rmtree(src / "logprob-records")
    (src / "debug-train-data").mkdir()
    for name in EXPECTED:
        shutil.copyfile(DATA / name, src / "debug-train-data" / name)
    dst = tmp_path / "rlk"
    assert cli("import-vime", src, dst, json_out=False).code == 0
    r = cli(dst)
    assert r.code == 1 and "BITWISE_MISMATCH" in r.codes
    assert [x["mismatch_count"] for x in r.doc["bitwise"]["rounds"]] == [0, EXPECTED["1_8.pt"]["mismatch_count"]]
