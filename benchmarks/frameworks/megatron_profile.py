"""Where a Megatron training step with the rlk provider spends its time, next to the stock local spec.

One H200, the Qwen3-0.6B shape (or ``--shape``) of ``megatron_gpu.py``: its timing step (the same model builders,
weights, batch, GRPO loss and AdamW; ``megatron_gpu.time_steps``) with more profiled steps than its timing
stage takes — per model, the wall and CUDA-event time per step, the host syncs (torch's sync debug mode, with
the Python lines that made them), and from ``torch.profiler`` the kernels, their device time, the host's
launch calls, synchronize calls and copies per step, the top kernels and host ops. The gap between wall and
kernel time is what the host costs (a host-bound step). ``megatron_gpu.py``'s timing stage records the
same numbers on every run; this script is for a longer look.

    PYTHONPATH=<as for megatron_gpu.py> python3 benchmarks/frameworks/megatron_profile.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "frameworks"))
import megatron_gpu as mg  # the H200 step timing, beside this file
import megatron_setup as S  # the framework tests' model builders


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="qwen3-0.6b", choices=("qwen3-0.6b", "qwen3-1.7b"))
    ap.add_argument("--steps", type=int, default=3, help="profiled steps per model")
    args = ap.parse_args()
    os.environ.update(S.R_ENV)
    import torch

    dev, dtype = torch.device("cuda"), torch.bfloat16
    S.init_world("cuda")
    import rlk_megatron_provider as prov

    prov.initialize_from_environment()
    cfg = S.qwen_cfg(args.shape)
    w = S.make_weights(cfg, dev, seed=5)
    out = {"meta": {"commit": os.environ.get("RLK_COMMIT"), "gpu": torch.cuda.get_device_name(),
                    "torch": torch.__version__, "shape": args.shape, "tokens": 16 * 256}}
    for name, rlk in (("rlk", True), ("stock", False)):
        out[name] = r = mg.time_steps(cfg, dev, dtype, rlk, w, 16, 256, warmup=2, iters=3, profile_steps=args.steps)
        p = r["profile"]
        S.log(f"{name}: wall {r['median_wall_ms']} ms, kernels {p['kernel_ms_per_step']} ms, "
               f"{p['kernels_per_step']} kernels, {r['host_syncs']['per_step']} host syncs per step")
        S._free()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "megatron_profile.json"), "w") as f:
        json.dump(out, f, indent=1)
    for name in ("rlk", "stock"):
        r, p = out[name], out[name]["profile"]
        print(f"\n## {name}: wall {r['median_wall_ms']} ms / kernels {p['kernel_ms_per_step']} ms, "
              f"{r['host_syncs']['per_step']} host syncs ({p['cuda_stream_synchronize_per_step']} "
              f"cudaStreamSynchronize) per step")
        for site, n in r["host_syncs"]["sites"].items():
            print(f"  sync x{n:<4} {site}")
        for k in p["top_kernels"]:
            print(f"  {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<7} {k['name']}")
        for k in p["top_host_ops"]:
            print(f"  host {k['self_cpu_ms_per_step']:8.3f} ms  x{k['calls_per_step']:<7} {k['name']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
