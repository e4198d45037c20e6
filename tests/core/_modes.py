"""A dispatch mode for the op-layer tests: it records each operator the dispatcher hands it, then runs it."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class Spy(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
