"""Helpers for running real megatron-core on a CPU in tests and smoke runs (never used in training)."""

from __future__ import annotations


def cpu_recipe() -> None:
    """shared/reference/megatron.md §11: megatron-core's current device and CUDA RNG tracker on the CPU (its
    ``current_device`` and CUDA RNG state functions pointed at the CPU generator). Process-wide; call it
    once, in a process that uses no GPU."""
    import megatron.core.tensor_parallel.random as mrandom
    import torch

    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.manual_seed = torch.manual_seed
