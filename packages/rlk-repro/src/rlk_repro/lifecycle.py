"""The life of an ``rlk-repro run`` / ``matrix`` process: who may write a directory, and how a run ends.

- **Locks.** The process that creates a run directory holds an exclusive ``flock`` on the directory itself
  (no file is added to the run) until its ``exit-code`` is written: ``rlk-validate --seal`` takes the same
  lock, so a live run is never sealed. A matrix root has a lock file, :data:`~rlk_validate.evidence.MATRIX_LOCK`,
  naming its holder (pid, host, command, since when); a second ``rlk-repro matrix`` on the root exits 2
  naming it. Locks are released by the operating system when the process dies, however it dies.
- **Signals.** While a command runs, SIGINT raises :class:`KeyboardInterrupt` and SIGTERM :class:`Terminated`
  (a ``KeyboardInterrupt``: every path that ends a run on Ctrl-C ends it on SIGTERM too, with status 143).
  From the moment a run's outcome is decided until the next run starts (or the process exits), both are
  *held*: recorded, never raised, so the ``exit-code`` a run writes is the status the process exits with.
- **Before anything is created**: :func:`forced_backends_problem` (``RLK_BACKENDS``) and
  :func:`refuse_inside_run_dir`.
"""

from __future__ import annotations

import contextlib
import difflib
import fcntl
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from rlk_core.errors import RlkConfigError
from rlk_validate import evidence

