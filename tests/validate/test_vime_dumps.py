"""VIME's ``--save-debug-train-data`` dumps (format version 2) read without torch (rlk_validate.ptfile,
rlk_validate.vime_dump): the offline comparison ``rlk-validate vime-dumps`` and ``import-vime`` from the dumps.
The fixtures are written with ``torch.save`` as a VIME job writes them (vime_dump_builders.py), so torch is needed
to build them; the code under test never imports it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from vime_builders import build_vime_run  # noqa: E402
from vime_dump_builders import expected, payload, write_dumps, writer_rank  # noqa: E402

from rlk_validate.ptfile import PtProblem, load  # noqa: E402
from rlk_validate.vime_dump import DumpProblem, read_dump  # noqa: E402

TOPOLOGY = dict(dp=2, pp=2, cp=2, tp=2)  # 16 ranks: the writer is rank 8 (TP 0, CP 0, DP 0 of PP stage 1)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def test_ptfile_reads_tensors_bit_for_bit(tmp_path: Path) -> None:
    x = torch.randn(4, 6, dtype=torch.float32)
    doc = {"f32": x, "strided": x[:, 1::2], "offset": x.view(-1)[5:9], "bf16": x.to(torch.bfloat16),
           "i64": torch.arange(7), "i32": torch.tensor([3, -1], dtype=torch.int32), "b": torch.tensor([True, False]),
           "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "plain": [1, 2.5, "s", None, (3, 4)]}
    torch.save(doc, tmp_path / "a.pt")
    got = load(str(tmp_path / "a.pt"))
    for k in ("f32", "strided", "offset", "i64", "i32", "b", "scalar", "empty"):
        want = doc[k].numpy()
        assert got[k].shape == want.shape and got[k].dtype == want.dtype, k
        assert np.array_equal(_bits(got[k]), _bits(want)), k
    assert np.array_equal(_bits(got["bf16"]), _bits(doc["bf16"].float().numpy()))  # widened exactly
    assert got["plain"] == [1, 2.5, "s", None, (3, 4)]
    got["f32"][0, 0] = 99.0  # its own memory
    assert doc["f32"][0, 0] != 99.0


class _Sneaky:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_ptfile_refuses_code_and_runs_none(tmp_path: Path) -> None:
    flag = tmp_path / "ran"
    torch.save({"samples": [_Sneaky(flag)]}, tmp_path / "evil.pt")
    with pytest.raises(PtProblem, match="refused"):
        load(str(tmp_path / "evil.pt"))
    assert not flag.exists()
    good = tmp_path / "good.pt"
    torch.save({"x": torch.ones(1000)}, good)
    (tmp_path / "cut.pt").write_bytes(good.read_bytes()[:700])
    with pytest.raises(PtProblem):
        load(str(tmp_path / "cut.pt"))


def test_dump_layout_is_vimes(tmp_path: Path) -> None:
    (path,) = write_dumps(tmp_path, rollouts=1, **TOPOLOGY)
    assert path.name == f"0_{writer_rank(**TOPOLOGY)}.pt" == "0_8.pt"
    doc = read_dump(str(path))
    assert doc["format_version"] == 2 and doc["rank"] == 8 and len(doc["dp_shards"]) == 2
    assert [s["rollout_position"] for s in doc["samples"]] == list(range(6))
    assert [s["data_parallel_rank"] for s in doc["samples"]] == [0, 1] * 3
    want = expected(0, **TOPOLOGY)["values"]
    for k, v in want.items():
        assert np.array_equal(_bits(doc["samples"][0][k]), _bits(v)), k


def _vime_dumps(cli, directory: Path):
    return cli("vime-dumps", directory, json_out=False)


def test_equal_dumps_pass_the_offline_comparison(tmp_path: Path, cli) -> None:
    write_dumps(tmp_path / "d", rollouts=3, **TOPOLOGY)
    out = tmp_path / "cmp.json"
    r = cli("vime-dumps", tmp_path / "d", "--json", out, json_out=False)
    assert r.code == 0, (r.out, r.err)
    doc = json.loads(out.read_text())
    assert doc["compared_tokens"] == sum(expected(i, **TOPOLOGY)["compared_tokens"] for i in range(3)) > 0
    assert doc["mismatch_count"] == 0 and [d["file"] for d in doc["dumps"]] == ["0_8.pt", "1_8.pt", "2_8.pt"]
    assert all(d["train_rollout_logprob_abs_diff"] == 0 for d in doc["dumps"])


def test_one_ulp_apart_fails_with_every_differing_token_counted(tmp_path: Path, cli) -> None:
    write_dumps(tmp_path / "d", rollouts=2, drift=2.0 ** -12, **TOPOLOGY)
    out = tmp_path / "cmp.json"
    r = cli("vime-dumps", tmp_path / "d", "--json", out, json_out=False)
    assert r.code == 1 and "FAIL" in r.out
    doc = json.loads(out.read_text())
    want = sum(expected(i, drift=2.0 ** -12, **TOPOLOGY)["mismatch_count"] for i in range(2))
    assert doc["mismatch_count"] == want == 2 * 6  # the first response token of every sample
    assert all(d["train_rollout_logprob_abs_diff"] > 0 for d in doc["dumps"])


@pytest.mark.parametrize("edit,words", [
    (lambda p: p.update(format_version=1), "format_version is 1"),
    (lambda p: p["samples"][2].pop("log_probs"), "lacks log_probs"),
    (lambda p: p["samples"][1].update(log_probs=p["samples"][1]["log_probs"].double()), "not float32"),
    (lambda p: p["samples"].reverse(), "not sorted"),
    (lambda p: p["samples"][0]["loss_masks"].fill_(2), "other than 0 and 1"),
], ids=["version-1", "no-train-logprobs", "float64", "unsorted", "mask-2"])
def test_dumps_not_as_vime_writes_them_are_refused(tmp_path: Path, cli, edit, words: str) -> None:
    p = payload(0, **TOPOLOGY)
    edit(p)
    (tmp_path / "d").mkdir()
    torch.save(p, tmp_path / "d" / "0_8.pt")
    r = _vime_dumps(cli, tmp_path / "d")
    assert r.code == 3 and words in r.err, r.err


def test_a_dump_whose_cp_fields_were_not_gathered_is_refused(tmp_path: Path, cli) -> None:
    write_dumps(tmp_path / "d", rollouts=1, gathered=False, **TOPOLOGY)
    r = _vime_dumps(cli, tmp_path / "d")
    assert r.code == 3 and "gathered" in r.err
    with pytest.raises(DumpProblem, match="response_lengths"):
        read_dump(str(next((tmp_path / "d").iterdir())))


def _dump_run(tmp_path: Path, drift: float = 0.0, keep_records: bool = False) -> Path:
    src = build_vime_run(tmp_path / "vime", drift=drift)
    if not keep_records:
        shutil.rmtree(src / "logprob-records")
    write_dumps(src / "debug-train-data", rollouts=2, drift=drift, **TOPOLOGY)
    return src


def test_import_vime_from_dumps_validates_bitwise(tmp_path: Path, cli) -> None:
    src = _dump_run(tmp_path)
    dst = tmp_path / "rlk"
    r = cli("import-vime", src, dst, json_out=False)
    assert r.code == 0 and "debug-train-data" in r.out, r.err
    r = cli(dst, "--require-bitwise")
    assert r.code == 0, r.codes
    assert r.doc["bitwise"]["element_count"] == sum(expected(i, **TOPOLOGY)["compared_tokens"] for i in range(2))
    from safetensors.numpy import load_file

    t = load_file(str(dst / "train-data" / "round-0000.rank0.safetensors"))
    raw = payload(0, **TOPOLOGY)["raw_reward"]
    assert t["rewards"].tolist() == raw and t["train_logprobs"].shape[0] == 6


def test_import_vime_from_drifting_dumps_fails(tmp_path: Path, cli) -> None:
    dst = tmp_path / "rlk"
    assert cli("import-vime", _dump_run(tmp_path, drift=2.0 ** -12), dst, json_out=False).code == 0
    r = cli(dst)
    assert r.code == 1 and "BITWISE_MISMATCH" in r.codes, r.codes
    assert r.doc["bitwise"]["mismatch_count"] == 2 * 6


def test_import_vime_with_records_and_dumps_needs_a_choice(tmp_path: Path, cli) -> None:
    src = _dump_run(tmp_path, keep_records=True)
    r = cli("import-vime", src, tmp_path / "a", json_out=False)
    assert r.code == 3 and "--from" in r.err
    assert cli("import-vime", src, tmp_path / "b", "--from", "dumps", json_out=False).code == 0
    assert cli("import-vime", src, tmp_path / "c", "--from", "records", json_out=False).code == 0
    d = json.loads((tmp_path / "b" / "manifest.json").read_text())["config"]
    assert d["train_data_from"] == "debug-train-data"
    assert json.loads((tmp_path / "c" / "manifest.json").read_text())["config"]["train_data_from"] == "logprob-records"


def test_the_committed_dumps_are_what_the_builder_writes() -> None:
    """data/vime-debug (read by the torch-free suite) holds, tensor for tensor, what write_committed writes now."""
    from vime_dump_builders import COMMITTED, COMMITTED_ROLLOUTS

    for rid, drift in COMMITTED_ROLLOUTS.items():
        want = payload(rid, drift=drift)
        got = torch.load(COMMITTED / f"{rid}_{want['rank']}.pt", weights_only=True)
        assert got.keys() == want.keys() and len(got["samples"]) == len(want["samples"])
        for a, b in zip(got["samples"], want["samples"], strict=True):
            assert a.keys() == b.keys()
            for k in a:
                if torch.is_tensor(a[k]):
                    assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype, k
                else:
                    assert a[k] == b[k], k
