"""Worker for test_host_syncs_gpu.py: one CUDA GPU (NCCL world of 1), the GRPO training step of
``benchmarks/frameworks/megatron_gpu.py`` (forward, log-probs, loss, backward; no optimizer) on the tiny all-R
GPTModel in bf16, under torch's sync debug mode (``megatron_gpu.host_syncs``: every synchronizing CUDA call,
with the Python line that made it; syncs in the backward are replayed at the ``backward()`` call).

``python _sync_count_gpu_worker.py PORT``: prints one JSON line with the host syncs of a fresh packed batch, of
the same batch again, and of the control (the rope tables not reserved: a theta nothing reserved).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks", "frameworks"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "frameworks"))  # megatron_setup
import megatron_gpu  # host_syncs
import megatron_setup as mg

LENGTHS = [16] * 4


def main() -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    os.environ["RLK_BENCH_PORT"] = sys.argv[1]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    mg.init_world("cuda")
    import rlk_megatron_provider as prov
    from rlk_megatron_provider import attention

    prov.initialize_from_environment()
    cfg = mg.qwen_cfg("tiny")
    model, _ = mg.build(cfg, dev, dtype, rlk=True)
    mg.load(model, cfg, mg.make_weights(cfg, dev, seed=5))
    box = mg.hidden_head(model)

    def step(b):
        model.zero_grad(set_to_none=True)
        mg.grpo_loss(mg.rlk_logp(model, box, b), b.adv).backward()

    step(mg.Batch(cfg, LENGTHS, 1, dev, seed=1))  # warm-up: Triton compiles, caches, the reserved rope table
    fresh = mg.Batch(cfg, LENGTHS, 1, dev, seed=2)
    out = {"layers": cfg.num_hidden_layers, "fresh_batch": megatron_gpu.host_syncs(lambda: step(fresh), True),
           "same_batch": megatron_gpu.host_syncs(lambda: step(fresh), True)}
    for m in model.modules():  # control: rope with a (dim, theta) no table was reserved for
        if isinstance(m, attention.RlkCoreAttention):
            m.rope_theta, m.max_positions = m.rope_theta * 1.5, None
    step(fresh)  # the unreserved table is built here (sized from the positions)
    out["control_unreserved_rope"] = megatron_gpu.host_syncs(lambda: step(fresh), True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
