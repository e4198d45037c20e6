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



def gloo_world_of_one() -> None:
    """A subprocess test's start: :func:`cpu_recipe`, then a one-rank gloo process group on a free local port (what
    megatron-core's parallel state is initialised over on the CPU)."""
    import socket

    import torch.distributed as dist

    cpu_recipe()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

def hybrid_final_norm_without_te() -> None:
    """megatron-core 0.19's ``HybridStack`` builds its final norm as ``TENorm``, which raises without
    Transformer Engine: point that name at Megatron's local torch norm (``WrappedTorchNorm``, the norm of
    the local spec), so that a HybridModel whose logp module is P (stock final norm) builds on a CPU. The
    provider's own final norm (an R logp) needs no stand-in. Process-wide; tests only."""
    import megatron.core.models.hybrid.hybrid_block as hb
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    hb.TENorm = WrappedTorchNorm
