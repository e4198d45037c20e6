"""Careful, read-only access to a directory somebody else wrote.

Every read goes through :class:`Root`: paths are resolved and must stay inside the root (a symlink
that points outside is refused), files must be regular files (a FIFO is never opened for a blocking
read), sizes are checked against a cap *before* reading, and every failure becomes an
:class:`InputError` carrying a finding instead of an exception trace.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from dataclasses import dataclass
from typing import Any

from .findings import Finding, finding

MiB = 1 << 20
#: deepest nesting of arrays/objects accepted in a JSON document; deeper ones are refused while reading
MAX_JSON_DEPTH = 64
#: largest integer magnitude accepted where a count or id is expected (larger: a finding, not a float overflow)
MAX_INT = (1 << 63) - 1


@dataclass(frozen=True)
class Caps:
    """Size caps, in bytes, checked before a file is read. ``stream_bytes`` caps a file that is only hashed (streamed
    in 4 MiB chunks, never held: a resumable run's ``round-state/state.pt``, an unknown file): its memory cost is one
    chunk whatever its size, so the cap bounds the time of the pass, not memory."""

    json_bytes: int = 64 * MiB
    log_bytes: int = 8192 * MiB
    tensor_bytes: int = 16384 * MiB
    stream_bytes: int = 1 << 40  # 1 TiB
    small_bytes: int = 4096  # exit-code, COMPLETE


class InputError(Exception):
    """A file could not be used; ``finding`` says why."""

    def __init__(self, f: Finding):
        super().__init__(f.message)
        self.finding = f


class _DuplicateKey(ValueError):
    pass


def _no_constants(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _DuplicateKey(f"duplicate key {k!r}")
        out[k] = v
    return out


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:40]} is out of the float range")
    return v


class TooDeep(ValueError):
    pass


def json_depth(obj: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """Nesting depth of arrays/objects (iterative; stops counting past ``limit``)."""
    deepest = 0
    stack = [(obj, 1)]
    while stack:
        o, d = stack.pop()
        if isinstance(o, (dict, list)):
            if d > deepest:
                deepest = d
                if deepest > limit:
                    return deepest
            stack.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def parse_json_text(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Strict JSON: no NaN/Infinity (literal or overflowing), no duplicate keys, nesting at most
    ``max_depth``. Raises ``ValueError`` (``TooDeep`` for nesting; RecursionError is turned into it)."""
    try:
        obj = json.loads(text, parse_constant=_no_constants, parse_float=_finite_float, object_pairs_hook=_pairs)
    except RecursionError:
        raise TooDeep(f"nested deeper than {max_depth} levels") from None
    if json_depth(obj, max_depth) > max_depth:
        raise TooDeep(f"nested deeper than {max_depth} levels")
    return obj


class Root:
    """Read-only view of a directory; ``rel`` paths use ``/`` and are relative to it."""

    def __init__(self, path: str | os.PathLike[str], caps: Caps | None = None, check: str = "input"):
        self.path = os.path.abspath(os.fspath(path))
        self.real = os.path.realpath(self.path)
        self.caps = caps or Caps()
        self.check = check
        #: rel -> sha256 hex of every file read in full (what a seal records and re-checks)
        self.digests: dict[str, str] = {}
        #: every rel a check tried to open (its problems are that check's findings)
        self.tried: set[str] = set()

    # -- paths -------------------------------------------------------------------------------
    def _err(self, code: str, message: str, rel: str, **details: Any) -> InputError:
        return InputError(finding(code, message, check=self.check, path=rel, **details))

    def resolve(self, rel: str) -> str:
        """The real path of ``rel``; raises ``PATH_ESCAPES`` when it leaves the root."""
        joined = os.path.join(self.path, *rel.split("/")) if rel else self.path
        real = os.path.realpath(joined)
        if real != self.real and not real.startswith(self.real.rstrip(os.sep) + os.sep):
            raise self._err(
                "PATH_ESCAPES",
                f"{rel} resolves to {real}, outside the checked directory; it was not read",
                rel,
                target=real,
            )
        return real

    def lexists(self, rel: str) -> bool:
        return os.path.lexists(os.path.join(self.path, *rel.split("/")))

    def is_dir(self, rel: str) -> bool:
        """True when ``rel`` is a directory inside the root (raises when it escapes)."""
        if not self.lexists(rel):
            return False
        return os.path.isdir(self.resolve(rel))

    def listdir(self, rel: str) -> list[str]:
        real = self.resolve(rel)
        try:
            return sorted(os.listdir(real))
        except OSError as e:
            raise self._err("FILE_UNREADABLE", f"cannot list {rel or '.'}/: {e.strerror or e}", rel) from None

    # -- files -------------------------------------------------------------------------------
    def open_fd(self, rel: str, cap: int) -> tuple[int, int]:
        """Open ``rel`` for reading; returns ``(fd, size)``. Checks type and size before any read."""
        self.tried.add(rel)
        real = self.resolve(rel)
        try:
            fd = _open_readonly(real)
        except FileNotFoundError:
            raise self._err("FILE_UNREADABLE", f"{rel} does not exist (dangling link?)", rel) from None
        except OSError as e:
            raise self._err("FILE_UNREADABLE", f"cannot open {rel}: {e.strerror or e}", rel) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise self._err("NOT_A_FILE", f"{rel} is not a regular file; it was not read", rel)
            if st.st_size > cap:
                raise self._err(
                    "FILE_TOO_LARGE",
                    f"{rel} is {st.st_size} bytes, over the cap of {cap} bytes; it was not read",
                    rel,
                    size=st.st_size,
                    cap=cap,
                )
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def read_bytes(self, rel: str, cap: int) -> bytes:
        fd, _ = self.open_fd(rel, cap)
        try:
            chunks = []
            left = cap + 1
            while left > 0:
                b = os.read(fd, min(left, 1 << 24))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
        except OSError as e:
            raise self._err("FILE_UNREADABLE", f"cannot read {rel}: {e.strerror or e}", rel) from None
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > cap:
            raise self._err("FILE_TOO_LARGE", f"{rel} grew past the cap of {cap} bytes while read", rel)
        self.digests[rel] = hashlib.sha256(data).hexdigest()
        return data

    def read_text(self, rel: str, cap: int) -> str:
        data = self.read_bytes(rel, cap)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self._err("JSON_INVALID", f"{rel} is not UTF-8 text (byte {e.start})", rel) from None

    def read_json(self, rel: str, cap: int | None = None) -> Any:
        text = self.read_text(rel, self.caps.json_bytes if cap is None else cap)
        try:
            return parse_json_text(text)
        except json.JSONDecodeError as e:
            ended = e.pos >= len(text.rstrip()) or e.msg.startswith("Unterminated")
            what = "truncated" if ended and text.strip() else "invalid"
            raise self._err(
                "JSON_INVALID", f"{rel} is {what} JSON: {e.msg} at line {e.lineno} column {e.colno}", rel
            ) from None
        except TooDeep as e:
            raise self._err("JSON_INVALID", f"{rel} is {e}; it was refused", rel) from None
        except ValueError as e:
            raise self._err("JSON_INVALID", f"{rel} is not strict JSON: {e}", rel) from None

    def find_in_text(self, rel: str, needle: bytes, cap: int) -> int | None:
        """Stream ``rel`` and return the 1-based line of the first ``needle``, or None (then the file's
        digest is recorded)."""
        fd, _ = self.open_fd(rel, cap)
        line = 1
        tail = b""
        h = hashlib.sha256()
        try:
            while True:
                b = os.read(fd, 1 << 22)
                if not b:
                    self.digests[rel] = h.hexdigest()
                    return None
                h.update(b)
                buf = tail + b
                i = buf.find(needle)
                if i >= 0:
                    return line + buf.count(b"\n", 0, i) - tail.count(b"\n")
                line += b.count(b"\n")
                tail = buf[-(len(needle) - 1) :] if len(needle) > 1 else b""
        except OSError as e:
            raise self._err("FILE_UNREADABLE", f"cannot read {rel}: {e.strerror or e}", rel) from None
        finally:
            os.close(fd)


def _open_readonly(real: str) -> int:
    """Open without blocking on FIFOs and without following a final symlink swapped in late."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
    return os.open(real, flags)
