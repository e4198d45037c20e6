"""Reading ``train-data/`` files: safetensors streamed through numpy, legacy ``.pt`` only if torch is importable.

The safetensors header is parsed and checked here (length, JSON, dtypes, shapes, offsets) before any data
is read, so a truncated or hostile file gives a finding, not a trace. The data is then *streamed*: the file
is hashed in one sequential pass, and its ``[S, T]`` tensors are read together in chunks of
:data:`CHUNK_ELEMENTS` positions (``os.pread`` at each tensor's offset), so the memory a file costs is one
chunk (about 17 bytes a position: ~36 MiB), never the file (``docs/validate.md``, "Memory"). A file that
changes while it is read is refused. torch is never imported unless a legacy ``.pt`` file is actually present
(such a file is loaded whole).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .evidence import TRAIN_DATA_PER_SEQUENCE, TRAIN_DATA_REQUIRED, TRAIN_DATA_SCHEMA, TRAIN_DATA_TENSORS, is_member
from .findings import finding
from .safeio import InputError, Root, parse_json_text

CHECK = "bitwise"
SCHEMA = TRAIN_DATA_SCHEMA
NAMES = TRAIN_DATA_REQUIRED
_ST_DTYPES = {
    "BOOL": np.dtype(bool),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "I32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "I64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "BF16": None,
    "F8_E4M3": None,
    "F8_E5M2": None,
}
_ALLOWED = {t.name: t.dtypes for t in TRAIN_DATA_TENSORS}
#: a train-data header describes six tensors and three metadata strings: a header beyond this is refused unread
_HEADER_CAP = 1 << 20
#: positions of a file's ``[S, T]`` grid read at once (each tensor's slice of them: a chunk is ~17 B a position)
CHUNK_ELEMENTS = 1 << 21
_READ = 1 << 22
#: round and rank numbers: ASCII digits, bounded length (a 5000-digit name is not a round)
NAME_RE = re.compile(r"round-([0-9]{4,9})\.rank([0-9]{1,6})\.safetensors")
LEGACY_RE = re.compile(r"(?:round-)?([0-9]{1,9})\.rank([0-9]{1,6})\.pt")
_META_INT_RE = re.compile(r"[0-9]{1,9}")
_PT_ALIASES = {
    "token_ids": ("token_ids", "tokens", "input_ids"),
    "response_mask": ("response_mask", "loss_mask", "mask"),
    "rollout_logprobs": ("rollout_logprobs", "rollout_log_probs", "rollout_logp"),
    "train_logprobs": ("train_logprobs", "train_log_probs", "log_probs", "train_logp"),
}


@dataclass
class Chunk:
    """Positions ``[start, start + n)`` of a file's ``[S, T]`` grid, flattened row-major: ``mask`` bool,
    log-probs float32, ``token_ids`` integers, each 1-D of length ``n``."""

    start: int
    token_ids: np.ndarray
    mask: np.ndarray
    rollout: np.ndarray
    train: np.ndarray


@dataclass
class TrainData:
    """One round/rank file: its ``[S, T]`` shape, ``rewards`` and ``advantages`` float32 ``[S]`` (or None when the
    file has none), and its data as :meth:`chunks` (call :meth:`close` when done)."""

    rel: str
    round: int
    rank: int
    shape: tuple[int, int]
    rewards: np.ndarray | None = None
    advantages: np.ndarray | None = None
    _reader: Any = field(default=None, repr=False)

    def chunks(self, size: int = CHUNK_ELEMENTS) -> Iterator[Chunk]:
        return self._reader(size)

    def close(self) -> None:
        closer = getattr(self._reader, "close", None)
        if closer is not None:
            closer()


def parse_name(name: str) -> tuple[int, int, str] | None:
    """``(round, rank, "safetensors"|"pt")`` for a train-data file name, else None."""
    m = NAME_RE.fullmatch(name)
    if m:
        return int(m.group(1)), int(m.group(2)), "safetensors"
    m = LEGACY_RE.fullmatch(name)
    if m:
        return int(m.group(1)), int(m.group(2)), "pt"
    return None


def torch_importable() -> bool:
    """Whether torch could be imported; does not import it."""
    return importlib.util.find_spec("torch") is not None


def _bad(rel: str, msg: str, code: str = "TENSOR_FILE_INVALID", **details: Any) -> InputError:
    return InputError(finding(code, f"{rel}: {msg}", check=CHECK, path=rel, **details))


def _parse_header(rel: str, head: bytes, size: int) -> tuple[dict[str, Any], dict[str, str], int]:
    """``head``: the file's first bytes (at least the 8-byte length and the header it gives, where it fits);
    ``size``: the file's size. Returns the tensors' descriptions, the metadata and where the data begins."""
    if size < 8:
        raise _bad(rel, f"file is {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", head[:8])
    if n > _HEADER_CAP:
        raise _bad(rel, f"header length {n} is over the {_HEADER_CAP} bytes a train-data header needs; not read")
    if 8 + n > size or len(head) < 8 + n:
        raise _bad(rel, f"header length {n} does not fit in a {size}-byte file (truncated?)")
    try:
        header = parse_json_text(head[8 : 8 + n].decode("utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise _bad(rel, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(rel, "header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad(rel, "__metadata__ must map names to strings", "TENSOR_METADATA_INVALID")
    body = size - 8 - n
    for name, info in header.items():
        if not isinstance(info, dict):
            raise _bad(rel, f"tensor {name!r} has no description")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in _ST_DTYPES:
            raise _bad(rel, f"tensor {name!r} has unknown dtype {dt!r}")
        if not (
            isinstance(shape, list)
            and len(shape) <= 8
            and all(type(s) is int and 0 <= s < (1 << 48) for s in shape)
        ):
            raise _bad(rel, f"tensor {name!r} has an invalid shape {shape!r}")
        if not (
            isinstance(offs, list)
            and len(offs) == 2
            and all(type(o) is int for o in offs)
            and 0 <= offs[0] <= offs[1] <= body
        ):
            raise _bad(rel, f"tensor {name!r} data offsets {offs!r} fall outside the file (truncated?)")
        npdt = _ST_DTYPES[dt]
        itemsize = npdt.itemsize if npdt is not None else (2 if dt == "BF16" else 1)
        if offs[1] - offs[0] != math.prod(shape) * itemsize:
            raise _bad(rel, f"tensor {name!r}: {offs[1] - offs[0]} bytes do not hold shape {shape} of {dt}")
    return header, meta, 8 + n


def _check_structure(rel: str, dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]]) -> None:
    missing = [n for n in NAMES if n not in dtypes]
    if missing:
        raise _bad(rel, f"missing tensor(s) {', '.join(missing)}", "TENSOR_MISSING", missing=missing)
    for n in NAMES:
        if dtypes[n] not in _ALLOWED[n]:
            raise _bad(
                rel,
                f"{n} has dtype {dtypes[n]}, expected {' or '.join(_ALLOWED[n])}",
                "TENSOR_DTYPE_INVALID",
                tensor=n,
                dtype=dtypes[n],
            )
    ref = shapes["response_mask"]
    if len(ref) != 2:
        raise _bad(rel, f"response_mask has shape {list(ref)}, expected [S, T]", "TENSOR_SHAPE_MISMATCH")
    for n in NAMES:
        if shapes[n] != ref:
            raise _bad(
                rel,
                f"{n} has shape {list(shapes[n])} but response_mask has {list(ref)}",
                "TENSOR_SHAPE_MISMATCH",
                shapes={k: list(v) for k, v in shapes.items() if k in NAMES},
            )
    for n in TRAIN_DATA_PER_SEQUENCE:
        if n not in dtypes:
            continue
        if dtypes[n] not in _ALLOWED[n]:
            raise _bad(rel, f"{n} has dtype {dtypes[n]}, expected {' or '.join(_ALLOWED[n])}",
                       "TENSOR_DTYPE_INVALID", tensor=n, dtype=dtypes[n])
        if tuple(shapes[n]) != (ref[0],):
            raise _bad(rel, f"{n} has shape {list(shapes[n])}, expected [{ref[0]}] (one per sequence)",
                       "TENSOR_SHAPE_MISMATCH")


def _pread(fd: int, n: int, offset: int, rel: str) -> bytes:
    out = bytearray()
    while len(out) < n:
        try:
            b = os.pread(fd, min(n - len(out), _READ), offset + len(out))
        except OSError as e:
            raise _bad(rel, f"cannot read: {e.strerror or e}", "FILE_UNREADABLE") from None
        if not b:
            raise _bad(rel, "ended while it was read (truncated, or changed by another process)")
        out += b
    return bytes(out)


def _digest(fd: int, size: int, rel: str) -> str:
    """sha256 of the file's ``size`` bytes, read sequentially (what a seal records)."""
    h, off = hashlib.sha256(), 0
    while off < size:
        b = _pread(fd, min(_READ, size - off), off, rel)
        h.update(b)
        off += len(b)
    return h.hexdigest()


