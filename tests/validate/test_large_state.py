"""A resumable run's round state (``round-state/state.pt``: master weights and optimizer moments) may be larger than
the tensor read cap (a local MoE run's was 22.4 GB against 16 GiB): the seal hashes it streamed, in chunks, so an
honest large run passes and the memory bound holds (issue 41). Shown under lowered caps: a 64 MiB state against a
1 MiB tensor cap (the validator's peak Python allocation stays at its 16 MiB read buffer, not the file); the stream
cap still bounds the pass."""

from __future__ import annotations

import hashlib
import json
import os
import tracemalloc
from pathlib import Path

from validate_builders import build_run

from rlk_validate.safeio import Caps, MiB
from rlk_validate.validate import Options, validate_run

STATE = "round-state/state.pt"


def _with_state(tmp_path: Path, size: int) -> tuple[Path, str]:
    run = build_run(tmp_path / "run", rounds=1)
    (run / "round-state").mkdir()
    block = os.urandom(1 << 20)
    h = hashlib.sha256()
    with open(run / STATE, "wb") as f:
        for i in range(size >> 20):
            chunk = bytes([i & 0xFF]) + block[1:]
            f.write(chunk)
            h.update(chunk)
    (run / "round-state/state.json").write_text(json.dumps(
        {"schema": "rlk.round-state.v1", "next_round": 1, "file": "state.pt", "sha256": "sha256:" + h.hexdigest(),
         "bytes": size}))
    return run, h.hexdigest()


def test_a_state_over_the_tensor_cap_is_hashed_streamed_and_sealed(tmp_path, cli) -> None:
    run, digest = _with_state(tmp_path, 64 * MiB)
    caps = Caps(tensor_bytes=1 * MiB)
    tracemalloc.start()
    try:
        rep = validate_run(run, Options(caps=caps))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert rep.verdict == "passed", rep.summary()
    assert "FILE_TOO_LARGE" not in rep.codes()
    assert rep.inputs[STATE] == digest  # the seal covers it
    assert peak < 24 * MiB, f"peak {peak / MiB:.1f} MiB for a 64 MiB state: it was held, not streamed"
    res = cli(run, "--seal", "--max-tensor-mib", "1")
    assert res.code == 0 and (run / "COMPLETE").is_file(), res.out
    with open(run / STATE, "r+b") as f:  # a changed state after sealing is named
        f.seek(5 * MiB)
        byte = f.read(1)
        f.seek(5 * MiB)
        f.write(bytes([byte[0] ^ 1]))
    res = cli(run, "--max-tensor-mib", "1")
    assert res.code != 0 and any(STATE in (f.get("path") or "") + f["message"] for f in res.findings("SEAL_INVALID"))


def test_the_stream_cap_still_bounds_the_pass(tmp_path, cli) -> None:
    run, _ = _with_state(tmp_path, 3 * MiB)
    res = cli(run, "--max-stream-mib", "2")
    assert res.code != 0
    assert [f for f in res.findings("FILE_TOO_LARGE") if f.get("path") == STATE], res.out
    assert cli(run, "--max-stream-mib", "0").code == 3  # a usage error
