"""Progress of long work, the one way every ``rlk-repro`` command shows it (run, matrix, doctor --selfcheck).

:class:`Progress` writes to one stream (stderr by default):

- :meth:`Progress.note` — always: what a user must see even in a log file (the run directory, first);
- :meth:`Progress.line` — a progress line (one per round, one per self-check, a phase starting), only when
  the stream is a terminal: a pipe, a file or CI gets none of them (the run's own ``run.log`` and
  ``metrics.jsonl`` hold the same facts);
- :meth:`Progress.counter` — a live ``done/total`` counter redrawn in place within a round (terminal only,
  at most every 0.2 s, erased when it ends);
- :meth:`Progress.rounds` — a :class:`RoundClock`: per finished round the line ``round 3/10: 1,234 tokens
  compared, 0 mismatches; rollout 5,678 tok/s, train 9,012 tok/s; elapsed 0:42, ETA 1:38``.

Nothing here imports torch; constructing a :class:`Progress` reads nothing but ``stream.isatty()``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

#: redraw a live counter at most this often (seconds)
REDRAW_SECONDS = 0.2


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # closed or not a file
        return False


def clock(seconds: float) -> str:
    """``0:42``, ``12:05``, ``1:02:03``."""
    s = max(0, round(seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


class Progress:
    """Progress on ``stream`` (default stderr); ``enabled`` None = only when the stream is a terminal."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None,
                 now: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = is_terminal(self.stream) if enabled is None else enabled
        self.now = now
        self._live = 0  # width of the live counter now on screen (0: none)

    def _write(self, text: str) -> None:
        self._erase()
        print(text, file=self.stream, flush=True)

    def _erase(self) -> None:
        if self._live:
            self.stream.write("\r" + " " * self._live + "\r")
            self._live = 0

    def note(self, msg: str) -> None:
        """Always shown (terminal or not)."""
        self._write(f"rlk-repro: {msg}")

    def line(self, msg: str) -> None:
        """A progress line: shown on a terminal only."""
        if self.enabled:
            self._write(f"rlk-repro: {msg}")

    def counter(self, total: int, desc: str, unit: str = "tok") -> Counter:
        return Counter(self, total, desc, unit)

    def rounds(self, total: int, first: int = 0) -> RoundClock:
        return RoundClock(self, total, first)

    def callback(self) -> Callable[[str], None]:
        """``line`` as a plain function (e.g. for :func:`rlk_core.selfcheck.run`'s ``progress``)."""
        return self.line


class Counter:
    """A live ``desc done/total unit`` counter (a context manager); nothing when progress is off."""

    def __init__(self, progress: Progress, total: int, desc: str, unit: str) -> None:
        self.p, self.total, self.desc, self.unit = progress, max(0, int(total)), desc, unit
        self.done = 0
        self._last = float("-inf")

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.p.enabled:
            return
        t = self.p.now()
        if t - self._last < REDRAW_SECONDS and self.done < self.total:
            return
        self._last = t
        text = f"rlk-repro: {self.desc} {min(self.done, self.total):,}/{self.total:,} {self.unit}"
        self.p.stream.write("\r" + text.ljust(self.p._live))
        self.p.stream.flush()
        self.p._live = max(self.p._live, len(text))

    def close(self) -> None:
        if self.p.enabled:
            self.p._erase()
            self.p.stream.flush()

    def __enter__(self) -> Counter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RoundClock:
    """Elapsed time and ETA over rounds ``first .. total-1`` (a resumed run starts at ``first``)."""

    def __init__(self, progress: Progress, total: int, first: int = 0) -> None:
        self.p, self.total, self.first = progress, total, first
        self.start = progress.now()

    def text(self, rnd: int, row: dict[str, Any]) -> str:
        """The line for finished round ``rnd`` (0-based) from its metrics ``row``."""
        elapsed = self.p.now() - self.start
        done = rnd + 1 - self.first
        left = self.total - rnd - 1
        eta = elapsed / done * left if done > 0 else 0.0
        return (f"round {rnd + 1}/{self.total}: {int(row['compared_tokens']):,} tokens compared, "
                f"{int(row['mismatch_count']):,} mismatches; rollout {row['rollout_tokens_per_s']:,.0f} tok/s, "
                f"train {row['train_tokens_per_s']:,.0f} tok/s; elapsed {clock(elapsed)}"
                + (f", ETA {clock(eta)}" if left else ""))

    def done(self, rnd: int, row: dict[str, Any]) -> None:
        self.p.line(self.text(rnd, row))
