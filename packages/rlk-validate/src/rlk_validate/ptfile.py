"""Reading a ``torch.save`` file without torch: tensors as numpy arrays, nothing executed.

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (a pickle whose tensors are calls of
``torch._utils._rebuild_tensor_v2`` on *persistent* storages ``('storage', torch.<T>Storage, key, location, numel)``)
and one member ``<name>/data/<key>`` per storage holding its elements, little-endian (``<name>/byteorder``).
:func:`load` reads that with an unpickler that resolves exactly those globals (and ``collections.OrderedDict``)
and refuses every other one — so a file cannot run code, unlike ``torch.load(weights_only=False)`` — and bounds
what it reads. A tensor becomes a C-contiguous numpy array of its elements (its offset, sizes and strides applied;
``bfloat16`` widened to ``float32``, which is exact). Lists, tuples, dicts, numbers, strings, bytes and None come
back as themselves.
"""

from __future__ import annotations

import io
import pickle
import zipfile
from collections import OrderedDict
from typing import Any

import numpy as np

#: torch storage class -> numpy dtype of its elements (bfloat16: raw uint16, widened on load)
STORAGES: dict[str, Any] = {
    "FloatStorage": np.float32, "DoubleStorage": np.float64, "HalfStorage": np.float16, "BFloat16Storage": np.uint16,
    "LongStorage": np.int64, "IntStorage": np.int32, "ShortStorage": np.int16, "CharStorage": np.int8,
    "ByteStorage": np.uint8, "BoolStorage": np.bool_,
}
MAX_PICKLE_BYTES = 64 << 20
MAX_BYTES = 4 << 30


class PtProblem(Exception):
    """The file is not a ``torch.save`` archive this reader takes (one line)."""


class _Storage:
    __slots__ = ("dtype", "key", "name", "numel")

    def __init__(self, name: str, key: str, numel: int) -> None:
        self.name, self.dtype, self.key, self.numel = name, np.dtype(STORAGES[name]), key, numel


class _Rebuilt:
    """A tensor as the pickle describes it, materialised after unpickling (:func:`_materialise`)."""

    __slots__ = ("offset", "size", "storage", "stride")

    def __init__(self, storage: _Storage, offset: int, size: tuple, stride: tuple) -> None:
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride


def _rebuild_tensor_v2(storage: Any, storage_offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> _Rebuilt:
    if not isinstance(storage, _Storage):
        raise PtProblem("a tensor is not built on a storage of the archive")
    ints = (storage_offset, *size, *stride)
    if (not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) != len(stride)
            or not all(type(v) is int and v >= 0 for v in ints)):
        raise PtProblem(f"a tensor has an unreadable layout (offset {storage_offset!r}, size {size!r}, "
                        f"stride {stride!r})")
    return _Rebuilt(storage, storage_offset, size, stride)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch" and name in STORAGES:
            return name
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise PtProblem(f"the pickle names {module}.{name}, which a torch.save of tensors and plain values does "
                        "not hold: refused (nothing was run)")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in STORAGES
                and type(pid[2]) is str and pid[2].isalnum() and type(pid[4]) is int and pid[4] >= 0):
            raise PtProblem(f"unknown persistent id {str(pid)[:80]}")
        return _Storage(pid[1], pid[2], pid[4])


def _materialise(obj: Any, read: Any, depth: int = 0) -> Any:
    if depth > 64:
        raise PtProblem("nested deeper than 64 levels")
    if isinstance(obj, _Rebuilt):
        return read(obj)
    if isinstance(obj, dict):
        return {k: _materialise(v, read, depth + 1) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_materialise(v, read, depth + 1) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_materialise(v, read, depth + 1) for v in obj)
    if isinstance(obj, _Storage):
        raise PtProblem("a bare storage outside a tensor")
    return obj


def load(path: str, max_bytes: int = MAX_BYTES) -> Any:
    """The object a ``torch.save`` archive at ``path`` holds, tensors as numpy arrays (see the module doc)."""
    try:
        zf = zipfile.ZipFile(path)
    except (OSError, zipfile.BadZipFile) as e:
        raise PtProblem(f"not a torch.save zip archive ({e})") from None
    with zf:
        names = zf.namelist()
        pkls = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pkls) != 1:
            raise PtProblem("the archive holds no single <name>/data.pkl")
        prefix = pkls[0][: -len("data.pkl")]
        if prefix + "byteorder" in names and zf.read(prefix + "byteorder").strip() not in (b"little", b""):
            raise PtProblem("the archive is big-endian")
        infos = {i.filename: i for i in zf.infolist()}
        if infos[pkls[0]].file_size > MAX_PICKLE_BYTES:
            raise PtProblem(f"data.pkl is larger than {MAX_PICKLE_BYTES >> 20} MiB")
        if sum(i.file_size for i in infos.values()) > max_bytes:
            raise PtProblem(f"the archive unpacks to more than {max_bytes >> 20} MiB")
        try:
            tree = _Unpickler(io.BytesIO(zf.read(pkls[0]))).load()
        except PtProblem:
            raise
        except Exception as e:  # a corrupt pickle: any of pickle's many errors
            raise PtProblem(f"data.pkl does not unpickle ({type(e).__name__}: {e})") from None
        cache: dict[str, np.ndarray] = {}

        def storage(s: _Storage) -> np.ndarray:
            if s.key not in cache:
                member = prefix + "data/" + s.key
                if member not in infos:
                    raise PtProblem(f"storage {s.key} is missing from the archive")
                raw = zf.read(member)
                if len(raw) != s.numel * s.dtype.itemsize:
                    raise PtProblem(f"storage {s.key} holds {len(raw)} bytes, not {s.numel} {s.name} elements")
                cache[s.key] = np.frombuffer(raw, dtype=s.dtype.newbyteorder("<"))
            return cache[s.key]

        def read(t: _Rebuilt) -> np.ndarray:
            flat = storage(t.storage)
            last = t.offset + sum((n - 1) * st for n, st in zip(t.size, t.stride, strict=True) if n > 0)
            if any(n == 0 for n in t.size):
                out = np.zeros(t.size, dtype=flat.dtype)
            elif last >= flat.size:
                raise PtProblem(f"a tensor reaches element {last} of a storage of {flat.size}")
            else:
                item = flat.dtype.itemsize
                out = np.lib.stride_tricks.as_strided(flat[t.offset:], shape=t.size,
                                                      strides=tuple(st * item for st in t.stride)).copy()
            if t.storage.name == "BFloat16Storage":
                out = (out.astype(np.uint32) << 16).view(np.float32)
            return out  # a fresh C-contiguous array (a 0-d tensor stays 0-d)

        return _materialise(tree, read)
