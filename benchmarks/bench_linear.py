"""``linear`` (rlk.triton, rlk.gemm.bi.v1) vs ``F.linear`` (cuBLAS), same process, every shape and M.

    python benchmarks/bench_linear.py [--quick]

Ratio = native time / rlk time (throughput ratio; >= 1 means rlk is faster). Candidate tile
configurations are explored by ``sweep_kernels.py``; the shipped rule is
``rlk_core.ops.linear.triton.config`` (each row records the tile it picked).
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
from _common import M_LIST, linear_shapes, randn
from harness import copy_bandwidth, default_out_dir, environment, time_fns, write_results

from rlk_core.ops import linear as linear_op
from rlk_core.ops.linear import triton as lt


def inputs(m, n, k, sets):
    return [(randn((m, k), seed=10 * i), randn((n, k), scale=k ** -0.5, seed=10 * i + 1)) for i in range(sets)]


def _tile_name(c: dict, m: int) -> str:
    rem = lt.rem_rows(m, c["BLOCK_M"]) if c["TMA"] and not c["TAIL_M"] else 0
    return ("tma " if c["TMA"] else "ptr ") + "x".join(str(c[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + (
        f"+{c['TAIL_M']}" if c["TAIL_M"] else "") + (f" last box {rem}" if rem else "") + (
        f" w{c['num_warps']} s{c['num_stages']}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes and M only")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    env, copy = environment(), copy_bandwidth()
    shapes = linear_shapes()
    ms = M_LIST
    if args.quick:
        shapes = [s for s in shapes if s[0].startswith("qwen3-8b/tp1")]
        ms = (1, 16, 128, 1024, 8192)
    rows = []
    for name, n, k in shapes:
        for m in ms:
            sets = inputs(m, n, k, 2 if n * k * 2 < (1 << 30) else 1)
            t_rlk = time_fns([lambda x=x, w=w: lt.linear_2d(x, w, None) for x, w in sets], repeats=args.repeats)
            t_nat = time_fns([lambda x=x, w=w: F.linear(x, w) for x, w in sets], repeats=args.repeats)
            flop = 2.0 * m * n * k
            r = {"shape": name, "M": m, "N": n, "K": k,
                 "rlk_ms": t_rlk["median_ms"], "native_ms": t_nat["median_ms"],
                 "rlk_tflops": flop / t_rlk["median_ms"] / 1e9, "native_tflops": flop / t_nat["median_ms"] / 1e9,
                 "ratio": t_nat["median_ms"] / t_rlk["median_ms"]}
            c = lt._config_for(*sets[0], torch.empty(m, n, dtype=sets[0][0].dtype, device="cuda"))
            r["tile"] = _tile_name(c, m)
            if "SPLIT_ROWS" in c:  # a row split: the first rows by this tile, the rest by REST
                r["tile"] += f" rows<{c['SPLIT_ROWS']}, then " + _tile_name(c["REST"], m - c["SPLIT_ROWS"])
            rows.append(r)
            print(f"{name:28s} M={m:5d} rlk {r['rlk_ms']:.4f} ms native {r['native_ms']:.4f} ms "
                  f"ratio {r['ratio']:.2f} ({r['rlk_tflops']:.0f} vs {r['native_tflops']:.0f} TFLOP/s)", flush=True)
            del sets
    meta = {"env": env, "copy": copy, "repeats": args.repeats,
            "ratio": "native_ms / rlk_ms (throughput ratio)", "rlk": "rlk_core.ops.linear.triton.linear_2d",
            "native": "torch.nn.functional.linear (cuBLAS)"}
    # host-side cost of the public op path (custom op + checks + backend selection) at M=1
    x, w = inputs(1, 4096, 4096, 1)[0]
    for fn, key in ((lambda: linear_op(x, w), "op_us"), (lambda: lt.linear_2d(x, w, None), "launcher_us"),
                    (lambda: F.linear(x, w), "native_us")):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        torch.cuda.synchronize()
        meta.setdefault("host_per_call_M1_4096x4096", {})[key] = (time.perf_counter() - t0) / 500 * 1e6
    print("host per call at M=1, 4096x4096 (us):", meta["host_per_call_M1_4096x4096"])
    write_results(default_out_dir(), "linear", meta, rows,
                  [("shape", "shape"), ("M", "M"), ("N", "N"), ("K", "K"), ("rlk_ms", "rlk ms"),
                   ("native_ms", "F.linear ms"), ("rlk_tflops", "rlk TFLOP/s"),
                   ("native_tflops", "F.linear TFLOP/s"), ("ratio", "ratio"), ("tile", "rlk tile")])


if __name__ == "__main__":
    main()
