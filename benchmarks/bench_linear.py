"""``linear`` (rlk.triton, rlk.gemm.bi.v1) vs ``F.linear`` (cuBLAS), same process, every shape and M.

    python benchmarks/bench_linear.py [--quick]
    python benchmarks/bench_linear.py --backward [--quick]

Ratio = native time / rlk time (throughput ratio; >= 1 means rlk is faster). Candidate tile
configurations are explored by ``sweep_kernels.py``; the shipped rule is
``rlk_core.ops.linear.triton.config`` (each row records the tile it picked).

``--backward`` (``linear_backward.json``): the op's backward (dx and dW, one row also db) through autograd —
the stored-layout kernels, ``tiles.stored_config`` — against ``F.linear``'s backward (cuBLAS) and against the
backward this replaced (``copies``: W copied contiguous for dx, dy and x transposed and padded to 64 tokens for
dW, the forward's kernels), all in this process: device time (CUDA events) and host time per backward, and
whether dx / dW have the bits of the copying backward (not required: the backward's contract is run-to-run).
"""

from __future__ import annotations

import argparse
import time

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
from _common import M_LIST, linear_shapes, randn
from harness import best_host_us, copy_bandwidth, default_out_dir, environment, time_fns, write_results

from rlk_core.ops import linear as linear_op
from rlk_core.ops._layout import transpose_padded
from rlk_core.ops.linear import triton as lt


def inputs(m, n, k, sets):
    return [(randn((m, k), seed=10 * i), randn((n, k), scale=k ** -0.5, seed=10 * i + 1)) for i in range(sets)]


def _tile_name(c: dict, m: int) -> str:
    rem = lt.rem_rows(m, c["BLOCK_M"]) if c["TMA"] and not c["TAIL_M"] else 0
    return ("tma " if c["TMA"] else "ptr ") + "x".join(str(c[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + (
        f"+{c['TAIL_M']}" if c["TAIL_M"] else "") + (f" last box {rem}" if rem else "") + (
        f" w{c['num_warps']} s{c['num_stages']}")


def _copies_backward(x, w, g):
    """dx and dW as the backward computed them before the stored-layout kernels (for comparison only)."""
    return lt.linear_2d(g, w.t().contiguous(), None), lt.linear_2d(transpose_padded(g), transpose_padded(x), None)


def _stored_tile(x, w) -> str:
    c = lt._stored_config_for(x, w, torch.empty(0, dtype=x.dtype, device=x.device))
    return ("tma " if c["TMA"] else "ptr ") + "x".join(str(c[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))


def _backward_row(name: str, n: int, k: int, t: int, bias: bool, repeats: int) -> dict:
    x, w, g = randn((t, k), seed=1), randn((n, k), scale=k ** -0.5, seed=2), randn((t, n), seed=3)
    b = randn((n,), seed=4) if bias else None
    fns = {}
    for side, op in (("rlk", linear_op), ("native", F.linear)):
        ins = [x.clone().requires_grad_(), w.clone().requires_grad_()] + ([b.clone().requires_grad_()] if bias else [])
        y = op(*ins)
        fns[side] = lambda y=y, ins=ins: torch.autograd.grad(y, ins, g, retain_graph=True)
    fns["copies"] = lambda: _copies_backward(x, w, g)
    dev = {side: time_fns([f], repeats=repeats)["median_ms"] for side, f in fns.items()}
    host = {side: best_host_us(f, calls=20, loops=5) for side, f in fns.items()}
    torch.cuda.synchronize()
    dx, dw = fns["rlk"]()[:2]
    cdx, cdw = _copies_backward(x, w, g)
    flop = 2.0 * 2 * t * n * k
    return {"shape": name, "T": t, "N": n, "K": k, "rlk_ms": dev["rlk"], "native_ms": dev["native"],
            "copies_ms": dev["copies"], "ratio": dev["native"] / dev["rlk"], "vs_copies": dev["copies"] / dev["rlk"],
            "rlk_tflops": flop / dev["rlk"] / 1e9, "rlk_host_us": host["rlk"], "native_host_us": host["native"],
            "copies_host_us": host["copies"], "dx_bits_as_copies": bool(torch.equal(dx, cdx)),
            "dw_bits_as_copies": bool(torch.equal(dw, cdw)), "dx_tile": _stored_tile(g, w.t()),
            "dw_tile": _stored_tile(g.t(), x.t())}


def backward(args, env, copy) -> None:
    shapes = [s for s in linear_shapes() if not s[0].endswith("lm_head")]  # the LM head's is linear_logprobs'
    tokens = (1024, 4096, 8192)
    if args.quick:
        shapes, tokens = [s for s in shapes if s[0].startswith("qwen3-0.6b/tp1")], (4096,)
    rows = []
    for name, n, k in shapes + [(shapes[0][0] + "+bias", shapes[0][1], shapes[0][2])]:
        for t in tokens:
            r = _backward_row(name, n, k, t, name.endswith("+bias"), args.repeats)
            rows.append(r)
            print(f"{name:30s} T={t:5d} rlk {r['rlk_ms']:.4f} ms F.linear {r['native_ms']:.4f} ms copies "
                  f"{r['copies_ms']:.4f} ms ratio {r['ratio']:.2f} ({r['rlk_tflops']:.0f} TFLOP/s), host us rlk "
                  f"{r['rlk_host_us']:.0f} F.linear {r['native_host_us']:.0f} copies {r['copies_host_us']:.0f}",
                  flush=True)
    meta = {"env": env, "copy": copy, "repeats": args.repeats,
            "ratio": "native_ms / rlk_ms (throughput ratio)", "vs_copies": "copies_ms / rlk_ms",
            "rlk": "autograd backward of rlk_core.ops.linear (dx, dW; db on +bias rows)",
            "native": "autograd backward of torch.nn.functional.linear (cuBLAS)",
            "copies": "the replaced backward: linear_2d(dy, W.t().contiguous()), linear_2d(transpose_padded(dy), "
                      "transpose_padded(x)) (no db)",
            "host_us": "best of 5 loops of 20 back-to-back backwards, host time per backward"}
    write_results(default_out_dir(), "linear_backward", meta, rows,
                  [("shape", "shape"), ("T", "T"), ("N", "N"), ("K", "K"), ("rlk_ms", "rlk ms"),
                   ("native_ms", "F.linear ms"), ("copies_ms", "copies ms"), ("ratio", "ratio"),
                   ("vs_copies", "vs copies"), ("rlk_host_us", "rlk host us"), ("native_host_us", "F.linear host us"),
                   ("dx_tile", "dx tile"), ("dw_tile", "dW tile"), ("dx_bits_as_copies", "dx bits = copies"),
                   ("dw_bits_as_copies", "dW bits = copies")])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a few shapes and M only")
    ap.add_argument("--backward", action="store_true", help="the op's backward instead of the forward GEMM")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    env, copy = environment(), copy_bandwidth()
    if args.backward:
        backward(args, env, copy)
        return
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
