"""One small registry that selects, per op, the backend that runs an rlk contract.

Built-in backends register themselves when their op module is imported. Other packages add
backends without editing rlk-core through the ``rlk.backends`` entry-point group: the entry point
names a module (or object) with a function ``rlk_register_backends(registry)`` (or a callable taking the
registry) that calls ``registry.register(Backend(...))``. A backend that is not built in must pass its
contract's invariance checks on the device before strict mode accepts it: :meth:`BackendRegistry.qualify`
runs them (:func:`rlk_core.testing.qualify.qualify_backend`, imported on first use: the suite imports the
ops, which import this registry). ``RLK_BACKENDS=op=backend_id`` forces one backend for A/B tests (and the
op's companions: a forced ``token_logprobs`` backend also runs ``token_logprobs_backward`` and the partials).

Selection is cheap per call: the ordered candidates of each (op, device type) and the
``RLK_BACKENDS`` overrides are computed once per process (:meth:`BackendRegistry.refresh` recomputes
them); what remains per call is each candidate's ``supports(*args)``. Where the first candidate took the
last call and is qualified, the next call asks it alone and, when it accepts again, returns the same
:class:`Selection` (the loop below would reach the same one: the same candidates, the same reasons).

Strict mode never lets a lower-priority backend stand in silently: where the preferred backend for a
device (``rlk.triton`` on CUDA) is registered but unavailable — Triton missing, say — running the next
one is a *fallback*, which an ``R`` side refuses in strict mode and records in audit mode. Otherwise
one side could run ``rlk.reference`` and the other ``rlk.triton``. A backend that runs another backend's
very binaries (``rlk.cuda``: ``rlk.triton``'s kernels compiled ahead of time, launched from C++) declares
``same_bits_as``: where it is unavailable or declines a call and that backend runs instead, nothing can
change bits, so the route is not a fallback (the backend that ran is recorded as always;
:attr:`Selection.route_reason` says why the preferred one did not).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlk_core import envs
from rlk_core.contracts import COMPANION_OF, OP_CONTRACTS
from rlk_core.errors import RlkBackendError

ENTRY_POINT_GROUP = "rlk.backends"
QUALIFY = ("rlk_core.testing.qualify", "qualify_backend")  # the contract suite third-party backends must pass


def _always(*args: Any) -> tuple[bool, str]:
    return _ALWAYS


_ALWAYS = (True, "")  # what _always says (select's fast path does not call it)


@dataclass
class Backend:
    """One implementation of one op under the op's contract id.

    ``available()`` probes the machine once (toolchain, GPU architecture) and returns ``(ok, reason)``;
    ``supports(*args)`` says per call whether this backend handles these inputs (dtype, shape); when
    the preferred backend does not, the next one runs and the call is recorded as a fallback.
    """

    id: str
    op: str
    fn: Callable[..., Any]
    devices: tuple[str, ...]
    priority: int = 0
    available: Callable[[], tuple[bool, str]] = _always
    supports: Callable[..., tuple[bool, str]] = _always
    builtin: bool = False
    origin: str = "rlk-core"
    same_bits_as: str | None = None  # id of a backend whose binaries this one launches (bitwise equal)
    # a launch plan (rlk_core.ops._plan) that ``fn`` runs on the device's JIT plan: the dispatcher calls it with
    # that plan itself, one frame less (set once the plan's module is imported)
    plan_fn: Callable[..., Any] | None = None
    contract_id: str = field(init=False)

    def __post_init__(self) -> None:
        if self.op not in OP_CONTRACTS:
            raise RlkBackendError(f"backend {self.id!r} names unknown op {self.op!r}; known: {sorted(OP_CONTRACTS)}")
        self.contract_id = OP_CONTRACTS[self.op]


@dataclass(frozen=True)
class Selection:
    backend: Backend
    fallback_reason: str | None  # why a preferred backend did not run, or None
    route_reason: str | None = None  # why a bitwise-equal preferred backend (same_bits_as) did not run


def _supports(backend: Backend, args: Sequence[Any]) -> tuple[bool, str]:
    """``backend.supports(*args)``; a backend that launches another's binaries (``same_bits_as``) and cannot
    decide on these inputs — fake tensors at trace time have no data pointer, shapes may be symbolic —
    declines them (the other backend, same bits, answers instead); any other backend's error propagates."""
    try:
        return backend.supports(*args)
    except Exception as exc:
        if backend.same_bits_as is None:
            raise
        return False, f"cannot decide on these inputs ({type(exc).__name__}: {str(exc)[:160]})"


