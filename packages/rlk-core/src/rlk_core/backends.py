"""One small registry that selects, per op, the backend that runs an rlk contract.

Built-in backends register themselves when their op module is imported. Other packages add
backends without editing rlk-core through the ``rlk.backends`` entry-point group: the entry point
names a module (or object) that implements the pluggy hook :func:`RlkBackendSpec.rlk_register_backends`
and calls ``registry.register(Backend(...))``. A backend that is not built in must pass its
contract's invariance checks (:mod:`rlk_core.testing.qualify`) on the device before strict mode
accepts it; ``RLK_BACKENDS=op=backend_id`` forces one backend for A/B tests.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from rlk_core import envs
from rlk_core.contracts import OP_CONTRACTS
from rlk_core.errors import RlkBackendError

hookspec = pluggy.HookspecMarker("rlk")
hookimpl = pluggy.HookimplMarker("rlk")
ENTRY_POINT_GROUP = "rlk.backends"


class RlkBackendSpec:
    @hookspec
    def rlk_register_backends(self, registry: BackendRegistry) -> None:
        """Register :class:`Backend` objects with ``registry.register``."""


def _always(*args: Any) -> tuple[bool, str]:
    return True, ""


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
    contract_id: str = field(init=False)

    def __post_init__(self) -> None:
        if self.op not in OP_CONTRACTS:
            raise RlkBackendError(f"backend {self.id!r} names unknown op {self.op!r}; known: {sorted(OP_CONTRACTS)}")
        self.contract_id = OP_CONTRACTS[self.op]


@dataclass(frozen=True)
class Selection:
    backend: Backend
    fallback_reason: str | None  # why a preferred backend did not run, or None


class BackendRegistry:
    def __init__(self) -> None:
        self._backends: dict[str, dict[str, Backend]] = {op: {} for op in OP_CONTRACTS}
        self._available: dict[tuple[str, str], tuple[bool, str]] = {}
        self._qualified: dict[tuple[str, str, str], tuple[bool, str]] = {}
        self._plugins_loaded = False
        self._lock = threading.Lock()
        self.plugin_manager = pluggy.PluginManager("rlk")
        self.plugin_manager.add_hookspecs(RlkBackendSpec)

    # -- registration -------------------------------------------------------------------------
    def register(self, backend: Backend, *, replace: bool = False) -> Backend:
        existing = self._backends[backend.op].get(backend.id)
        if existing is not None and not replace:
            raise RlkBackendError(f"backend {backend.id!r} is already registered for op {backend.op!r}")
        self._backends[backend.op][backend.id] = backend
        return backend

    def unregister(self, op: str, backend_id: str) -> None:
        self._backends[op].pop(backend_id, None)
        self._qualified = {k: v for k, v in self._qualified.items() if k[1] != backend_id}

    def load_plugins(self, force: bool = False) -> list[str]:
        """Load entry-point plug-ins once; returns the names of plug-ins loaded by this call."""
        with self._lock:
            if self._plugins_loaded and not force:
                return []
            self._plugins_loaded = True
        before = {name for name, _ in self.plugin_manager.list_name_plugin()}
        self.plugin_manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
        new = [n for n, _ in self.plugin_manager.list_name_plugin() if n not in before]
        for name in new:
            self.plugin_manager.get_plugin(name).rlk_register_backends(registry=self)
        return new

    def add_plugin(self, plugin: object, name: str | None = None) -> None:
        """Register an in-process plug-in object (tests, notebooks) and run its hook."""
        self.plugin_manager.register(plugin, name=name)
        plugin.rlk_register_backends(registry=self)  # type: ignore[attr-defined]

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
        forced = envs.get("RLK_BACKENDS").get(op)
        if forced is not None:
            backend = self.get(op, forced)
            ok, why = self.is_available(backend, device_type)
            if not ok:
                raise RlkBackendError(f"RLK_BACKENDS forces {forced!r} for {op!r} but it is unavailable: {why}")
            return [backend]
        return [b for b in self.backends(op) if self.is_available(b, device_type)[0]]

    # -- qualification (third-party backends) -----------------------------------------------------
    def qualify(self, backend: Backend, device_type: str) -> tuple[bool, str]:
        key = (backend.op, backend.id, device_type)
        if backend.builtin:
            return True, "built-in (checked by rlk's own test suite)"
        if key not in self._qualified:
            from rlk_core.testing.qualify import qualify_backend

            self._qualified[key] = qualify_backend(backend, device_type)
        return self._qualified[key]

    def select(self, op: str, device_type: str, args: Sequence[Any], strict: bool) -> Selection:
        reasons: list[str] = []
        for backend in self.candidates(op, device_type):
            ok, why = backend.supports(*args)
            if ok:
                qualified, qwhy = self.qualify(backend, device_type)
                if not qualified:
                    if strict:
                        raise RlkBackendError(
                            f"backend {backend.id!r} ({backend.origin}) claims {backend.contract_id} for op "
                            f"{op!r} but failed its invariance checks on {device_type}: {qwhy}"
                        )
                    reasons.append(f"{backend.id}: not qualified ({qwhy})")
                    continue
                return Selection(backend, "; ".join(reasons) or None)
            reasons.append(f"{backend.id}: {why}")
        raise RlkBackendError(
            f"no backend can run op {op!r} on {device_type}: " + ("; ".join(reasons) or "none registered")
        )

    def _ensure_plugins(self) -> None:
        if not self._plugins_loaded and envs.get("RLK_LOAD_PLUGINS"):
            self.load_plugins()


REGISTRY = BackendRegistry()
