"""The plugin's per-process state: the plan, the readback recorder, the route calls the hooks make.

One :class:`Runtime` per process (``register()`` creates it; a forked child that inherits it gets its own
recorder on first use, so readbacks never share a pid). Hooks call :func:`rlk` / :func:`production`;
they hold no arithmetic. Readbacks are flushed at exit, after each model load and by :func:`flush`.

Compiled code (vLLM's ``torch.compile``, CUDA graphs): a hook runs as Python only while TorchDynamo traces
it; at run time the graph calls ``torch.ops.rlk.*`` (or vLLM's own ops) with no module scope, so no run-time
call can be counted. Instead each hook, while traced, records the call site it puts into the graph
(TorchDynamo's ``comptime``: a callback run at trace time, a no-op otherwise): module, op, and for an rlk op
the backend the registry selects for the traced tensors' dtype, device and shape. These records have
execution mode ``graph`` and ``provenance.counted = "compiled call sites"``
(:meth:`rlk_core.readback.ReadbackRecorder.count_compiled`): one per call site per compiled graph, never a
number of executions. A process whose compiled model comes from vLLM's compile cache traces nothing and
records no compiled call sites.
"""

from __future__ import annotations

import atexit
import multiprocessing.util
import os
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

try:  # TorchDynamo's trace-time callback (torch >= 2.0); without it compiled call sites go unrecorded
    from torch._dynamo.comptime import comptime as _comptime
except ImportError:  # pragma: no cover - every supported torch has it
    _comptime = None

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
    _sites: dict[str, Any] = field(default_factory=dict)
    _r: dict[str, bool] = field(default_factory=dict)  # r(module) for the plan in _r_plan
    _r_plan: RoutePlan | None = None
    tp_leaves: int = 0  # RL_KERNEL_TP_INVARIANT (G; 0: off), read once with the plan: hooks read no environment
    kept_export: bool = False  # RL_KERNEL_VLLM_KEPT_EXPORT: the kept sets' side channel (logprobs.export_step)

    @classmethod
    def from_env(cls) -> Runtime:
        return cls(plan=RoutePlan.from_env(), mode=envs.get("RL_KERNEL_MODE"),
                   unfiltered_logprobs=envs.get("RL_KERNEL_VLLM_UNFILTERED_LOGPROBS"),
                   attention_override=envs.get("RL_KERNEL_VLLM_ATTENTION_OVERRIDE"),
                   tp_leaves=envs.get("RL_KERNEL_TP_INVARIANT"), kept_export=envs.get("RL_KERNEL_VLLM_KEPT_EXPORT"))

    @property
    def strict(self) -> bool:
        return self.mode == "strict"

    def wanted(self) -> list[str]:
        return [m for m in MODULES if self.plan.uses_rlk(m, SIDE)]

    def r(self, module: str | None) -> bool:
        """Whether ``module`` is R on the rollout side (asked by every hook call: a dict lookup)."""
        if module is None:
            return False
        if self._r_plan is not self.plan:
            self._r, self._r_plan = {m: self.plan.uses_rlk(m, SIDE) for m in MODULES}, self.plan
        r = self._r.get(module)
        return self.plan.uses_rlk(module, SIDE) if r is None else r

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
        routes = self._routes
        if routes is not None and self._pid == os.getpid():
            return routes
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


def rlk(module: str, op: str, *args: Any, **kwargs: Any) -> Any:
    """Run rlk op ``op`` for ``module`` (R). Under ``torch.compile`` tracing the op goes in as the opaque
    ``torch.ops.rlk.<op>`` and the call site is recorded (see the module docstring); eager calls run in the
    module's readback scope and report their backend themselves."""
    if torch.compiler.is_compiling():
        if _comptime is not None:
            _comptime(_rlk_site)
        return getattr(torch.ops.rlk, op)(*args)
    return get().routes.call(module, op, *args, **kwargs)