EXIT_INTERRUPTED, EXIT_TERMINATED = 130, 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises :class:`KeyboardInterrupt` (exit status 143)."""


def interrupt_status(exc: BaseException) -> int:
    """130 for Ctrl-C (SIGINT), 143 for SIGTERM."""
    return EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED


def signal_name(exc: BaseException) -> str:
    return "SIGTERM" if isinstance(exc, Terminated) else "SIGINT"


# -- signals -------------------------------------------------------------------------------------
class _Signals:
    def __init__(self) -> None:
        self.installed = False  # our handler is installed (by the CLI, for the whole command)
        self.holding = False
        self.pending: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.holding:
            self.pending = signum
            return
        raise Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


_SIGNALS = _Signals()
_HANDLED = (signal.SIGINT, signal.SIGTERM)


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def handle_signals(process: bool) -> Iterator[None]:
    """SIGINT / SIGTERM handling for one command. ``process``: this command is the whole process (the console
    script): the handlers then stay installed after it, so a signal arriving while the interpreter exits is
    held too; otherwise (a caller's ``main([...])``) the previous handlers come back."""
    if not _main_thread():
        yield
        return
    before = {s: signal.getsignal(s) for s in _HANDLED}
    for s in _HANDLED:
        signal.signal(s, _SIGNALS.handler)
    _SIGNALS.installed, _SIGNALS.holding, _SIGNALS.pending = True, False, None
    try:
        yield
    finally:
        if not process:
            for s, h in before.items():
                signal.signal(s, h)
            _SIGNALS.installed, _SIGNALS.holding = False, False


def hold_signals() -> None:
    """From now until :func:`arm_signals`: SIGINT / SIGTERM are recorded, not raised (a run's outcome is decided)."""
    _SIGNALS.holding = True


def arm_signals() -> None:
    """A run starts: signals raise again; one that arrived while they were held is raised now."""
    pending, _SIGNALS.pending = _SIGNALS.pending, None
    _SIGNALS.holding = False
    if pending is not None and _SIGNALS.installed:
        raise Terminated() if pending == signal.SIGTERM else KeyboardInterrupt()


def held_signal() -> str | None:
    """The name of a signal that arrived while signals were held (and was not raised), or None."""
    return None if _SIGNALS.pending is None else signal.Signals(_SIGNALS.pending).name


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold signals for a block: under the CLI's handlers they stay held after it (see the module docstring);
    for a library caller (no handlers of ours) a signal that arrived inside is raised after the block."""
    if _SIGNALS.installed or not _main_thread():
        hold_signals()
        yield
        return
    before = {s: signal.getsignal(s) for s in _HANDLED}
    for s in _HANDLED:
        signal.signal(s, _SIGNALS.handler)
    _SIGNALS.holding, _SIGNALS.pending = True, None
    try:
        yield
    finally:
        for s, h in before.items():
            signal.signal(s, h)
        _SIGNALS.holding = False
        pending, _SIGNALS.pending = _SIGNALS.pending, None
    if pending is not None:
        raise Terminated() if pending == signal.SIGTERM else KeyboardInterrupt()


# -- locks ---------------------------------------------------------------------------------------
@dataclass
class Lock:
    """An exclusive ``flock`` held through ``fd`` (released by :meth:`release`, or by the OS on death)."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor releases the flock
            self.fd = None


def lock_run_dir(path: Path) -> Lock:
    """Hold an exclusive lock on the run directory ``path`` (just created by this process). Where the file
    system has no ``flock`` for directories, the run goes on unlocked (the lock guards sealing only)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RlkConfigError(f"{path} is locked by another process; a run never writes into another's "
                             "directory") from None
    except OSError:  # e.g. a file system without flock: say so in run.log (the caller logs lock.fd None)
        os.close(fd)
        return Lock(path, None)
    return Lock(path, fd)


def holder_text(info: dict) -> str:
    cmd = " ".join(str(c) for c in info.get("command") or [])
    return (f"pid {info.get('pid', '?')} on host {info.get('host', '?')}, since {info.get('since', '?')}"
            + (f" (`{cmd[:300]}`)" if cmd else ""))


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def lock_matrix_root(root: Path, command: Sequence[str]) -> Lock:
    """Hold the lock of matrix root ``root``; a root another live process holds: exit 2 naming the holder."""
    path = root / evidence.MATRIX_LOCK
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
    except OSError as exc:
        raise RlkConfigError(f"cannot open the lock of matrix root {root}: {exc.strerror or exc}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        try:
            info = json.loads(os.pread(fd, 65536, 0).decode("utf-8") or "{}")
        except (OSError, ValueError):
            info = {}
        os.close(fd)
        raise RlkConfigError(f"matrix root {root} is being written by another process: {holder_text(info)}; "
                             "two writers would overwrite each other's cells. Wait for it to end (or stop it), "
                             "then resume") from None
    except OSError as exc:
        os.close(fd)
        raise RlkConfigError(f"cannot lock matrix root {root}: {exc.strerror or exc} (a file system without "
                             "flock?); refusing to write it unlocked") from None
    body = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": list(command),
                       "since": utc_now()}).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, body, 0)
    return Lock(path, fd)


# -- before anything is created ------------------------------------------------------------------
def refuse_inside_run_dir(path: str | os.PathLike[str], flag: str) -> None:
    """``--output`` / ``--resume`` naming a run directory, or a folder inside one: exit 2."""
    run_dir = evidence.enclosing_run_dir(path)
    if run_dir is not None:
        where = "is" if Path(os.path.abspath(path)) == run_dir else "is inside"
        raise RlkConfigError(f"{flag} {path} {where} the run directory {run_dir}; a run directory is append-only "
                             "and sealed as a whole: nothing else is written into it (choose another directory)")


def refuse_sealed(path: str | os.PathLike[str], what: str) -> None:
    """Writing into a sealed run directory (``COMPLETE``) would break its seal, which covers every file: exit 2."""
    run_dir = evidence.enclosing_run_dir(path)
    if run_dir is not None and (run_dir / evidence.COMPLETE).exists():
        raise RlkConfigError(f"{run_dir} is sealed (COMPLETE): {what} would add files to it and break the seal, which "
                             "covers every file; pass --output DIR outside it")


def forced_backends_problem(device_type: str) -> str | None:
    """What is wrong with ``RLK_BACKENDS`` for ``device_type``, as one sentence (None: nothing): an op name that
    is not an rlk op, a backend not registered for the op (or one of the companions it forces), or one that is
    unavailable here. Read from rlk-core's registry, as a run would select them."""
    from rlk_core import envs
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import COMPANION_OF, OP_CONTRACTS
    from rlk_core.errors import RlkBackendError

    forced = envs.get("RLK_BACKENDS")
    if not forced:
        return None
    import rlk_core.ops  # noqa: F401  (registers every op's built-in backends)

    problems = []
    for op, backend_id in forced.items():
        if op not in OP_CONTRACTS:
            close = difflib.get_close_matches(op, OP_CONTRACTS, n=1)
            problems.append(f"{op!r} is not an rlk op" + (f" (did you mean {close[0]!r}?)" if close else
                                                         f" (ops: {', '.join(sorted(OP_CONTRACTS))})"))
            continue
        for name in (op, *sorted(c for c, main in COMPANION_OF.items() if main == op and c not in forced)):
            try:  # what a run's first call of the op asks the registry
                ok, why = REGISTRY.is_available(REGISTRY.get(name, backend_id), device_type)
            except RlkBackendError as exc:
                problems.append(str(exc))
                break
            if not ok:
                problems.append(f"{backend_id!r} for {name!r} is unavailable on {device_type}: {why}")
                break
    if not problems:
        return None
    return f"RLK_BACKENDS={os.environ.get('RLK_BACKENDS', '')!r}: " + "; ".join(problems)


def warn(message: str) -> None:
    print(f"rlk-repro: warning: {message}", file=sys.stderr)