class _Reader:
    """Chunks of a safetensors file's four ``[S, T]`` tensors, read from ``fd`` at their offsets."""

    def __init__(self, fd: int, rel: str, where: dict[str, tuple[int, np.dtype]], elements: int,
                 stamp: tuple[int, int, int]) -> None:
        self.fd, self.rel, self.where, self.elements, self.stamp = fd, rel, where, elements, stamp

    def __call__(self, size: int) -> Iterator[Chunk]:
        for start in range(0, self.elements, size):
            n = min(size, self.elements - start)
            t = {name: np.frombuffer(_pread(self.fd, n * dt.itemsize, off + start * dt.itemsize, self.rel), dtype=dt)
                 for name, (off, dt) in self.where.items()}
            mask = t["response_mask"]
            if mask.dtype != np.bool_:
                if mask.size and int(mask.max(initial=0)) > 1:
                    bad = int(np.count_nonzero(mask > 1))
                    raise _bad(self.rel, f"response_mask has {bad} value(s) other than 0 and 1 (from position "
                               f"{start} on)", "MASK_INVALID")
                mask = mask.astype(bool)
            yield Chunk(start, t["token_ids"], mask, t["rollout_logprobs"], t["train_logprobs"])
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != self.stamp:
            raise _bad(self.rel, "changed while it was read; not used")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def load_safetensors(root: Root, rel: str, round_: int, rank: int) -> TrainData:
    """Open ``rel``, check its header, hash it (``root.digests``) and return it ready to stream."""
    fd, size = root.open_fd(rel, root.caps.tensor_bytes)
    try:
        st = os.fstat(fd)
        head = _pread(fd, min(size, 8), 0, rel) if size >= 8 else b""
        if size >= 8:
            (n,) = struct.unpack("<Q", head)
            if n <= _HEADER_CAP and 8 + n <= size:
                head = _pread(fd, 8 + n, 0, rel)
        header, meta, data_start = _parse_header(rel, head, size)
        _check_structure(rel, {k: v["dtype"] for k, v in header.items()},
                         {k: tuple(v["shape"]) for k, v in header.items()})
        if not is_member(meta.get("schema"), (SCHEMA,)):
            got = str(meta.get("schema"))[:80]
            raise _bad(rel, f"metadata schema is {got!r}, expected {SCHEMA!r}", "TENSOR_METADATA_INVALID")
        for key, want in (("round", round_), ("rank", rank)):
            got = meta.get(key)
            if got is None or not _META_INT_RE.fullmatch(got) or int(got) != want:
                raise _bad(
                    rel,
                    f"metadata {key}={str(got)[:40]!r} is not the decimal ASCII number of the file name ({want})",
                    "TENSOR_METADATA_INVALID",
                )
        root.digests[rel] = _digest(fd, size, rel)
        where = {name: (data_start + header[name]["data_offsets"][0],
                        _ST_DTYPES[header[name]["dtype"]].newbyteorder("<")) for name in NAMES}
        per_seq = {}
        for name in TRAIN_DATA_PER_SEQUENCE:
            if name in header:
                off, dt = data_start + header[name]["data_offsets"][0], _ST_DTYPES[header[name]["dtype"]]
                count = header[name]["shape"][0]
                per_seq[name] = np.frombuffer(_pread(fd, count * dt.itemsize, off, rel), dtype=dt.newbyteorder("<"))
        s_, t_ = header["response_mask"]["shape"]
        reader = _Reader(fd, rel, where, s_ * t_, (st.st_size, st.st_mtime_ns, st.st_ino))
    except BaseException:
        os.close(fd)
        raise
    return TrainData(rel, round_, rank, (s_, t_), per_seq.get("rewards"), per_seq.get("advantages"), reader)


