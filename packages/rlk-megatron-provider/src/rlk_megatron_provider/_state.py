"""The provider's per-process state: the route plan, the readback recorder, the train-side routes.

Built once by :func:`rlk_megatron_provider.initialize_from_environment` (idempotent); the layers look it
up at call time. ``refuse`` is the one fail-closed path: strict mode raises naming the module and the
reason; audit mode records the fallback in the readback and the module runs Megatron's own layers.
"""

from __future__ import annotations

import atexit
import logging
import threading
from dataclasses import dataclass, field

from rlk_core.errors import RlkConfigError, RlkPolicyError
from rlk_core.plan import MODULES, RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.routes import SideRoutes

log = logging.getLogger("rlk.megatron")
PRODUCTION = "production.megatron"


@dataclass
class ProviderState:
    plan: RoutePlan
    recorder: ReadbackRecorder
    routes: SideRoutes
    fallen_back: dict[str, str] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return self.recorder.mode

    def rlk(self, module: str) -> bool:
        """Whether ``module`` runs rlk here: R in the plan and not fallen back (audit mode)."""
        return self.routes.rlk(module) and module not in self.fallen_back

    def refuse(self, module: str, reason: str) -> bool:
        """An R route of ``module`` cannot be installed: raise (strict) or record the fallback (audit).

        Returns False (the module keeps Megatron's layers) in audit mode."""
        message = f"rlk-megatron-provider cannot install the R route of module {module!r}: {reason}"
        if self.mode == "strict":
            raise RlkPolicyError(message)
        if module not in self.fallen_back:
            self.fallen_back[module] = reason
            self.recorder.count(module, "install", PRODUCTION, None, fallback_reason=reason)
        return False


_STATE: ProviderState | None = None
_LOCK = threading.Lock()


def build(plan: RoutePlan, mode: str | None, rank: int, world_size: int) -> ProviderState:
    global _STATE
    with _LOCK:
        if _STATE is not None:
            if _STATE.plan != plan:
                raise RlkConfigError(f"rlk-megatron-provider is installed with plan {_STATE.plan.name}; "
                                     f"asked again with {plan.name} in the same process")
            return _STATE
        recorder = ReadbackRecorder("megatron", "train", plan, mode=mode, rank=rank, world_size=world_size)
        _STATE = ProviderState(plan, recorder, SideRoutes(plan, "train", recorder))
        atexit.register(_flush_at_exit)
        log.info("rlk-megatron-provider: plan %s (%s mode), R on the train side: %s", plan.name,
                 recorder.mode, ", ".join(m for m in MODULES if plan.uses_rlk(m, "train")) or "none")
        return _STATE


def get() -> ProviderState:
    if _STATE is None:
        raise RlkConfigError("rlk-megatron-provider is not installed in this process: call "
                             "rlk_megatron_provider.initialize_from_environment() (or install(args)) first")
    return _STATE


def current() -> ProviderState | None:
    return _STATE


def reset() -> None:
    """Forget the state (tests that switch plans in one process)."""
    global _STATE
    with _LOCK:
        _STATE = None


def _flush_at_exit() -> None:
    st = _STATE
    if st is not None:
        try:
            st.recorder.flush()
        except OSError as exc:  # the process is ending; say so rather than lose it silently
            log.error("rlk-megatron-provider: readback not written: %s", exc)
