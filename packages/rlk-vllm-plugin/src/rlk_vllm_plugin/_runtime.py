"""The plugin's per-process state: the plan, the readback recorder, the route calls the hooks make.

One :class:`Runtime` per process (``register()`` creates it; a forked child that inherits it gets its own
recorder on first use, so readbacks never share a pid). Hooks call :func:`rlk` / :func:`production`;
they hold no arithmetic. Readbacks are flushed at exit, after each model load and by :func:`flush`.
"""

from __future__ import annotations

import atexit
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from rlk_core import envs
from rlk_core.errors import RlkPolicyError
from rlk_core.plan import MODULES, RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.routes import SideRoutes

FRAMEWORK, SIDE = "vllm", "rollout"

# Which module of the route plan a layer belongs to, from its name / prefix in the vLLM model.
_MODULE_RULES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(^|\.)(self_attn|attn|attention)\."), "attention"),
    (re.compile(r"(^|\.)input_layernorm$"), "attention"),
    (re.compile(r"(^|\.)(mlp|feed_forward)\."), "ffn"),
    (re.compile(r"(^|\.)post_attention_layernorm$"), "ffn"),
    (re.compile(r"(^|\.)lm_head$"), "logp"),
    (re.compile(r"^(model\.)?norm$"), "logp"),
)


def module_of(name: str) -> str | None:
    """``attention`` / ``ffn`` / ``logp`` for a layer name such as ``model.layers.0.mlp.gate_up_proj``."""
    for pattern, module in _MODULE_RULES:
        if pattern.search(name):
            return module
    return None


@dataclass
class Runtime:
    plan: RoutePlan
    mode: str
    unfiltered_logprobs: bool
    attention_override: str | None
    hooks: list[tuple[str, str, str]] = field(default_factory=list)
    _pid: int = -1
    _recorder: ReadbackRecorder | None = None
    _routes: SideRoutes | None = None

    @classmethod
    def from_env(cls) -> Runtime:
        return cls(plan=RoutePlan.from_env(), mode=envs.get("RL_KERNEL_MODE"),
                   unfiltered_logprobs=envs.get("RL_KERNEL_VLLM_UNFILTERED_LOGPROBS"),
                   attention_override=envs.get("RL_KERNEL_VLLM_ATTENTION_OVERRIDE"))

    @property
    def strict(self) -> bool:
        return self.mode == "strict"

    def wanted(self) -> list[str]:
        return [m for m in MODULES if self.plan.uses_rlk(m, SIDE)]

    def r(self, module: str | None) -> bool:
        return module is not None and self.plan.uses_rlk(module, SIDE)

    # -- recorder (one per process) -----------------------------------------------------------------
    @property
    def recorder(self) -> ReadbackRecorder:
        if self._recorder is None or self._pid != os.getpid():
            rank, world = _rank()
            self._recorder = ReadbackRecorder(FRAMEWORK, SIDE, self.plan, mode=self.mode, rank=rank,
                                              world_size=world)
            for name, target, kind in self.hooks:
                self._recorder.add_hook(name, target, kind)
            self._routes = SideRoutes(self.plan, SIDE, self._recorder)
            self._pid = os.getpid()
        return self._recorder

    @property
    def routes(self) -> SideRoutes:
        _ = self.recorder
        assert self._routes is not None
        return self._routes

    def add_hook(self, name: str, target: str, kind: str) -> None:
        self.hooks.append((name, target, kind))
        if self._recorder is not None:
            self._recorder.add_hook(name, target, kind)

    def violation(self, message: str) -> None:
        """Strict: raise. Audit: log (the readback records the fallback where an op reports it)."""
        if self.strict:
            raise RlkPolicyError(message)
        import logging
        logging.getLogger("rlk.vllm").warning("rlk audit: %s", message)

    def flush(self) -> None:
        rec = self.recorder
        rec.rank, rec.world_size = _rank()
        rec.flush()


def _rank() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_RUNTIME: Runtime | None = None


def current() -> Runtime | None:
    return _RUNTIME


def install(rt: Runtime | None) -> None:
    global _RUNTIME
    _RUNTIME = rt


def get() -> Runtime:
    if _RUNTIME is None:
        raise RlkPolicyError("rlk-vllm-plugin hook ran but register() has not installed a runtime")
    return _RUNTIME


def rlk(module: str, op: str, *args: Any) -> Any:
    """Run rlk op ``op`` for ``module`` (R). Under ``torch.compile`` tracing the op goes in as the opaque
    ``torch.ops.rlk.<op>`` (it still reports its backend when it runs; the module scope is eager-only)."""
    if torch.compiler.is_compiling():
        return getattr(torch.ops.rlk, op)(*args)
    return get().routes.call(module, op, *args)


_LAST_LINEAR = threading.local()


def note_linear(module: str | None) -> None:
    """The module of the linear layer that ran last in this thread (a row-parallel layer's all-reduce
    follows its GEMM: :mod:`rlk_vllm_plugin.collectives` attributes the reduction to that module)."""
    _LAST_LINEAR.module = module


def take_linear_module() -> str | None:
    module = getattr(_LAST_LINEAR, "module", None)
    _LAST_LINEAR.module = None
    return module


def production(module: str | None, op: str, backend_id: str) -> None:
    """Count one call of vLLM's own implementation (a P module)."""
    if module is None or torch.compiler.is_compiling():
        return
    get().routes.production(module, op, backend_id)


def _flush_at_exit() -> None:
    rt = _RUNTIME
    if rt is not None and rt._recorder is not None and rt._pid == os.getpid():
        rt.flush()


_AT_EXIT = False


def flush_at_exit() -> None:
    """Flush this process's readback when it exits (registered once, by ``register()``)."""
    global _AT_EXIT
    if not _AT_EXIT:
        atexit.register(_flush_at_exit)
        _AT_EXIT = True
