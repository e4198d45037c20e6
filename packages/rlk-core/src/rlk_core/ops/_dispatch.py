"""Backend choice inside an op: select from the registry, run, report to the readback scope."""

from __future__ import annotations

from typing import Any

import torch

from rlk_core.backends import REGISTRY
from rlk_core.readback import note_op_call, strict_now


def run(op: str, device: torch.device, *args: Any) -> Any:
    selection = REGISTRY.select(op, device.type, args, strict=strict_now())
    backend = selection.backend
    mode = "graph" if device.type == "cuda" and torch.cuda.is_current_stream_capturing() else "eager"
    note_op_call(op, backend.id, backend.contract_id, selection.fallback_reason, mode)
    return backend.fn(*args)
