"""The plugin's own environment variables, in rlk-core's table format.

These belong in :data:`rlk_core.envs.ENV_VARS` (one table for every ``RL_KERNEL_*`` variable); until rlk-core
declares them, they are declared here, once, with the same :class:`~rlk_core.envs.EnvVar` parser objects,
and :func:`get` prefers rlk-core's declaration where it exists.
"""

from __future__ import annotations

from typing import Any

from rlk_core import envs

_ATTENTION_MEMBERS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN")


def _bool(raw: str, var: envs.EnvVar) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise var.error(raw)


def _member(raw: str, var: envs.EnvVar) -> str:
    value = raw.strip().upper()
    if value not in _ATTENTION_MEMBERS:
        raise var.error(raw)
    return value


PLUGIN_VARS: tuple[envs.EnvVar, ...] = (
    envs.EnvVar("RL_KERNEL_VLLM_UNFILTERED_LOGPROBS", _bool, False,
                "vLLM, logp R: accept requests with top-p / top-k / min-p / penalties / logit bias; their "
                "returned log-probs are then the unfiltered log softmax(logits / T) (the trainer's), not vLLM's "
                "processed ones. Unset: strict mode refuses such requests.", ("1", "0", "true", "false")),
    envs.EnvVar("RL_KERNEL_VLLM_ATTENTION_OVERRIDE", _member, None,
                "vLLM, attention R, for launchers that cannot pass --attention-backend CUSTOM: register rlk's "
                "backend under this existing backend name as well (e.g. FLASH_ATTN, the default on Hopper).",
                _ATTENTION_MEMBERS),
)
_BY_NAME = {v.name: v for v in PLUGIN_VARS}


def get(name: str, env: Any = None) -> Any:
    try:
        return envs.get(name, env)
    except KeyError:
        return _BY_NAME[name].parse(envs.environ(env).get(name))
