"""What the seal covers: every entry under the run directory, not only the files the checks read.

:func:`digest_tree` walks the run directory (never following a link) and records in ``root.digests`` what the
checks did not: the sha256 of each other regular file (streamed in 4 MiB chunks: one chunk of memory, any size up to
the stream cap ``Caps.stream_bytes``, so a large honest file such as a run's resume state is sealed), ``dir`` for
each folder, ``link:<sha256 of its target>`` for each symbolic link. ``run-validation.json`` and ``COMPLETE``
(the seal itself) are left out. A sealed run whose tree differs in any entry — a ``report/`` file, a dot-file, an
unknown folder, a blob added after sealing — is ``SEAL_INVALID`` naming it. Work is bounded: at most
:data:`MAX_ENTRIES` entries, :data:`MAX_DEPTH` levels; a tree beyond either is an error, not a long walk.
"""

from __future__ import annotations

import hashlib
import os
import stat

from .evidence import COMPLETE, RUN_VALIDATION
from .findings import Finding, finding
from .safeio import InputError, Root

MAX_ENTRIES = 100_000
MAX_DEPTH = 32
_SEAL_FILES = (COMPLETE, RUN_VALIDATION)


def _stream_digest(root: Root, rel: str) -> str:
    fd, _ = root.open_fd(rel, root.caps.stream_bytes)
    h = hashlib.sha256()
    try:
        while True:
            b = os.read(fd, 1 << 22)
            if not b:
                return h.hexdigest()
            h.update(b)
    except OSError as e:
        raise InputError(finding("FILE_UNREADABLE", f"cannot read {rel}: {e.strerror or e}", check=root.check,
                                 path=rel)) from None
    finally:
        os.close(fd)


def digest_tree(root: Root) -> list[Finding]:
    """Add every entry of ``root`` the checks did not read to ``root.digests``; findings for what cannot be."""
    out: list[Finding] = []
    seen = 0
    stack: list[tuple[str, int]] = [("", 0)]
    while stack:
        rel_dir, depth = stack.pop()
        try:
            names = sorted(os.listdir(os.path.join(root.path, rel_dir)))
        except OSError as e:
            out.append(finding("FILE_UNREADABLE", f"cannot list {rel_dir or '.'}/: {e.strerror or e}",
                               check=root.check, path=rel_dir or "."))
            continue
        for name in names:
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if not rel_dir and name in _SEAL_FILES:
                continue
            seen += 1
            if seen > MAX_ENTRIES:
                out.append(finding("FILE_TOO_LARGE", f"the run directory holds more than {MAX_ENTRIES} entries; the "
                                   "rest were not read (a run directory holds a few files per round)",
                                   check=root.check, path="."))
                return out
            full = os.path.join(root.path, *rel.split("/"))
            try:
                st = os.lstat(full)
            except OSError as e:
                out.append(finding("FILE_UNREADABLE", f"cannot stat {rel}: {e.strerror or e}", check=root.check,
                                   path=rel))
                continue
            if stat.S_ISLNK(st.st_mode):
                root.digests.setdefault(rel, "link:" + hashlib.sha256(os.fsencode(os.readlink(full))).hexdigest())
            elif stat.S_ISDIR(st.st_mode):
                root.digests[rel + "/"] = "dir"
                if depth + 1 >= MAX_DEPTH:
                    out.append(finding("FILE_TOO_LARGE", f"{rel}/ is nested {MAX_DEPTH} levels deep; not read",
                                       check=root.check, path=rel))
                else:
                    stack.append((rel, depth + 1))
            elif rel not in root.digests:
                if not stat.S_ISREG(st.st_mode):
                    out.append(finding("NOT_A_FILE", f"{rel} is not a regular file, folder or link; not read",
                                       check=root.check, path=rel))
                    continue
                tried = rel in root.tried
                try:
                    root.digests[rel] = _stream_digest(root, rel)
                except InputError as e:
                    if not tried:  # a file a check tried to read has its finding from that check
                        out.append(e.finding)
    return out
