"""Test-only vLLM platform plugin: the CPU platform when ``RLK_TEST_VLLM_CPU_PLATFORM=1`` (or
``VLLM_TARGET_DEVICE=cpu``), else nothing.

Selected by its own variable: vLLM 0.33 treats ``VLLM_TARGET_DEVICE=cpu`` as authoritative and returns its own
``CpuPlatform`` without consulting platform plugins (``resolve_current_platform_cls_qualname``), while 0.22
ignores that variable at run time (shared/reference/vllm.md §12.2). ``tests/vllm`` sets
``RLK_TEST_VLLM_CPU_PLATFORM=1`` and leaves ``VLLM_TARGET_DEVICE`` unset, so both versions run this platform;
``VLLM_TARGET_DEVICE=cpu`` still selects it on 0.22 (other suites set that).

The platform is vLLM's ``CpuPlatform`` with one difference, because this install is vLLM's CUDA wheel on a
CPU machine, with none of vLLM's compiled CPU ops (``torch.ops._C.*``): vLLM 0.33 packs each bf16 linear
weight for its sgl-kernel GEMM whenever the CPU has AMX tiles (``check_cpu_sgl_kernel``, no environment
switch; 0.22 only under ``VLLM_CPU_SGL_KERNEL=1``), and the packing op is one of those missing ops. The
platform makes that check also ask whether the ops exist — as vLLM itself does for its oneDNN GEMM
(``_custom_ops._supports_onednn``) — so a CPU with AMX takes the path a CPU without AMX takes: the weight
stays a plain tensor and the GEMM is ``torch.nn.functional.linear``.
"""

import os

PLATFORM = "rlk_test_vllm_cpu_platform.TestCpuPlatform"
_SGL_OPS = ("convert_weight_packed", "weight_packed_linear")


def cpu_platform() -> str | None:
    wanted = os.environ.get("RLK_TEST_VLLM_CPU_PLATFORM") == "1" or os.environ.get("VLLM_TARGET_DEVICE") == "cpu"
    return PLATFORM if wanted else None


def _gate_sgl_gemm_on_its_ops() -> None:
    import torch
    from vllm.model_executor.layers import utils

    check = getattr(utils, "check_cpu_sgl_kernel", None)
    if check is None or getattr(check, "_rlk_test_gated", False):
        return
    if all(hasattr(torch.ops._C, op) for op in _SGL_OPS):
        return

    def gated(n, k, dtype):
        return False  # the sgl-kernel GEMM's ops are not in this vLLM install

    gated._rlk_test_gated = True
    utils.check_cpu_sgl_kernel = gated


def __getattr__(name: str):
    # built on first use, when vLLM resolves PLATFORM (importing vLLM's platform module while vLLM is still
    # loading platform plugins is not needed to answer cpu_platform())
    if name != "TestCpuPlatform":
        raise AttributeError(name)
    from vllm.platforms.cpu import CpuPlatform

    class TestCpuPlatform(CpuPlatform):
        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:  # runs for every VllmConfig, before any model
            super().check_and_update_config(vllm_config)
            _gate_sgl_gemm_on_its_ops()

    globals()["TestCpuPlatform"] = TestCpuPlatform
    return TestCpuPlatform
