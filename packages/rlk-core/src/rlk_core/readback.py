"""Readbacks: the evidence of which implementation actually ran, and the fail-closed policy.

A :class:`ReadbackRecorder` belongs to one (framework, target, process). Code that runs a module
opens a scope (``with recorder.scope("ffn"):``); every rlk op called inside reports its backend to
that scope, and production code reports itself with :meth:`ReadbackRecorder.production`. Counting is
an in-memory dict update — nothing touches the filesystem per call. :meth:`ReadbackRecorder.flush`
writes ``rlk.readback.v1`` JSON atomically through the evidence formats' one writer
(:func:`rlk_validate.evidence.write_json_atomic`) as ``<framework>-<target>-<pid>.json``; the schema id,
vocabularies and file name come from :mod:`rlk_validate.evidence`, which the validator checks against.
Where the directory comes from ``RL_KERNEL_READBACK_DIR`` (the one variable every process of a run, on
every node, shares), the file goes into its ``<hostname>/`` folder — pids are unique per host only, and
the validator reads ``readbacks/<hostname>/`` as one node's readbacks; a directory the code passes
(``directory=``) is used as given.
The route line is logged once per (module, op, backend).

Annotations: beside the op records, an adapter keeps per-process observations of its own under a topic —
counters (:meth:`ReadbackRecorder.tally`) and marks (:meth:`ReadbackRecorder.annotate`), written as the
readback's ``annotations`` (e.g. the vLLM plugin's ``sampling``: requests by kind, and whether the log-probs it
served are comparable with training). In-memory updates, like counting.

Policy: on an ``R`` side any fallback raises :class:`~rlk_core.errors.RlkPolicyError` in strict mode
and is recorded in audit mode; an rlk backend reported on a ``P`` side is an error in strict mode.
"""

from __future__ import annotations

import contextvars
import logging
import math
import os
import re
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from rlk_core import envs
from rlk_core.errors import RlkConfigError, RlkPolicyError
from rlk_core.plan import MODULES, SIDES, RoutePlan
from rlk_validate import evidence
from rlk_validate.evidence import FRAMEWORKS, TARGETS

SCHEMA = evidence.READBACK_SCHEMA
log = logging.getLogger("rlk")


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _OpRecord:
    backend_id: str
    contract_id: str | None
    call_count: int = 0
    modes: set[str] = field(default_factory=set)
    fallback: bool = False
    fallback_reason: str | None = None
    provenance: dict[str, Any] = field(default_factory=dict)
    compiled_sites: int = 0  # of call_count: call sites compiled into a graph (count_compiled)

    def provenance_doc(self) -> dict[str, Any]:
        out = dict(self.provenance)
        if self.compiled_sites:
            out["compiled_call_sites"] = self.compiled_sites
            out["counted"] = (COUNTED_COMPILED if self.compiled_sites == self.call_count
                              else "run-time calls and compiled call sites")
        return out


#: ``provenance.counted`` of an op record whose every count is a call site compiled into a graph
#: (:meth:`ReadbackRecorder.count_compiled`), not a run-time call.
COUNTED_COMPILED = "compiled call sites"


@dataclass
class _Scope:
    recorder: ReadbackRecorder
    module: str


_ACTIVE: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("rlk_readback_scope", default=None)


class _ScopeContext:
    """``with recorder.scope(module):`` — a plain context manager (a ``contextlib`` generator costs a few
    microseconds per use, and frameworks open one scope per rlk op call)."""

    __slots__ = ("_scope", "_token")

    def __init__(self, scope: _Scope) -> None:
        self._scope = scope

    def __enter__(self) -> ReadbackRecorder:
        self._token = _ACTIVE.set(self._scope)
        return self._scope.recorder

    def __exit__(self, *exc: object) -> None:
        _ACTIVE.reset(self._token)