def load_pt(root: Root, rel: str, round_: int, rank: int) -> TrainData:
    """Legacy torch file; only called when :func:`torch_importable` is true."""
    import torch  # legacy path only: never reached without .pt files

    real = root.resolve(rel)
    fd, _ = root.open_fd(rel, root.caps.tensor_bytes)
    os.close(fd)
    try:
        obj = torch.load(real, map_location="cpu", weights_only=True)
    except Exception as e:
        raise _bad(rel, f"torch.load failed ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise _bad(rel, f"holds a {type(obj).__name__}, expected a dict of tensors")
    tensors: dict[str, np.ndarray] = {}
    for name, aliases in _PT_ALIASES.items():
        for a in aliases:
            t = obj.get(a)
            if isinstance(t, torch.Tensor):
                if t.dtype == torch.bfloat16:
                    raise _bad(rel, f"{name} is bfloat16, expected float32", "TENSOR_DTYPE_INVALID")
                tensors[name] = t.detach().cpu().numpy()
                break
    return _finish(rel, round_, rank, tensors, check_dtypes=True)


_NP_TO_ST = {np.dtype(v): k for k, v in _ST_DTYPES.items() if v is not None}


def _finish(rel: str, round_: int, rank: int, t: dict[str, np.ndarray], check_dtypes: bool = False) -> TrainData:
    """A file held in memory (legacy ``.pt``) as a :class:`TrainData` whose chunks slice its arrays."""
    if check_dtypes:
        _check_structure(
            rel,
            {k: _NP_TO_ST.get(v.dtype, str(v.dtype)) for k, v in t.items()},
            {k: v.shape for k, v in t.items()},
        )
    flat = {k: np.ascontiguousarray(t[k]).reshape(-1) for k in NAMES}
    mask = flat["response_mask"]
    if mask.dtype != np.bool_:
        if mask.size and int(mask.max(initial=0)) > 1:
            bad = int(np.count_nonzero(mask > 1))
            raise _bad(rel, f"response_mask has {bad} value(s) other than 0 and 1", "MASK_INVALID")
        flat["response_mask"] = mask.astype(bool)
    shape = t["response_mask"].shape

    def chunks(size: int) -> Iterator[Chunk]:
        for start in range(0, mask.size, size):
            sl = slice(start, start + size)
            yield Chunk(start, flat["token_ids"][sl], flat["response_mask"][sl], flat["rollout_logprobs"][sl],
                        flat["train_logprobs"][sl])

    return TrainData(rel, round_, rank, (int(shape[0]), int(shape[1])), t.get("rewards"), t.get("advantages"),
                     chunks)
