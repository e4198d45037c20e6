"""Two small helpers of the attribution's files and comparisons (:mod:`rlk_repro.attribute_dumps`,
:mod:`rlk_repro.abtest`): a schema-checked safetensors read and a float tensor's bit pattern."""

from __future__ import annotations

from pathlib import Path

import torch

_INTS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
         torch.float64: torch.int64}


def read_checked(path: Path, schema: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file whose metadata names ``schema``; ValueError otherwise."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), "pt") as fh:
        meta = fh.metadata() or {}
    if meta.get("schema") != schema:
        raise ValueError(f"{path}: not an {schema} file (schema {meta.get('schema')!r})")
    return load_file(str(path)), meta


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit pattern as integers (other dtypes as they are): ``torch.equal`` on it is bitwise
    equality (NaNs with equal payloads equal, +0 and -0 not)."""
    t = t.detach().contiguous()
    return t.view(_INTS[t.dtype]) if t.dtype in _INTS else t
