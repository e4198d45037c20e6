"""rlk-vllm-plugin: the rollout side of rlk's routes inside vLLM.

``register`` is the ``vllm.general_plugins`` entry point. It is idempotent and imports nothing from
vLLM at module import time. This version has no rollout-side rlk operators yet, so it refuses plans
that ask for them instead of pretending (see :func:`register`).
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"
log = logging.getLogger("rlk.vllm")
_REGISTERED = False


def register() -> None:
    """vLLM general-plugin entry point: install the rollout side of the route plan.

    With every rollout side ``P`` this is a no-op (vLLM stays exactly as built). A rollout side of ``R``
    raises :class:`~rlk_core.errors.RlkPolicyError` in strict mode — the vLLM operator replacements are
    not part of this version — and logs the missing route in audit mode.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    from rlk_core import envs
    from rlk_core.errors import RlkPolicyError
    from rlk_core.plan import MODULES, RoutePlan

    plan = RoutePlan.from_env()
    wanted = [m for m in MODULES if plan.uses_rlk(m, "rollout")]
    if wanted:
        message = (f"rlk-vllm-plugin {__version__} cannot install rlk rollout routes yet; "
                   f"plan asks R on the rollout side of: {', '.join(wanted)}")
        if envs.get("RL_KERNEL_MODE") == "strict":
            raise RlkPolicyError(message)
        log.warning("rlk audit: %s (vLLM production operators stay in place)", message)
    _REGISTERED = True
