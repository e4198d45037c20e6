"""Test-only vLLM platform plugin: the CPU platform when ``VLLM_TARGET_DEVICE=cpu``, else nothing."""

import os


def cpu_platform() -> str | None:
    return "vllm.platforms.cpu.CpuPlatform" if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" else None