class BackendRegistry:
    def __init__(self) -> None:
        self._backends: dict[str, dict[str, Backend]] = {op: {} for op in OP_CONTRACTS}
        self._available: dict[tuple[str, str], tuple[bool, str]] = {}
        self._qualified: dict[tuple[str, str, str], tuple[bool, str]] = {}
        self._candidates: dict[tuple[str, str], tuple[list[Backend], str | None]] = {}
        # (op, device type) -> the first candidate and the Selection it gave, for select's fast path
        self._first: dict[tuple[str, str], tuple[Backend, Selection]] = {}
        self._forced: dict[str, str] | None = None
        self._plugins_loaded = False
        self._plugins: list[str] = []  # the names of the plug-ins loaded or added
        self._on_change: list[Callable[[], None]] = []  # called whenever what select() decides may change
        self._lock = threading.Lock()

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` whenever what :meth:`select` decides may change (a backend registered or removed, plug-ins
        loaded, :meth:`refresh`): for caches of selections kept elsewhere (the ops' fast path)."""
        self._on_change.append(fn)

    def _changed(self) -> None:
        self._first.clear()
        for fn in self._on_change:
            fn()

    # -- registration -------------------------------------------------------------------------
    def register(self, backend: Backend, *, replace: bool = False) -> Backend:
        existing = self._backends.setdefault(backend.op, {}).get(backend.id)
        if existing is not None and not replace:
            raise RlkBackendError(f"backend {backend.id!r} is already registered for op {backend.op!r}")
        self._backends[backend.op][backend.id] = backend
        self._candidates.clear()
        self._changed()
        return backend

    def unregister(self, op: str, backend_id: str) -> None:
        self._backends[op].pop(backend_id, None)
        self._qualified = {k: v for k, v in self._qualified.items() if k[1] != backend_id}
        self._candidates.clear()
        self._changed()

    def refresh(self) -> None:
        """Forget what was computed once per process: candidates, probes, qualifications, ``RLK_BACKENDS``."""
        self._candidates.clear()
        self._changed()
        self._available.clear()
        self._qualified.clear()
        self._forced = None

    def load_plugins(self, force: bool = False) -> list[str]:
        """Load the ``rlk.backends`` entry points once; returns the names of those loaded by this call."""
        with self._lock:
            if self._plugins_loaded and not force:
                return []
            self._plugins_loaded = True
        new = []
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if ep.name not in self._plugins:
                self.add_plugin(ep.load(), ep.name)
                new.append(ep.name)
        return new

    def add_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register a plug-in: an object (a module) with ``rlk_register_backends(registry)``, or a callable taking
        the registry; in process too (tests, notebooks)."""
        self._ensure_plugins()
        register = getattr(plugin, "rlk_register_backends", plugin)
        if not callable(register):
            raise RlkBackendError(f"plug-in {name or plugin!r} has no rlk_register_backends(registry)")
        register(self)
        self._plugins.append(name or repr(plugin))
        self._candidates.clear()
        self._changed()

    # -- queries ----------------------------------------------------------------------------------
    def backends(self, op: str) -> list[Backend]:
        self._ensure_plugins()
        return sorted(self._backends[op].values(), key=lambda b: (-b.priority, b.id))

    def get(self, op: str, backend_id: str) -> Backend:
        self._ensure_plugins()
        try:
            return self._backends[op][backend_id]
        except KeyError:
            raise RlkBackendError(
                f"no backend {backend_id!r} registered for op {op!r} (contract {OP_CONTRACTS[op]}); "
                f"registered: {', '.join(self._backends[op]) or 'none'}"
            ) from None

    def is_available(self, backend: Backend, device_type: str) -> tuple[bool, str]:
        if device_type not in backend.devices:
            return False, f"device type {device_type!r} not in {backend.devices}"
        key = (backend.op, backend.id)
        if key not in self._available:
            try:
                self._available[key] = backend.available()
            except Exception as exc:  # a probe that crashes is an unavailable backend, with the reason
                self._available[key] = (False, f"probe raised {type(exc).__name__}: {exc}")
        return self._available[key]

    def candidates(self, op: str, device_type: str) -> list[Backend]:
        return list(self._ordered(op, device_type)[0])

    def _ordered(self, op: str, device_type: str) -> tuple[list[Backend], str | None]:
        """The available backends of ``op`` on ``device_type`` in preference order, and why the preferred
        one is missing from them (None when it is there or forced away) — computed once per process."""
        key = (op, device_type)
        hit = self._candidates.get(key)
        if hit is not None:
            return hit
        if self._forced is None:
            self._forced = envs.get("RLK_BACKENDS")
        forced = self._forced.get(op) or self._forced.get(COMPANION_OF.get(op, ""))
        if forced is not None:
            backend = self.get(op, forced)
            ok, why = self.is_available(backend, device_type)
            if not ok:
                raise RlkBackendError(f"RLK_BACKENDS forces {forced!r} for {op!r} but it is unavailable: {why}")
            hit = ([backend], None)
        else:
            registered = [b for b in self.backends(op) if device_type in b.devices]
            available = [b for b in registered if self.is_available(b, device_type)[0]]
            missing = None
            # an unavailable backend whose bits another registered one gives is no loss: skip it
            ids = {b.id for b in available}
            preferred = [b for b in registered if b.id in ids or b.same_bits_as not in ids]
            if preferred and available and available[0] is not preferred[0]:
                first = preferred[0]
                missing = f"{first.id} unavailable: {self.is_available(first, device_type)[1]}"
            hit = (available, missing)
        self._candidates[key] = hit
        return hit

    # -- qualification (third-party backends): rlk_core.testing.qualify, by name ----------------------------------
    def qualify(self, backend: Backend, device_type: str) -> tuple[bool, str]:
        key = (backend.op, backend.id, device_type)
        if backend.builtin:
            return True, "built-in (checked by rlk's own test suite)"
        if key not in self._qualified:
            module, name = QUALIFY
            self._qualified[key] = getattr(importlib.import_module(module), name)(backend, device_type)
        return self._qualified[key]

    def select(self, op: str, device_type: str, args: Sequence[Any],
               strict: bool | Callable[[], bool]) -> Selection:
        """The backend that runs ``op`` on these arguments. ``strict`` (or a function returning it, asked
        only when a backend fails its qualification) says whether an unqualified backend raises."""
        first = self._first.get((op, device_type))
        if first is not None:
            backend, selection = first
            said = _ALWAYS if backend.supports is _always else _supports(backend, args)
            if said[0] and (backend.builtin or self._qualified.get(
                    (backend.op, backend.id, device_type), (False,))[0]):
                return selection
            return self._select(op, device_type, args, strict, said)
        return self._select(op, device_type, args, strict, None)

    def _select(self, op: str, device_type: str, args: Sequence[Any], strict: bool | Callable[[], bool],
                first_said: tuple[bool, str] | None) -> Selection:
        candidates, missing = self._ordered(op, device_type)
        reasons: list[str] = [missing] if missing else []
        declined: list[tuple[Backend, str]] = []  # by backends that declare same_bits_as
        for i, backend in enumerate(candidates):
            ok, why = first_said if i == 0 and first_said is not None else _supports(backend, args)
            if not ok and backend.same_bits_as is not None:
                declined.append((backend, f"{backend.id}: {why}"))
                continue
            if ok:
                qualified, qwhy = self.qualify(backend, device_type)
                if not qualified:
                    if strict() if callable(strict) else strict:
                        raise RlkBackendError(
                            f"backend {backend.id!r} ({backend.origin}) claims {backend.contract_id} for op "
                            f"{op!r} but failed its invariance checks on {device_type}: {qwhy}"
                        )
                    reasons.append(f"{backend.id}: not qualified ({qwhy})")
                    continue
                quiet = [r for b, r in declined if b.same_bits_as == backend.id]
                reasons += [r for b, r in declined if b.same_bits_as != backend.id]
                selection = Selection(backend, "; ".join(reasons) or None, "; ".join(quiet) or None)
                if i == 0:
                    self._first[(op, device_type)] = (backend, selection)
                return selection
            reasons.append(f"{backend.id}: {why}")
        reasons += [r for _, r in declined]
        raise RlkBackendError(
            f"no backend can run op {op!r} on {device_type}: " + ("; ".join(reasons) or "none registered")
        )

    def _ensure_plugins(self) -> None:
        if not self._plugins_loaded and envs.get("RLK_LOAD_PLUGINS"):
            self.load_plugins()


REGISTRY = BackendRegistry()
