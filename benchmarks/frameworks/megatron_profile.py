"""Where a Megatron training step with the rlk provider spends its time, next to the stock local spec.

One H200, the Qwen3-0.6B shape of ``megatron_gpu.py`` (same model builder, weights, batch and step): after
two warm-up steps, ``torch.profiler`` over three steps of each model; writes, per model, the wall time per
step, the summed CUDA kernel time per step (what the GPU did), the kernel launches per step and the top
kernels and host-side ops. The gap between wall and kernel time is what the host costs (a host-bound step).

    PYTHONPATH=<as for megatron_gpu.py> python3 benchmarks/frameworks/megatron_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import megatron_gpu as mg  # the builders of the H200 check, beside this file


def profile_model(cfg, dev, dtype, rlk: bool, w, steps: int = 3) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    model, _ = mg.build(cfg, dev, dtype, rlk=rlk)
    masters = mg.load(model, cfg, w)
    opt = mg.MasterAdamW(model, masters, foreach=True)
    b = mg.Batch(cfg, [256] * 16, 1, dev, seed=17)
    box = mg.hidden_head(model) if rlk else None

    def step():
        opt.zero_grad()
        lp = mg.rlk_logp(model, box, b) if rlk else mg.stock_logp(model, b)
        mg.grpo_loss(lp, b.adv).backward()
        opt.step()

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / steps
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type.name == "CUDA"]
    cuda_us = sum(e.self_device_time_total for e in kernels) / steps
    launches = sum(e.count for e in kernels) / steps
    top_k = sorted(kernels, key=lambda e: -e.self_device_time_total)[:15]
    host = sorted((e for e in events if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)[:15]
    return {
        "wall_ms_per_step": round(wall * 1e3, 2),
        "cuda_kernel_ms_per_step": round(cuda_us / 1e3, 2),
        "kernel_launches_per_step": round(launches),
        "top_kernels": [{"name": e.key[:120], "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 3),
                         "calls_per_step": e.count // steps} for e in top_k],
        "top_host_ops": [{"name": e.key[:120], "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
                          "calls_per_step": e.count // steps} for e in host],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ.update(mg.R_ENV)
    import torch

    dev, dtype = torch.device("cuda"), torch.bfloat16
    mg.init_world("cuda")
    import rlk_megatron_provider as prov

    prov.initialize_from_environment()
    cfg = mg.qwen_cfg("qwen3-0.6b")
    w = mg.make_weights(cfg, dev, seed=5)
    out = {"meta": {"commit": os.environ.get("RLK_COMMIT"), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "shape": "qwen3-0.6b", "tokens": 4096}}
    for name, rlk in (("rlk", True), ("stock", False)):
        out[name] = profile_model(cfg, dev, dtype, rlk, w)
        mg.log(f"{name}: wall {out[name]['wall_ms_per_step']} ms, kernels {out[name]['cuda_kernel_ms_per_step']} ms, "
               f"{out[name]['kernel_launches_per_step']} launches per step")
        mg._free()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "megatron_profile.json"), "w") as f:
        json.dump(out, f, indent=1)
    for name in ("rlk", "stock"):
        r = out[name]
        print(f"\n## {name}: wall {r['wall_ms_per_step']} ms / kernels {r['cuda_kernel_ms_per_step']} ms")
        for k in out[name]["top_kernels"][:10]:
            print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<5d} {k['name']}")
        for k in out[name]["top_host_ops"][:8]:
            print(f"  host {k['self_cpu_ms_per_step']:8.3f} ms  x{k['calls_per_step']:<5d} {k['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
