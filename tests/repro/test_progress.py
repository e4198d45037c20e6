"""Progress (issue 41): `rlk-repro run` names its run directory first, then one line per round (compared tokens,
mismatches, rollout / train tok/s, elapsed, ETA) on a terminal, and prints no progress into a pipe; `doctor
--selfcheck` shows each check as it runs; one module (rlk_repro.progress) does it for every command."""

from __future__ import annotations

import io
import os
import pty
import re
import select
import subprocess
import sys
from pathlib import Path

import pytest

from rlk_repro.progress import Progress, clock

SMALL = ["--prompts-per-round", "1", "--samples-per-prompt", "2", "--max-new-tokens", "4", "--chunk-size", "8"]
ROUND_LINE = re.compile(r"rlk-repro: round (\d+)/(\d+): ([\d,]+) tokens compared, ([\d,]+) mismatches; "
                        r"rollout [\d,]+ tok/s, train [\d,]+ tok/s; elapsed \d+:\d\d(, ETA \d+:\d\d)?")


def _run_with_stderr_on_a_terminal(cmd: list[str]) -> tuple[int, str, str]:
    """Run ``cmd`` with stderr on a pseudo-terminal (stdout a pipe); returns (rc, stdout, terminal text)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL)
    os.close(slave)
    chunks = []
    while True:
        ready, _, _ = select.select([master], [], [], 300)
        if not ready:
            proc.kill()
            proc.stdout.close()
            raise AssertionError("no output for 300 s")
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    with proc.stdout:
        out = proc.stdout.read().decode()
    rc = proc.wait(timeout=60)
    os.close(master)
    return rc, out, b"".join(chunks).decode(errors="replace").replace("\r\n", "\n")


def test_run_on_a_terminal_shows_the_run_directory_first_then_every_round(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "rlk_repro", "run", "--rounds", "3", "--output", str(tmp_path), *SMALL]
    rc, out, term = _run_with_stderr_on_a_terminal(cmd)
    assert rc == 0, term
    lines = [ln.split("\r")[-1] for ln in term.splitlines() if ln.strip()]
    notes = [ln for ln in lines if ln.startswith("rlk-repro: run directory ")]
    run_dir = Path(notes[0].removeprefix("rlk-repro: run directory "))
    assert run_dir.parent == tmp_path and (run_dir / "exit-code").is_file()
    rounds = [m for ln in lines if (m := ROUND_LINE.search(ln))]
    assert [(m[1], m[2]) for m in rounds] == [("1", "3"), ("2", "3"), ("3", "3")], term
    assert all(m[5] for m in rounds[:2]) and not rounds[2][5]  # an ETA until the last round
    first_round = next(i for i, ln in enumerate(lines) if ROUND_LINE.search(ln))
    assert lines.index(notes[0]) < first_round  # the run directory before any round
    # the numbers are the run's own (metrics.jsonl)
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(m[3].replace(",", "")) for m in rounds] == [r["compared_tokens"] for r in rows]


def test_run_into_a_pipe_prints_no_progress_but_the_run_directory(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "rlk_repro", "run", "--rounds", "2", "--output", str(tmp_path), *SMALL]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert not ROUND_LINE.search(proc.stderr) and "\r" not in proc.stderr
    assert "rlk-repro: run directory " in proc.stderr


def test_progress_is_quiet_off_a_terminal_and_the_note_is_not() -> None:
    buf = io.StringIO()  # not a terminal
    p = Progress(buf)
    assert not p.enabled
    p.line("a progress line")
    with p.counter(10, "work") as c:
        c.update(10)
    p.note("run directory /x")
    assert buf.getvalue() == "rlk-repro: run directory /x\n"


def test_counter_redraws_in_place_and_erases_itself() -> None:
    buf, t = io.StringIO(), [0.0]
    p = Progress(buf, enabled=True, now=lambda: t[0])
    with p.counter(100, "round 1 rollout") as c:
        c.update(10)
        c.update(10)  # within REDRAW_SECONDS: not drawn
        t[0] = 1.0
        c.update(30)
    p.line("round 1/1: done")
    text = buf.getvalue()
    assert "10/100 tok" in text and "50/100 tok" in text and "20/100" not in text
    assert text.endswith("\rrlk-repro: round 1/1: done\n")


def test_round_clock_eta_from_the_mean_round_time() -> None:
    buf, t = io.StringIO(), [100.0]
    p = Progress(buf, enabled=True, now=lambda: t[0])
    rc = p.rounds(10, first=2)  # a resumed run: rounds 3..10 left
    t[0] = 120.0
    row = {"compared_tokens": 1234, "mismatch_count": 0, "rollout_tokens_per_s": 5678.4, "train_tokens_per_s": 9.0}
    text = rc.text(3, row)  # two rounds done in 20 s, six left
    assert text == ("round 4/10: 1,234 tokens compared, 0 mismatches; rollout 5,678 tok/s, train 9 tok/s; "
                    "elapsed 0:20, ETA 1:00")
    assert clock(3723) == "1:02:03"


@pytest.mark.slow
def test_doctor_selfcheck_shows_each_check_on_a_terminal() -> None:
    cmd = [sys.executable, "-m", "rlk_repro", "doctor", "--device", "cpu", "--selfcheck"]
    rc, out, term = _run_with_stderr_on_a_terminal(cmd)
    assert "selfcheck" in out, out
    steps = re.findall(r"rlk-repro: \[(\d+)/(\d+)\] \S+ \S+: (pass|FAIL)", term)
    assert steps and int(steps[-1][0]) == int(steps[-1][1]) == len(steps), term
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert "[1/" not in proc.stderr  # not a terminal: no progress