def _rlk_site(ctx: Any) -> None:
    """Trace time (TorchDynamo), inside :func:`rlk`: record the rlk call site going into the graph."""
    module, op = ctx.get_local("module").as_python_constant(), ctx.get_local("op").as_python_constant()
    if not _new_site(module, op):
        return
    try:
        values = [_traced_value(v) for v in ctx.get_local("args").as_proxy()]
    except Exception as exc:  # dynamo internals moved: say so, never guess a backend
        import logging
        logging.getLogger("rlk.vllm").warning("rlk: could not read the traced inputs of %s.%s (%s: %s); this "
                                              "compiled call site is not recorded", module, op,
                                              type(exc).__name__, exc)
        return
    note_compiled_rlk(module, op, values)


def note_compiled_rlk(module: str, op: str, values: list[Any]) -> None:
    """Record one compiled call site of rlk op ``op`` for ``module`` whose traced inputs are ``values``
    (fake / meta tensors, SymInts or constants): the backend is the one the registry selects for their
    dtype, device and shape, as the op will when it runs."""
    from rlk_core.backends import REGISTRY

    rt = get()
    device = next((v.device for v in _flat(values) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    selection = REGISTRY.select(op, device.type, [_stand_in(v) for v in values], strict=rt.strict)
    backend = selection.backend
    rt.recorder.count_compiled(module, op, backend.id, backend.contract_id, fallback_reason=selection.fallback_reason)


def _production_site(ctx: Any) -> None:
    """Trace time (TorchDynamo), inside :func:`production`: record vLLM's own op going into the graph."""
    module, op = ctx.get_local("module").as_python_constant(), ctx.get_local("op").as_python_constant()
    if _new_site(module, op):
        get().recorder.count_compiled(module, op, ctx.get_local("backend_id").as_python_constant(), None)


def _new_site(module: str, op: str) -> bool:
    """False when TorchDynamo re-traces a frame (a restarted analysis) and this site was recorded by the
    earlier attempt: sites are numbered per compiled frame, the numbering restarts with each attempt."""
    try:
        from torch._guards import CompileContext
        trace = CompileContext.current_trace_id()
    except ImportError:  # pragma: no cover
        trace = None
    if trace is None:
        return True
    sites = get()._sites
    frame = str(trace.compile_id)
    attempt, index = sites.get(frame, (trace.attempt, 0))
    if attempt != trace.attempt:
        index = 0
    sites[frame] = (trace.attempt, index + 1)
    key = (frame, index, module, op)
    if key in sites:
        return False
    sites[key] = True
    return True


def _traced_value(v: Any) -> Any:
    node = getattr(v, "node", None)
    if isinstance(v, torch.fx.Proxy) and node is not None:
        return node.meta.get("example_value")
    if isinstance(v, (list, tuple)):
        return type(v)(_traced_value(x) for x in v)
    return v


def _flat(values: Any) -> list[Any]:
    if isinstance(values, (list, tuple)):
        return [x for v in values for x in _flat(v)]
    return [values]


def _hint(d: Any) -> int:
    if isinstance(d, int):
        return d
    try:
        from torch.fx.experimental.symbolic_shapes import hint_int
        return int(hint_int(d, fallback=1))
    except Exception:  # an unbacked size without a hint
        return 1


def _stand_in(v: Any) -> Any:
    """A meta tensor with ``v``'s dtype and (hinted) shape for a traced tensor, so that a backend's
    ``supports`` reads no symbolic size (that would add a guard to the graph being traced)."""
    if isinstance(v, torch.Tensor):
        return torch.empty([_hint(d) for d in v.shape], dtype=v.dtype, device="meta")
    if isinstance(v, (list, tuple)):
        return type(v)(_stand_in(x) for x in v)
    if isinstance(v, torch.SymInt):
        return _hint(v)
    if isinstance(v, torch.SymFloat):
        return float(v.node.hint) if v.node.hint is not None else 1.0
    return v


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
    """Count one call of vLLM's own implementation (a P module); under ``torch.compile`` tracing, record the
    compiled call site instead (see the module docstring)."""
    if module is None:
        return
    if torch.compiler.is_compiling():
        if _comptime is not None:
            _comptime(_production_site)
        return
    get().routes.production(module, op, backend_id)


def _flush_at_exit() -> None:
    rt = _RUNTIME
    if rt is not None and rt._recorder is not None and rt._pid == os.getpid():
        rt.flush()


#: how often a process's flusher thread writes its readback when its counts changed since the last write
FLUSH_EVERY_S = 2.0
_AT_EXIT = False
_FLUSHER_PID = -1


class _Holder:
    """What ``multiprocessing.util.register_after_fork`` keys its callback on (it needs an object)."""


_HOLDER = _Holder()


def _flusher() -> None:
    """Daemon thread: write the readback when what it records changed (a dict walk every FLUSH_EVERY_S; nothing on
    the hook path), so a process that ends without running an exit hook still leaves what it ran."""
    import json
    import logging

    last = None
    while True:
        time.sleep(FLUSH_EVERY_S)
        rt = _RUNTIME
        if rt is None or rt._recorder is None or rt._pid != os.getpid():
            continue
        try:
            doc = rt._recorder.to_dict()
            now = json.dumps([doc["modules"], doc["hooks"]], sort_keys=True, default=str)
            if now != last:
                rt.flush()
                last = now
        except Exception as exc:  # never take the process down; say it once per kind
            logging.getLogger("rlk.vllm").warning("rlk: periodic readback flush failed: %s: %s",
                                                  type(exc).__name__, exc)


def _arm_process() -> None:
    """This process's exit flush and flusher thread: a ``multiprocessing`` finalizer (vLLM's engine core and its
    workers are multiprocessing children, which end in ``os._exit`` after the finalizers and never run ``atexit``)
    and the thread. Once per process."""
    global _FLUSHER_PID
    if _FLUSHER_PID == os.getpid():
        return
    _FLUSHER_PID = os.getpid()
    multiprocessing.util.Finalize(_HOLDER, _flush_at_exit, exitpriority=100)
    threading.Thread(target=_flusher, name="rlk-readback-flusher", daemon=True).start()


def flush_at_exit() -> None:
    """Flush this process's readback whenever and however it ends, whatever the process layout (registered once,
    by ``register()``): ``atexit`` (an interpreter that exits), a multiprocessing finalizer (vLLM's
    ``VLLM_ENABLE_V1_MULTIPROCESSING=1`` engine core and executor workers), and a flusher thread writing changed
    counts every :data:`FLUSH_EVERY_S` seconds (a process killed before either). A forked child arms its own (a
    fork copies no thread, and multiprocessing clears the finalizers a child inherits); a spawned one runs
    ``register()`` itself."""
    global _AT_EXIT
    if _AT_EXIT:
        return
    _AT_EXIT = True
    atexit.register(_flush_at_exit)
    _arm_process()
    os.register_at_fork(after_in_child=_arm_process)  # any fork (threads do not survive one)
    multiprocessing.util.register_after_fork(_HOLDER, lambda _: _arm_process_again())  # after mp's clear


def _arm_process_again() -> None:
    """A multiprocessing child: after it cleared the finalizers it inherited, register this process's again."""
    multiprocessing.util.Finalize(_HOLDER, _flush_at_exit, exitpriority=100)


def patch(cls: type, attr: str, make) -> bool:
    """``cls.attr = make(cls.attr)`` unless already patched (the wrapper keeps the original as ``_rlk_original``);
    whether it patched. Each patch's target, reason and removal are in ``PATCHES.md``."""
    current = getattr(cls, attr)
    if getattr(current, "_rlk_original", None) is not None:
        return False
    setattr(cls, attr, make(current))
    return True


def unpatch(cls: type, attr: str) -> None:
    """Put ``cls.attr``'s original back where :func:`patch` replaced it."""
    original = getattr(getattr(cls, attr), "_rlk_original", None)
    if original is not None:
        setattr(cls, attr, original)
