"""Worker for test_host_syncs.py at TP 2 and CP 2 (two gloo ranks each): the tiny all-R GPTModel's training
step (packed THD forward on this rank's zigzag shard with global ``cu_seqlens``, vocab-parallel log-probs
from hidden states, a weighted sum as the loss, backward) under
:class:`_opcount.SyncCounter` on a fresh batch, then the same batch again with every
layer's collectives checking (``rlk_check_collectives`` on everywhere: the control of
:func:`rlk_megatron_provider.spec.check_collectives_once`). Inputs are sharded before the counter runs.

``python _sync_count_world_worker.py PORT``: prints one JSON line ``{"tp2": {...}, "cp2": {...}}`` (rank 0's
counts).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "frameworks"))  # megatron_setup
import megatron_setup as mg

DEV, DTYPE = torch.device("cpu"), torch.float32
LENGTHS = [16] * 4


def run(rank: int, tp: int, cp: int, port: int, out: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    from _cpu import cpu_recipe

    cpu_recipe()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp * cp)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        result = measure(tp, cp)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(result, f)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def measure(tp: int, cp: int) -> dict:
    from _opcount import SyncCounter

    import rlk_collectives
    import rlk_megatron_provider as prov
    from rlk_megatron_provider import logp
    from rlk_megatron_provider.layers import _RlkLayer

    prov.initialize_from_environment()
    tp_group, cp_group = mg._groups()
    cfg = mg.qwen_cfg("tiny")
    w = mg.make_weights(cfg, DEV, seed=5)
    model, _ = mg.build(cfg, DEV, DTYPE, rlk=True, tp=tp, cp=cp)
    mg.load(model, cfg, w, tp, tp_group.rank())
    box = mg.hidden_head(model)

    def inputs(seed: int):
        b = mg.Batch(cfg, LENGTHS, 1, DEV, seed=seed)
        if cp == 1:
            return b, b.ids, b.target
        layout = rlk_collectives.ZigzagLayout.build(b.cu.tolist(), cp, DEV)
        return b, layout.shard(b.ids, cp_group.rank()), layout.shard(b.target, cp_group.rank())

    def step(batch):
        b, ids, tgt = batch
        model.zero_grad(set_to_none=True)
        psp = b.psp()
        model(ids[None], ids[None] * 0, None, packed_seq_params=psp)
        h = box["hidden"].reshape(-1, box["hidden"].shape[-1])
        lp = logp.vocab_parallel_logprobs(h, box["weight"], tgt, mg.TEMPERATURE, tp_group)
        (lp * 0.01).sum().backward()

    def counted(batch) -> dict:
        with SyncCounter() as c:
            step(batch)
        return c.by_site()

    step(inputs(1))  # warm-up
    fresh = inputs(2)
    res = {"layers": cfg.num_hidden_layers, "fresh": counted(fresh)}
    for m in model.modules():
        if isinstance(m, _RlkLayer) or type(m).__name__ == "RlkCoreAttention":
            m.rlk_check_collectives = True
    res["every_layer_checking"] = counted(fresh)
    return res


def main() -> None:
    base = int(sys.argv[1])
    os.environ.update({"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
                       "RL_KERNEL_MODE": "strict"})
    mp.set_forkserver_preload(["torch", "megatron.core", "megatron.core.models.gpt"])
    result = {}
    with tempfile.TemporaryDirectory() as d:
        for i, (name, tp, cp) in enumerate((("tp2", 2, 1), ("cp2", 1, 2))):
            out = os.path.join(d, f"{name}.json")
            mp.start_processes(run, args=(tp, cp, base + i, out), nprocs=tp * cp, start_method="forkserver")
            with open(out) as f:
                result[name] = json.load(f)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
