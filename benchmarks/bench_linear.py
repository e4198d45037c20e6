"""``linear`` (``rlk_core.ops.linear``, contract rlk.gemm.bi.v1) vs ``F.linear`` (cuBLAS), same process, every
shape and M of the GPU tests.

    python benchmarks/bench_linear.py [--quick]              # forward: linear.json
    python benchmarks/bench_linear.py --backward [--quick]   # dx, dW (and db) through autograd: linear_backward.json

Ratio = native time / rlk time (>= 1: rlk faster). Both sides go through their public call (the op selects its
backend: rlk.cuda where ``rlk_core._C`` is built, else rlk.triton); the harness measures device time, so the host
cost of the call is not in these numbers (``host_overhead.py`` measures it). The tile each call takes is the rule's
(``rlk_core.ops.linear.tiles``); candidate tiles are explored by ``sweep_kernels.py``.
"""

from __future__ import annotations

import argparse
import sys

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
from _common import M_LIST, linear_shapes, randn
from harness import best_host_us, copy_bandwidth, default_out_dir, environment, time_fns, write_results

from rlk_core import ops


def inputs(m: int, n: int, k: int, sets: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(randn((m, k), seed=10 * i), randn((n, k), scale=k ** -0.5, seed=10 * i + 1)) for i in range(sets)]


def forward_rows(shapes, ms, repeats: int) -> list[dict]:
    rows = []
    for name, n, k in shapes:
        for m in ms:
            sets = inputs(m, n, k, 2 if n * k * 2 < (1 << 30) else 1)  # weights over 1 GiB: one set
            t_rlk = time_fns([lambda x=x, w=w: ops.linear(x, w) for x, w in sets], repeats=repeats)["median_ms"]
            t_nat = time_fns([lambda x=x, w=w: F.linear(x, w) for x, w in sets], repeats=repeats)["median_ms"]
            flop = 2.0 * m * n * k
            rows.append({"shape": name, "M": m, "N": n, "K": k, "rlk_ms": t_rlk, "native_ms": t_nat,
                         "rlk_tflops": flop / t_rlk / 1e9, "native_tflops": flop / t_nat / 1e9, "ratio": t_nat / t_rlk})
            r = rows[-1]
            print(f"{name:28s} M={m:5d} rlk {t_rlk:.4f} ms native {t_nat:.4f} ms ratio {r['ratio']:.2f} "
                  f"({r['rlk_tflops']:.0f} vs {r['native_tflops']:.0f} TFLOP/s)", flush=True)
            del sets
    return rows


def backward_row(name: str, n: int, k: int, t: int, bias: bool, repeats: int) -> dict:
    x, w, g = randn((t, k), seed=1), randn((n, k), scale=k ** -0.5, seed=2), randn((t, n), seed=3)
    b = randn((n,), seed=4) if bias else None
    fns = {}
    for side, op in (("rlk", ops.linear), ("native", F.linear)):
        ins = [x.clone().requires_grad_(), w.clone().requires_grad_()] + ([b.clone().requires_grad_()] if bias else [])
        y = op(*ins)
        fns[side] = lambda y=y, ins=ins: torch.autograd.grad(y, ins, g, retain_graph=True)
    dev = {side: time_fns([f], repeats=repeats)["median_ms"] for side, f in fns.items()}
    host = {side: best_host_us(f, calls=20, loops=5) for side, f in fns.items()}
    torch.cuda.synchronize()
    flop = 2.0 * 2 * t * n * k
    return {"shape": name, "T": t, "N": n, "K": k, "rlk_ms": dev["rlk"], "native_ms": dev["native"],
            "ratio": dev["native"] / dev["rlk"], "rlk_tflops": flop / dev["rlk"] / 1e9,
            "rlk_host_us": host["rlk"], "native_host_us": host["native"]}


def backward_rows(shapes, tokens, repeats: int) -> list[dict]:
    shapes = [s for s in shapes if not s[0].endswith("lm_head")]  # the LM head's backward is linear_logprobs'
    rows = []
    for name, n, k in shapes + [(shapes[0][0] + "+bias", shapes[0][1], shapes[0][2])]:
        for t in tokens:
            r = backward_row(name, n, k, t, name.endswith("+bias"), repeats)
            rows.append(r)
            print(f"{name:30s} T={t:5d} rlk {r['rlk_ms']:.4f} ms F.linear {r['native_ms']:.4f} ms ratio "
                  f"{r['ratio']:.2f} ({r['rlk_tflops']:.0f} TFLOP/s), host us rlk {r['rlk_host_us']:.0f} "
                  f"F.linear {r['native_host_us']:.0f}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few shapes and M only")
    ap.add_argument("--backward", action="store_true", help="the op's backward instead of the forward GEMM")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_linear: needs a CUDA GPU", file=sys.stderr)
        return 2
    env, copy = environment(), copy_bandwidth()
    meta = {"env": env, "copy": copy, "repeats": args.repeats, "ratio": "native_ms / rlk_ms (throughput ratio)",
            "rlk": "rlk_core.ops.linear", "native": "torch.nn.functional.linear (cuBLAS)"}
    shapes = linear_shapes()
    if args.backward:
        tokens = (1024, 4096, 8192)
        if args.quick:
            shapes, tokens = [s for s in shapes if s[0].startswith("qwen3-0.6b/tp1")], (4096,)
        meta.update(what="autograd backward (dx, dW; db on +bias rows)",
                    host_us="best of 5 loops of 20 back-to-back backwards, host time per backward")
        write_results(default_out_dir(), "linear_backward", meta, backward_rows(shapes, tokens, args.repeats),
                      [("shape", "shape"), ("T", "T"), ("N", "N"), ("K", "K"), ("rlk_ms", "rlk ms"),
                       ("native_ms", "F.linear ms"), ("ratio", "ratio"), ("rlk_tflops", "rlk TFLOP/s"),
                       ("rlk_host_us", "rlk host us"), ("native_host_us", "F.linear host us")])
        return 0
    ms = M_LIST
    if args.quick:
        shapes, ms = [s for s in shapes if s[0].startswith("qwen3-8b/tp1")], (1, 16, 128, 1024, 8192)
    write_results(default_out_dir(), "linear", meta, forward_rows(shapes, ms, args.repeats),
                  [("shape", "shape"), ("M", "M"), ("N", "N"), ("K", "K"), ("rlk_ms", "rlk ms"),
                   ("native_ms", "F.linear ms"), ("rlk_tflops", "rlk TFLOP/s"), ("native_tflops", "F.linear TFLOP/s"),
                   ("ratio", "ratio")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
