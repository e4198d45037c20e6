"""Evidence of vLLM's CUDA graphs: the settings, the graphs captured and every step's graph decision.

Target: ``vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.dispatch`` (Model Runner V2, vLLM 0.22's runner for
Qwen3). Why: a run that asks for ``FULL_DECODE_ONLY`` graphs with exact capture sizes (the seeds' profile) claims
every decode step replayed a graph of its own batch size; nothing else in vLLM says which steps did. How: the
method is wrapped (counting only: its result is returned unchanged); per process the wrapper counts each
``(graph mode, graph size, batch tokens, requests, uniform decode)`` it returns, and keeps the managers it saw so
that the settings (``compilation_config.mode``, ``cudagraph_mode``, ``cudagraph_capture_sizes``) and the
captured graphs (``manager.graphs``, filled by ``capture``) are read when the readback is written. ``dispatch``
decides the step: the model runner replays ``manager.graphs[desc]`` exactly when it returns a ``FULL``
descriptor, and runs eagerly (or piecewise) otherwise. Upstream status: no such counter upstream. Remove when
vLLM reports replays per size itself.

The readback's ``cuda_graphs`` field (:func:`section`), checked by :mod:`rlk_validate.cuda_graphs`::

    {"recorded": true, "runner": "v2", "target": ..., "settings": {"compilation_mode", "cudagraph_mode",
     "capture_sizes", "decode_query_len", "max_num_reqs"}, "captured": [{"mode", "num_tokens", "num_reqs",
     "uniform_token_count"}], "dispatch": [{"mode", "graph_tokens", "batch_tokens", "num_reqs", "decode",
     "count"}]}

``recorded: false`` with a ``reason`` where the installed vLLM has no such target (the validator then has no
evidence, and says so).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import Counter
from typing import Any

from rlk_core.readback import add_section

TARGET = "vllm.v1.worker.gpu.cudagraph_utils:CudaGraphManager.dispatch"
_MARK = "__rlk_cudagraph_original__"


class GraphRecord:
    """One process's counts (reset when the pid changes: a forked child starts from nothing)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reason: str | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every count and manager (a new process; tests)."""
        self.pid = os.getpid()
        self.steps: Counter[tuple[str, int, int, int, bool]] = Counter()
        self.managers: weakref.WeakSet[Any] = weakref.WeakSet()

    def note(self, manager: Any, num_reqs: int, num_tokens: int, uniform: int | None, desc: Any) -> None:
        if self.pid != os.getpid():
            self.reset()
        decode = uniform is not None and uniform == getattr(manager, "decode_query_len", 1)
        key = (_mode(desc.cg_mode), int(desc.num_tokens), int(num_tokens), int(num_reqs), decode)
        with self.lock:
            self.steps[key] += 1
            if manager not in self.managers:
                self.managers.add(manager)

    def doc(self) -> dict[str, Any]:
        if self.reason is not None:
            return {"recorded": False, "reason": self.reason, "target": TARGET}
        with self.lock:
            managers = list(self.managers) if self.pid == os.getpid() else []
            steps = dict(self.steps) if self.pid == os.getpid() else {}
        settings, captured = None, []
        for m in managers:
            settings = settings or _settings(m)
            captured += [{"mode": _mode(d.cg_mode), "num_tokens": int(d.num_tokens),
                          "num_reqs": None if d.num_reqs is None else int(d.num_reqs),
                          "uniform_token_count": None if d.uniform_token_count is None else int(d.uniform_token_count)}
                         for d in getattr(m, "graphs", {})]
        return {"recorded": True, "runner": "v2", "target": TARGET, "settings": settings,
                "captured": sorted(captured, key=lambda c: (c["mode"], c["num_tokens"])),
                "dispatch": [{"mode": k[0], "graph_tokens": k[1], "batch_tokens": k[2], "num_reqs": k[3],
                              "decode": k[4], "count": n} for k, n in sorted(steps.items())]}


def _mode(mode: Any) -> str:
    return getattr(mode, "name", str(mode))


def _settings(manager: Any) -> dict[str, Any]:
    cc = manager.compilation_config
    sizes = cc.cudagraph_capture_sizes
    return {"compilation_mode": _mode(cc.mode), "cudagraph_mode": _mode(manager.cudagraph_mode),
            "capture_sizes": None if sizes is None else sorted(int(s) for s in sizes),
            "decode_query_len": int(manager.decode_query_len), "max_num_reqs": int(manager.max_num_reqs)}


RECORD = GraphRecord()


def install() -> str | None:
    """Wrap ``CudaGraphManager.dispatch`` once and put the ``cuda_graphs`` section into this process's vLLM
    readbacks; returns the target, or None where the installed vLLM has none (the section then says so)."""
    from rlk_vllm_plugin import _compat

    add_section("vllm", "cuda_graphs", RECORD.doc)
    try:
        cls = _compat.module("vllm.v1.worker.gpu.cudagraph_utils").CudaGraphManager
        original = vars(cls)["dispatch"]
    except (ImportError, AttributeError, KeyError) as exc:
        RECORD.reason = f"{TARGET} is not in this vLLM ({type(exc).__name__}: {exc})"
        return None
    if getattr(original, _MARK, None) is not None:
        return TARGET

    # 0.22: dispatch(num_reqs, num_tokens, uniform_token_count); 0.33 adds num_active_loras (required),
    # max_query_len and num_ubatches, and calls it by keyword: the three it records are found by name.
    names = ("num_reqs", "num_tokens", "uniform_token_count")
    lacking = [n for n in names if n not in _compat.parameters(original)]
    if lacking:
        RECORD.reason = f"{TARGET} has no parameter {', '.join(lacking)} in this vLLM"
        return None
    num_reqs, num_tokens, uniform = (_compat.argument(original, n) for n in names)

    def dispatch(self: Any, *args: Any, **kwargs: Any) -> Any:
        desc = original(self, *args, **kwargs)
        call = (self, *args)
        RECORD.note(self, num_reqs(call, kwargs), num_tokens(call, kwargs), uniform(call, kwargs), desc)
        return desc

    setattr(dispatch, _MARK, original)
    dispatch.__wrapped__ = original  # type: ignore[attr-defined]
    cls.dispatch = dispatch
    return TARGET


def uninstall() -> None:
    """Put vLLM's own ``dispatch`` back (tests)."""
    try:
        from rlk_vllm_plugin import _compat

        cls = _compat.module("vllm.v1.worker.gpu.cudagraph_utils").CudaGraphManager
    except (ImportError, AttributeError):
        return
    original = getattr(vars(cls).get("dispatch"), _MARK, None)
    if original is not None:
        cls.dispatch = original