def call_in(scope: _Scope, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` inside ``scope`` (:meth:`ReadbackRecorder.scope_of`): ``with recorder.scope(m):`` as
    one Python call, for callers that open a scope per rlk op call."""
    token = _ACTIVE.set(scope)
    try:
        return fn(*args, **kwargs)
    finally:
        _ACTIVE.reset(token)


class ReadbackRecorder:
    def __init__(
        self,
        framework: str,
        side: str,
        plan: RoutePlan,
        *,
        mode: str | None = None,
        directory: str | os.PathLike[str] | None = None,
        run_id: str | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if framework not in FRAMEWORKS:
            raise RlkConfigError(f"framework {framework!r} is not one of {', '.join(FRAMEWORKS)}")
        if side not in SIDES:
            raise RlkConfigError(f"side {side!r} is not one of {', '.join(SIDES)}")
        self.framework, self.side, self.plan = framework, side, plan
        self.target = TARGETS[side]
        self.mode = mode if mode is not None else envs.get("RL_KERNEL_MODE")
        if self.mode not in envs.MODES:
            raise RlkConfigError(f"mode {self.mode!r} is not one of {', '.join(envs.MODES)}")
        self.hostname = socket.gethostname()
        if directory is None and envs.get("RL_KERNEL_READBACK_DIR") is not None:
            directory = Path(envs.get("RL_KERNEL_READBACK_DIR")) / self.hostname  # shared by nodes
        self.directory = Path(directory) if directory is not None else None
        self.run_id = run_id if run_id is not None else envs.get("RL_KERNEL_RUN_ID")
        self.rank, self.world_size = rank, world_size
        self.pid = os.getpid()
        self.created_at = _now()
        self.hooks: list[dict[str, Any]] = []
        self._ops: dict[str, dict[str, _OpRecord]] = {m: {} for m in MODULES}
        self._logged: set[tuple[str, str, str]] = set()
        # reports that passed the policy, by (module, op, backend, contract, mode): a repeat only counts
        self._checked: dict[tuple[str, str, str, str | None, str], _OpRecord] = {}
        self._lock = threading.Lock()
        self._scopes = {m: _Scope(self, m) for m in MODULES}
        self._digest: dict[str, Any] | None = None  # the contract digest handshake's record (rlk_core.digest)
        self._annotations: dict[str, dict[str, Any]] = {}  # topic -> {"counts": {name: n}, mark: value} (tally)

    # -- scopes and counting ----------------------------------------------------------------------
    def scope(self, module: str) -> _ScopeContext:
        """Context manager: rlk ops called inside report to this recorder under ``module``."""
        return _ScopeContext(self.scope_of(module))

    def scope_of(self, module: str) -> _Scope:
        """The scope :meth:`scope` activates for ``module`` (for :func:`call_in`)."""
        scope = self._scopes.get(module)
        if scope is None:
            raise RlkConfigError(f"module {module!r} is not one of {', '.join(MODULES)}")
        return scope

    def add_hook(self, name: str, target: str, kind: str, installed: bool = True) -> None:
        self.hooks.append({"name": name, "target": target, "kind": kind, "installed": installed})

    def count(
        self,
        module: str,
        op: str,
        backend_id: str,
        contract_id: str | None,
        *,
        fallback_reason: str | None = None,
        execution_mode: str = "eager",
        provenance: dict[str, Any] | None = None,
        route_reason: str | None = None,
    ) -> None:
        """Count one call of ``op`` in ``module``. ``route_reason``: why the registry's preferred backend did not
        run it (a ``same_bits_as`` peer did, no fallback) — the first one per backend is kept in the op record's
        ``provenance.route_reasons``, so a readback says why e.g. rlk.triton ran calls beside rlk.cuda."""
        if fallback_reason is None and not provenance and self._repeat(module, op, backend_id, contract_id,
                                                                        execution_mode):
            return
        letter = self.plan.letter(module, self.side)
        is_rlk = backend_id.startswith("rlk.") or contract_id is not None
        if letter == "P" and is_rlk:
            self._violation(f"{self.framework} {self.side} side of {module} is P (production) but op {op!r} "
                            f"ran rlk backend {backend_id!r}")
        if letter == "R" and fallback_reason is not None:
            self._violation(f"{self.framework} {self.side} side of {module} is R but op {op!r} fell back to "
                            f"{backend_id!r}: {fallback_reason}")
        if letter == "R" and not is_rlk:
            self._violation(f"{self.framework} {self.side} side of {module} is R but op {op!r} ran the "
                            f"production implementation {backend_id!r}")
        key = (module, op, backend_id)
        violation = (letter == "P" and is_rlk) or (letter == "R" and (fallback_reason is not None or not is_rlk))
        with self._lock:
            rec = self._ops[module].get(op)
            if rec is None or (rec.backend_id != backend_id and rec.call_count == 0):
                rec = self._ops[module][op] = _OpRecord(backend_id, contract_id)
            elif rec.backend_id != backend_id:
                rec.provenance.setdefault("other_backends", {})
                other = rec.provenance["other_backends"]
                other[backend_id] = other.get(backend_id, 0) + 1
            rec.call_count += 1
            rec.modes.add(execution_mode)
            if route_reason is not None:
                rec.provenance.setdefault("route_reasons", {}).setdefault(backend_id, route_reason[:400])
            if fallback_reason is not None:
                rec.fallback, rec.fallback_reason = True, fallback_reason
            if provenance:
                rec.provenance.update(provenance)
            if not violation and fallback_reason is None and rec.backend_id == backend_id \
                    and rec.contract_id == contract_id:
                self._checked[(module, op, backend_id, contract_id, execution_mode)] = rec
            first = key not in self._logged
            self._logged.add(key)
        if first:
            log.info("rlk route: %s/%s %s.%s [%s] -> %s (%s)%s", self.framework, self.side, module, op, letter,
                     backend_id, contract_id or "production",
                     f" FALLBACK: {fallback_reason}" if fallback_reason else "")

    def _repeat(self, module: str, op: str, backend_id: str, contract_id: str | None, execution_mode: str) -> bool:
        """Count a report (no fallback, no provenance) that passed the policy before and is the op's main
        record — nothing else changes — and say so; False where :meth:`count` has to look at it."""
        rec = self._checked.get((module, op, backend_id, contract_id, execution_mode))
        if rec is None:
            return False
        with self._lock:
            rec.call_count += 1
        return True

    def repeat_record(self, module: str, op: str, backend_id: str, contract_id: str | None,
                      execution_mode: str) -> _OpRecord | None:
        """The record whose ``call_count`` :meth:`_repeat` raises for such a report, or None where a report of it
        still has to go through :meth:`count` (the fast path of :mod:`rlk_core.ops._dispatch` counts into it)."""
        return self._checked.get((module, op, backend_id, contract_id, execution_mode))

    def count_compiled(self, module: str, op: str, backend_id: str, contract_id: str | None, *,
                       fallback_reason: str | None = None) -> None:
        """Count one call site of ``op`` that a compiler (``torch.compile``) put into a graph for ``module``.

        For code whose run-time calls nobody can count (a compiled graph, replayed CUDA graphs): the record
        gets execution mode ``graph`` and ``provenance.counted`` says the count is of compiled call sites
        (``provenance.compiled_call_sites`` how many of ``call_count`` they are), never of run-time calls.
        The policy is :meth:`count`'s."""
        self.count(module, op, backend_id, contract_id, fallback_reason=fallback_reason, execution_mode="graph")
        with self._lock:
            self._ops[module][op].compiled_sites += 1

    def production(self, module: str, op: str, backend_id: str, execution_mode: str = "eager") -> None:
        """Report one call of the framework's own implementation (a P side)."""
        if not backend_id.startswith("production."):
            raise RlkConfigError(f"production backend ids start with 'production.', got {backend_id!r}")
        self.count(module, op, backend_id, None, execution_mode=execution_mode)

    def _violation(self, message: str) -> None:
        if self.mode == "strict":
            raise RlkPolicyError(message)
        log.warning("rlk audit: %s", message)

    def record_digest(self, digest: str, document: dict[str, Any], detail: dict[str, Any], at: str) -> None:
        """One check of the contract digest handshake (:func:`rlk_core.digest.handshake`): the first keeps the
        digest, its document and this side's detail; every check is listed with the digest it found."""
        with self._lock:
            if self._digest is None:
                self._digest = {"digest": digest, "document": document, "detail": detail, "checks": []}
            self._digest["checks"].append({"at": at, "digest": digest})

    # -- annotations: what an adapter observed, per process -------------------------------------------
    def tally(self, topic: str, **counts: int) -> None:
        """Add ``counts`` (integers >= 0) to ``annotations[topic]["counts"]`` of this process's readback: counters an
        adapter keeps beside the op records (the vLLM plugin's ``sampling``: requests by kind). ``topic`` and the
        names are ``[a-z][a-z0-9_]*`` (at most 64 characters); an in-memory update."""
        _check_name(topic, "annotation topic")
        for name, n in counts.items():
            _check_name(name, f"count of annotation {topic!r}")
            if type(n) is not int or n < 0:
                raise RlkConfigError(f"annotation {topic!r}: count {name!r} must be an integer >= 0, got {n!r}")
        with self._lock:
            into = self._annotations.setdefault(topic, {}).setdefault("counts", {})
            for name, n in counts.items():
                into[name] = into.get(name, 0) + n

    def annotate(self, topic: str, *, replace: bool = True, **marks: Any) -> None:
        """Set ``annotations[topic][key] = value`` for each mark, a JSON scalar (string, bool, integer, finite float
        or None): e.g. ``comparable=False, reason="..."``. A later mark of the same key replaces it; with
        ``replace=False`` only keys not yet set are set (a default that a later mark may change)."""
        _check_name(topic, "annotation topic")
        for key, value in marks.items():
            _check_name(key, f"mark of annotation {topic!r}")
            if key == "counts":
                raise RlkConfigError(f"annotation {topic!r}: 'counts' holds the tallies (tally), it is no mark")
            finite = type(value) is float and math.isfinite(value)
            if not (value is None or type(value) in (str, bool, int) or finite):
                raise RlkConfigError(f"annotation {topic!r}: mark {key!r} must be a JSON scalar (str, bool, int, "
                                     f"finite float, None), got {type(value).__name__}")
        with self._lock:
            into = self._annotations.setdefault(topic, {})
            for key, value in marks.items():
                if replace or key not in into:
                    into[key] = value

    # -- the document -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        modules: dict[str, Any] = {}
        with self._lock:
            for module in MODULES:
                ops = self._ops[module]
                if not ops:
                    continue
                main = max(ops.values(), key=lambda r: r.call_count)
                modes = set().union(*(r.modes for r in ops.values()))
                fallbacks = [f"{op}: {r.fallback_reason}" for op, r in ops.items() if r.fallback]
                modules[module] = {
                    "case": self.plan.letter(module, self.side),
                    "implementation": self.plan.implementation(module, self.side),
                    "backend_id": main.backend_id,
                    "contract_id": main.contract_id,
                    "call_count": sum(r.call_count for r in ops.values()),
                    "execution_mode": modes.pop() if len(modes) == 1 else "mixed",
                    "fallback": bool(fallbacks),
                    "fallback_reason": "; ".join(fallbacks) or None,
                    "ops": {
                        op: {
                            "backend_id": r.backend_id,
                            "contract_id": r.contract_id,
                            "call_count": r.call_count,
                            "execution_mode": next(iter(r.modes)) if len(r.modes) == 1 else "mixed",
                            "fallback": r.fallback,
                            "fallback_reason": r.fallback_reason,
                            "provenance": r.provenance_doc(),
                        }
                        for op, r in sorted(ops.items())
                    },
                }
        out = {
            "schema": SCHEMA,
            "framework": self.framework,
            "target": self.target,
            "side": self.side,
            "pid": self.pid,
            "rank": self.rank,
            "world_size": self.world_size,
            "hostname": self.hostname,
            "run_id": self.run_id,
            "mode": self.mode,
            "created_at": self.created_at,
            "updated_at": _now(),
            "plan": self.plan.as_dict(),
            "hooks": list(self.hooks),
            "modules": modules,
            **{name: fn() for name, fn in _SECTIONS.get(self.framework, {}).items()},  # add_section
        }
        with self._lock:
            if self._annotations:
                out["annotations"] = {t: {k: dict(v) if k == "counts" else v for k, v in a.items()}
                                      for t, a in sorted(self._annotations.items())}
        if self._digest is not None:
            with self._lock:
                out["contract_digest"] = {**self._digest, "checks": list(self._digest["checks"])}
        return out

    @property
    def filename(self) -> str:
        return evidence.readback_name(self.framework, self.target, self.pid)

    def flush(self, directory: str | os.PathLike[str] | None = None) -> Path | None:
        """Write the readback atomically into ``directory`` (default: the recorder's, see the module doc);
        returns its path (None when no directory is configured)."""
        target_dir = Path(directory) if directory is not None else self.directory
        if target_dir is None:
            return None
        target_dir.mkdir(parents=True, exist_ok=True)
        path = target_dir / self.filename
        evidence.write_json_atomic(path, self.to_dict(), sort_keys=True)
        return path


_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")


def _check_name(name: Any, what: str) -> None:
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise RlkConfigError(f"{what} {name!r} is not a name ([a-z][a-z0-9_]*, at most 64 characters)")


#: framework -> {top-level readback field: a function giving its value at each write} (:func:`add_section`)
_SECTIONS: dict[str, dict[str, Callable[[], Any]]] = {}
#: the optional top-level fields a section may fill (``rlk.readback.v1``'s JSON Schema lists them)
SECTION_FIELDS = ("cuda_graphs",)


def add_section(framework: str, name: str, fn: Callable[[], Any]) -> None:
    """Every readback of ``framework`` written in this process carries ``name: fn()`` (e.g. the vLLM plugin's
    ``cuda_graphs``: rlk_vllm_plugin.cudagraphs). Idempotent per (framework, name)."""
    if name not in SECTION_FIELDS:
        raise RlkConfigError(f"readback section {name!r} is not one of {', '.join(SECTION_FIELDS)}")
    _SECTIONS.setdefault(framework, {})[name] = fn


def note_op_call(op: str, backend_id: str, contract_id: str, fallback_reason: str | None,
                 execution_mode: str, provenance: dict[str, Any] | None = None,
                 route_reason: str | None = None) -> None:
    """Called by every rlk op and collective once per call: count it in the active scope (with
    ``provenance`` such as a collective's world size, and the selection's ``route_reason``), apply the policy."""
    scope = _ACTIVE.get()
    if scope is not None:
        recorder = scope.recorder
        if fallback_reason is None and provenance is None and recorder._repeat(scope.module, op, backend_id,
                                                                               contract_id, execution_mode):
            return  # count's first step without its keyword arguments (once per op call)
        recorder.count(scope.module, op, backend_id, contract_id, fallback_reason=fallback_reason,
                       execution_mode=execution_mode, provenance=provenance, route_reason=route_reason)
    elif fallback_reason is not None and envs.current("RL_KERNEL_MODE") == "strict":
        raise RlkPolicyError(f"op {op!r} fell back to {backend_id!r} in strict mode: {fallback_reason}")


def active_scope() -> tuple[ReadbackRecorder, str] | None:
    scope = _ACTIVE.get()
    return None if scope is None else (scope.recorder, scope.module)


def strict_now() -> bool:
    scope = _ACTIVE.get()
    return (scope.recorder.mode if scope is not None else envs.current("RL_KERNEL_MODE")) == "strict"


def schema() -> dict[str, Any]:
    """The JSON Schema of ``rlk.readback.v1`` (:func:`rlk_validate.evidence.readback_json_schema`)."""
    return evidence.readback_json_schema()
