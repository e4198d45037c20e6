"""Which Triton kernels a run compiled, and in which phase of which round: the evidence for "no JIT dip".

Triton calls ``triton.knobs.compilation.listener`` each time its JIT builds a kernel variant the process has
not loaded yet — ``cache_hit=True`` when the binary came from the on-disk cache (milliseconds), ``False`` when
it was compiled (seconds). A round whose phase shows neither ran only kernels it had already loaded (or
``rlk.cuda``'s AOT binaries, which never reach Triton's JIT). :class:`JitWatch` chains the listener it finds
and restores it on :meth:`JitWatch.close`; without Triton it records nothing and says so (``available``).

    watch = JitWatch()
    with watch.phase("rollout"):
        ...
    row["triton_jit"] = watch.take()   # {"rollout": {"compiled": 2, "loaded": 0, "compile_s": 3.1, ...}}
    row["python_gc"] = watch.take_gc()  # {"rollout": {"collections": 40, "seconds": 0.8, "max_s": 0.21, ...}}

The other host pause a round can hide is Python's garbage collector: :meth:`JitWatch.take_gc` reports its
collections per phase (``gc.callbacks``), each generation's count, their summed and longest pause.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

#: kernel names kept per phase in :meth:`JitWatch.take` (the counts are always complete)
MAX_NAMES = 12


class JitWatch:
    def __init__(self) -> None:
        self._events: list[tuple[str, str, bool, float]] = []  # (phase, kernel, cache_hit, seconds)
        self._phase = "setup"
        self._knobs: Any = None
        self._previous: Any = None
        self._gc: list[tuple[str, int, float]] = []  # (phase, generation, seconds) per collection
        self._gc_start = 0.0
        gc.callbacks.append(self._gc_event)
        try:
            import triton
        except ImportError:
            return
        self._knobs = triton.knobs.compilation
        self._previous = self._knobs.listener
        self._knobs.listener = self._listen

    @property
    def available(self) -> bool:
        """Whether Triton is importable (else no compile can happen, and none is recorded)."""
        return self._knobs is not None

    def _listen(self, *, src: Any, metadata: dict[str, Any], metadata_group: Any, times: Any,
                cache_hit: bool) -> None:
        micros = times.ir_initialization + times.total_lowering + times.store_results
        self._events.append((self._phase, describe(src, metadata), bool(cache_hit), micros / 1e6))
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                           cache_hit=cache_hit)

    def _gc_event(self, event: str, info: dict[str, Any]) -> None:
        if event == "start":
            self._gc_start = time.perf_counter()
        else:
            self._gc.append((self._phase, int(info.get("generation", -1)), time.perf_counter() - self._gc_start))

    def take_gc(self) -> dict[str, dict[str, Any]]:
        """Python's garbage collections since the last call, per phase: ``collections``, ``by_generation``
        (``{"0": n, "1": n, "2": n}``), ``seconds`` (their summed pause) and ``max_s`` (the longest); then cleared
        (a watch's owner takes them every round, as it takes the compiles)."""
        events, self._gc = self._gc, []
        out: dict[str, dict[str, Any]] = {}
        for phase, generation, seconds in events:
            p = out.setdefault(phase, {"collections": 0, "by_generation": {}, "seconds": 0.0, "max_s": 0.0})
            p["collections"] += 1
            p["by_generation"][str(generation)] = p["by_generation"].get(str(generation), 0) + 1
            p["seconds"] += seconds
            p["max_s"] = max(p["max_s"], seconds)
        for p in out.values():
            p["seconds"], p["max_s"] = round(p["seconds"], 4), round(p["max_s"], 4)
        return out

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute the compiles inside the block to ``name``."""
        before, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = before

    def take(self) -> dict[str, dict[str, Any]]:
        """The compiles recorded since the last call, per phase: ``compiled`` (fresh compiles), ``loaded`` (from
        Triton's disk cache), ``compile_s`` (their summed compiler time) and the variants of each kind
        (``compiled_kernels``, ``loaded_kernels``: up to :data:`MAX_NAMES` each); the record is then cleared."""
        events, self._events = self._events, []
        out: dict[str, dict[str, Any]] = {}
        for phase, name, hit, seconds in events:
            p = out.setdefault(phase, {"compiled": 0, "loaded": 0, "compile_s": 0.0, "compiled_kernels": [],
                                       "loaded_kernels": []})
            p["loaded" if hit else "compiled"] += 1
            p["compile_s"] += seconds
            names = p["loaded_kernels" if hit else "compiled_kernels"]
            if len(names) < MAX_NAMES:
                names.append(name)
        for p in out.values():
            p["compile_s"] = round(p["compile_s"], 3)
        return out

    def close(self) -> None:
        """Give Triton back the listener it had (if ours is still the one installed); stop watching the GC."""
        if self._knobs is not None and self._knobs.listener == self._listen:
            self._knobs.listener = self._previous
        self._knobs = None
        if self._gc_event in gc.callbacks:
            gc.callbacks.remove(self._gc_event)


def describe(src: Any, metadata: dict[str, Any]) -> str:
    """``kernel[NAME=value, ...]``: a compile's kernel and its constexprs (the variant it is)."""
    name = str(getattr(src, "name", None) or metadata.get("name", "?"))
    try:
        args = src.fn.arg_names
        consts = ", ".join(f"{args[k[0]]}={v}" for k, v in sorted(src.constants.items()) if len(k) == 1)
    except (AttributeError, IndexError, TypeError):
        return name
    return f"{name}[{consts}]" if consts else name


def counts(jit: dict[str, dict[str, Any]] | None, phase: str) -> tuple[int, int]:
    """``(compiled, loaded)`` of one phase of a metrics row's ``triton_jit`` (zeros where absent)."""
    p = (jit or {}).get(phase) or {}
    return int(p.get("compiled", 0)), int(p.get("loaded", 0))
