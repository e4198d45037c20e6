"""rlk-megatron-provider: the train side of rlk's routes inside Megatron-core.

Importing has no side effects. :func:`initialize_from_environment` is the init hook an orchestrator
calls (e.g. through ``--custom-megatron-init-path``); this version has no train-side rlk layers yet,
so it refuses plans that ask for them instead of pretending.
"""

from __future__ import annotations

import logging

__version__ = "0.1.0"
log = logging.getLogger("rlk.megatron")


def initialize_from_environment() -> None:
    """Install the train side of the route plan read from ``RL_KERNEL_*``.

    All train sides ``P``: no-op (Megatron stays as built). Any train side ``R``: raises
    :class:`~rlk_core.errors.RlkPolicyError` in strict mode, logs the missing route in audit mode.
    """
    from rlk_core import envs
    from rlk_core.errors import RlkPolicyError
    from rlk_core.plan import MODULES, RoutePlan

    plan = RoutePlan.from_env()
    wanted = [m for m in MODULES if plan.uses_rlk(m, "train")]
    if wanted:
        message = (f"rlk-megatron-provider {__version__} cannot install rlk train routes yet; "
                   f"plan asks R on the train side of: {', '.join(wanted)}")
        if envs.get("RL_KERNEL_MODE") == "strict":
            raise RlkPolicyError(message)
        log.warning("rlk audit: %s (Megatron production layers stay in place)", message)
