"""Worker for the megatron tests: a real megatron-core GPTModel on CPU (gloo), one process per rank.

``python _worker.py SPEC_JSON OUT_PATH``: spawns ``tp * cp`` ranks; each applies the CPU recipe of
shared/reference/megatron.md §11 (three monkeypatches — test-only, they stand in for CUDA), builds the
Qwen3-shaped model with the rlk layer spec for the plan in SPEC, loads the converted weights, runs the
packed (THD) or sbhd forward, the rlk log-probs from hidden states and from logits, and one backward;
rank 0 writes the results (``torch.save``) to OUT_PATH.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model


def run(rank: int, spec: dict, port: int, out: str) -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    os.environ.update(spec["env"])
    torch.set_num_threads(1)
    from _cpu import cpu_recipe

    cpu_recipe()
    if spec.get("via") == "hybrid":
        from _cpu import hybrid_final_norm_without_te

        hybrid_final_norm_without_te()  # the stock final norm of a P logp is TE-only
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    world = spec["tp"] * spec["cp"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=spec["tp"],
                                                 context_parallel_size=spec["cp"])
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        torch.manual_seed(0)
        result = _model.run_megatron(spec)
        if rank == 0:
            torch.save(result, out)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main() -> None:
    spec = json.loads(sys.argv[1])
    out = sys.argv[2]
    port = int(spec.get("port", 29511))
    # forkserver: megatron-core (several seconds of imports) is imported once, in the server, not per rank
    mp.set_forkserver_preload(["torch", "megatron.core", "megatron.core.models.gpt"])
    mp.start_processes(run, args=(spec, port, out), nprocs=spec["tp"] * spec["cp"], start_method="forkserver")


if __name__ == "__main__":
    main()
