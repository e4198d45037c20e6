"""The attribution's per-layer dumps: what one side computed at every operator of the same sequences, and the
comparison that names the first point where the two sides' bits part.

A *dump* is engine-independent: for each *point* (a label such as ``layers.3.attention.core``) the rows one side
computed there, each row keyed by ``(sequence, position)``. Points come in forward order
(:data:`LAYER_POINTS` per layer, then :data:`FINAL_POINTS`); ``residual_in`` / ``residual_mid`` / ``final.residual``
are the residual stream (the input of the layer's first norm, of its post-attention norm and of the final norm),
the rest each operator's output. The local engine fills a dump through an operator tap
(:mod:`rlk_repro.attribute_local`); a framework engine would fill the same structure from forward hooks on its
modules (``docs/attribution.md`` says which hooks) and hand it to :func:`compare_dumps` unchanged.

On disk (:func:`save_dump` / :func:`load_dump`): one safetensors file per side, tensor ``<point>`` ``[N, ...]`` in
the dump's dtype and ``<point>.rows`` ``[N, 2]`` int64 ``(sequence, position)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlk_repro._tensorio import bits, read_checked

DUMP_SCHEMA = "rlk.attribution-dump.v1"

#: the points of one decoder layer in forward order, and the module each belongs to
LAYER_POINTS: tuple[tuple[str, str], ...] = (
    ("residual_in", "residual"),
    ("attention.input_norm", "attention"),
    ("attention.qkv", "attention"),
    ("attention.q_norm", "attention"),
    ("attention.k_norm", "attention"),
    ("attention.rope_q", "attention"),
    ("attention.rope_k", "attention"),
    ("attention.core", "attention"),
    ("attention.o_proj", "attention"),
    ("residual_mid", "residual"),
    ("ffn.post_norm", "ffn"),
    ("ffn.gate_up", "ffn"),
    ("ffn.swiglu", "ffn"),
    ("ffn.down", "ffn"),
)
FINAL_POINTS: tuple[tuple[str, str], ...] = (("final.residual", "residual"), ("final.norm", "logp"),
                                             ("final.logits", "logp"), ("final.logprobs", "logp"))


def point_order(num_layers: int) -> list[tuple[str, str]]:
    """Every point of a ``num_layers`` stack in forward order, with its module."""
    out = [(f"layers.{i}.{name}", module) for i in range(num_layers) for name, module in LAYER_POINTS]
    return out + list(FINAL_POINTS)


@dataclass
class Dump:
    """One side's tensors per point, row by row: ``points[label][(seq, pos)] = tensor``; ``ops[label]`` the
    operator names that side ran there (``attention_varlen``, ``attention_decode``, ...)."""

    side: str
    points: dict[str, dict[tuple[int, int], torch.Tensor]] = field(default_factory=dict)
    ops: dict[str, set[str]] = field(default_factory=dict)

    def add(self, label: str, ops: set[str], keys: list[tuple[int, int]], rows: torch.Tensor) -> None:
        store = self.points.setdefault(label, {})
        self.ops.setdefault(label, set()).update(ops)
        detached = rows.detach().cpu()
        for i, key in enumerate(keys):
            store[key] = detached[i].clone()

    def stacked(self, label: str, keys: list[tuple[int, int]]) -> torch.Tensor:
        store = self.points[label]
        return torch.stack([store[k] for k in keys])


def save_dump(dump: Dump, path: Path) -> None:
    tensors: dict[str, torch.Tensor] = {}
    for label, store in dump.points.items():
        keys = sorted(store)
        tensors[label] = torch.stack([store[k] for k in keys]).contiguous()
        tensors[f"{label}.rows"] = torch.tensor(keys, dtype=torch.int64).reshape(-1, 2)
    ops = ";".join(f"{label}={','.join(sorted(names))}" for label, names in sorted(dump.ops.items()))
    save_file(tensors, str(path), metadata={"schema": DUMP_SCHEMA, "side": dump.side, "ops": ops})


def load_dump(path: Path) -> Dump:
    tensors, meta = read_checked(path, DUMP_SCHEMA)
    dump = Dump(meta["side"])
    for label in (k for k in tensors if not k.endswith(".rows")):
        keys = [tuple(r) for r in tensors[f"{label}.rows"].tolist()]
        dump.points[label] = {k: tensors[label][i] for i, k in enumerate(keys)}
    for item in filter(None, meta.get("ops", "").split(";")):
        label, names = item.split("=", 1)
        dump.ops[label] = set(names.split(","))
    return dump


def diff_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, Any]:
    """Bitwise and numerical comparison of two same-shape tensors (differences in float64)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return {"comparable": False, "why": f"shape/dtype {tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"}
    neq = bits(a) != bits(b)
    d = (a.double() - b.double()).abs()
    finite = d[torch.isfinite(d)]
    scale = b.double().abs()
    rel = finite.max() / scale.max().clamp_min(1e-300) if finite.numel() else torch.tensor(0.0)
    return {"comparable": True, "equal": bool(torch.equal(bits(a), bits(b))), "elements": int(a.numel()),
            "mismatches": int(neq.sum()), "mismatch_fraction": float(neq.float().mean()) if a.numel() else 0.0,
            "max_abs_diff": float(finite.max()) if finite.numel() else 0.0,
            "mean_abs_diff": float(finite.mean()) if finite.numel() else 0.0,
            "max_rel_diff": float(rel), "nonfinite_diffs": int(d.numel() - finite.numel())}


def first_differing_row(a: torch.Tensor, b: torch.Tensor, keys: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The ``(sequence, position)`` of the first row (in key order) whose bits differ."""
    rows = (bits(a) != bits(b)).reshape(a.shape[0], -1).any(-1)
    idx = torch.nonzero(rows).flatten()
    return keys[int(idx[0])] if idx.numel() else None


def compare_dumps(train: Dump, rollout: Dump, num_layers: int) -> dict[str, Any]:
    """Walk the points in forward order over the rows both sides computed: the first point whose bits differ is
    the boundary (every point before it agrees bit for bit, so its inputs did); per layer, how the residual stream's
    difference grows. Points a side did not dump are listed as ``missing`` (never taken for agreement)."""
    rows_out, missing, boundary = [], [], None
    growth: list[dict[str, Any]] = []
    for label, module in point_order(num_layers):
        if label not in train.points or label not in rollout.points:
            missing.append(label)
            continue
        keys = sorted(set(train.points[label]) & set(rollout.points[label]))
        if not keys:
            missing.append(label)
            continue
        a, b = train.stacked(label, keys), rollout.stacked(label, keys)
        st = diff_stats(a, b)
        row = {"point": label, "module": module, "rows": len(keys),
               "train_ops": sorted(train.ops.get(label, ())), "rollout_ops": sorted(rollout.ops.get(label, ())), **st}
        rows_out.append(row)
        if boundary is None and not st.get("equal", False):
            boundary = {**row, "first_row": first_differing_row(a, b, keys) if st["comparable"] else None}
        if label.endswith("residual_in") or label.endswith("residual_mid") or label == "final.residual":
            growth.append({"point": label, **{k: st.get(k) for k in ("equal", "mismatch_fraction", "max_abs_diff",
                                                                      "mean_abs_diff", "max_rel_diff")}})
    return {"points": rows_out, "missing": missing, "boundary": boundary, "residual_growth": growth}


def layer_of(label: str) -> int | None:
    parts = label.split(".")
    return int(parts[1]) if parts[0] == "layers" else None


def operator_of(label: str) -> str:
    """``layers.3.attention.core`` -> ``attention.core``; ``final.norm`` stays."""
    parts = label.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else label
