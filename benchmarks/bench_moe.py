"""The MoE layer (contract ``rlk.moe.v1``, issue 36) as vLLM's plugin runs it under ffn R, against vLLM's own fused
MoE, same process, on the Qwen3-30B-A3B layer shape (hidden 2048, 128 experts, top-8, expert FFN 768, bf16).

    python benchmarks/bench_moe.py [--quick] [--repeats N] [--tokens 1,8,2048] [--backward]

- ``rlk``: :func:`rlk_layer`, the call sequence of ``rlk_vllm_plugin.moe.rlk_experts`` (the R method's
  ``apply_monolithic``) after the gate's GEMM: ``linear`` (the router GEMM, through the plugin's linear hook),
  ``moe_topk``, the (expert, token, slot) sort (``rlk_core.ops.moe.layer.route``), the row gather,
  ``moe_grouped_linear`` (gate/up), ``swiglu``, ``moe_grouped_linear`` (down), the un-gather and ``moe_combine``.
  The ops are called as ``rlk_core.ops`` directly: under vLLM's CUDA graphs the plugin's route calls are
  ``torch.ops.rlk.*`` with no Python in between (the host's share is not in these device times either way).
- ``native``: what vLLM 0.22's ``UnquantizedFusedMoEMethod`` runs on Hopper (its TRITON backend, ``TritonExperts``:
  the FlashInfer backends are Blackwell's) — the gate's ``F.linear``, ``fused_topk`` (``_moe_C.topk_softmax``,
  renormalised) and ``fused_experts`` (``moe_align_block_size``, the Triton ``fused_moe_kernel`` twice with vLLM's
  tuned configs, ``silu_and_mul``, ``moe_sum``). It needs vLLM's MoE kernels (``vllm/_moe_C.abi3.so``: the GPU site
  made with ``MOE=1``); a side that cannot be imported is skipped, its reason in the JSON, never replaced.

Decode token counts 1, 2, 4, ..., 256 and prefill 2048 ... 16384 (``--tokens``); per row the layer's device time on
each side (``harness.time_fns``: L2 flushed, the GPU held busy before each call, two input sets rotated — each with
its own expert weights, 1.2 GB a set, so weights come from HBM as in a model's next layer), ``ratio`` = native_ms /
rlk_ms (the issue's target: >= 0.8), the experts alone (routing given: ``*_experts_ms``), and as a sanity check that
both sides compute the same layer: the largest difference of their outputs and the fraction of tokens whose expert
set differs (ties and bf16 router logits: a few are expected). ``--backward``: the training path's forward +
backward (``rlk_core.ops.moe.layer.moe_ffn`` through autograd, every weight's gradient) at prefill sizes, rlk only
(the stock Megatron expert path is timed in a whole training step: ``frameworks/megatron_moe_gpu.py``).
Writes ``moe.json`` / ``moe.md`` (``moe_backward.*``) into ``$RLK_BENCH_OUT`` (default ``results/h200``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import _common  # noqa: F401  (sys.path)
import torch

from rlk_core import ops
from rlk_core.backends import REGISTRY
from rlk_core.ops.moe import moe_combine, moe_grouped_linear, moe_topk
from rlk_core.ops.moe.layer import moe_ffn, route
from rlk_core.ops.swiglu import swiglu

HIDDEN, EXPERTS, TOP_K, FFN = 2048, 128, 8, 768  # Qwen3-30B-A3B's MoE layer
DECODE = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL = (2048, 4096, 8192, 16384)
TARGET = 0.8  # native_ms / rlk_ms, the issue's


def rlk_layer(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int
              ) -> torch.Tensor:
    """The MoE layer as the vLLM plugin's R method computes it (``rlk_vllm_plugin.moe``: the gate's ``linear``, then
    ``rlk_experts``'s ops in its order); ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` as vLLM loads them."""
    weights, ids = moe_topk(ops.linear(x, router_weight), top_k, True)
    return rlk_routed(x, weights, ids, w13, w2)


def rlk_routed(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
               ) -> torch.Tensor:
    """The experts of :func:`rlk_layer` for a given routing (``moe_topk``'s ``weights``, ``ids``)."""
    r = route(ids, weights, w13.shape[0])
    k = ids.shape[1]
    rows = x.index_select(0, torch.div(r.order, k, rounding_mode="floor"))
    o = moe_grouped_linear(swiglu(moe_grouped_linear(rows, w13, r.offsets)), w2, r.offsets)
    return moe_combine(o.index_select(0, r.inv).view(-1, k, o.shape[1]), weights)


def native_sides() -> tuple[dict[str, Any] | None, str]:
    """vLLM's fused-MoE functions (``{"topk": fused_topk, "experts": fused_experts, "version": ...}``), or None and
    why not (no vLLM, no ``_moe_C``, no Triton)."""
    try:
        import vllm
        import vllm._moe_C  # topk_softmax, moe_align_block_size, moe_sum: the site's MoE kernels
        from vllm.model_executor.layers.fused_moe import fused_experts, fused_topk
        from vllm.triton_utils import HAS_TRITON
    except Exception as exc:  # any import failure skips the side, with its reason
        return None, f"vLLM's fused MoE unavailable: {type(exc).__name__}: {exc}"
    if not HAS_TRITON:
        return None, "vLLM's fused MoE unavailable: vllm.triton_utils.HAS_TRITON is False"
    return {"topk": fused_topk, "experts": fused_experts, "version": vllm.__version__}, ""


def native_layer(fns: dict, x, router_weight, w13, w2, top_k: int) -> torch.Tensor:
    """vLLM's layer: the gate (``F.linear``), ``fused_topk`` renormalised (Qwen3-MoE's ``norm_topk_prob``),
    ``fused_experts``."""
    logits = torch.nn.functional.linear(x, router_weight)
    weights, ids, _ = fns["topk"](x, logits, top_k, True)
    return fns["experts"](x, w13, w2, weights, ids)


def make_inputs(tokens: int, seed: int, device: str = "cuda", hidden: int = HIDDEN, experts: int = EXPERTS,
                ffn: int = FFN) -> dict[str, torch.Tensor]:
    """One input set: ``x [T, H]``, the router ``[E, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` (bf16 on CUDA, fp32 on
    the CPU: the reference backend's smoke shape), each scaled so a layer's outputs are of order 1."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(shape, scale):
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    return {"x": rnd((tokens, hidden), 1.0), "router": rnd((experts, hidden), hidden ** -0.5),
            "w13": rnd((experts, 2 * ffn, hidden), hidden ** -0.5), "w2": rnd((experts, hidden, ffn), ffn ** -0.5)}


def backends(s: dict, top_k: int) -> dict[str, str]:
    """The rlk backend each op of the layer runs on these inputs (the registry's choice)."""
    logits = ops.linear(s["x"], s["router"])
    w, ids = moe_topk(logits, top_k, True)
    r = route(ids, w, s["w13"].shape[0])
    rows = s["x"].index_select(0, torch.div(r.order, top_k, rounding_mode="floor"))
    dev = s["x"].device.type
    args = {"linear": (s["x"], s["router"], None), "moe_topk": (logits, top_k, True),
            "moe_grouped_linear": (rows, s["w13"], r.offsets),
            "moe_combine": (torch.empty((s["x"].shape[0], top_k, s["x"].shape[1]), dtype=rows.dtype, device=dev), w)}
    out = {}
    for op, a in args.items():
        try:
            out[op] = REGISTRY.select(op, dev, a, strict=False).backend.id
        except Exception as exc:  # recorded, not fatal: the timing says what ran
            out[op] = f"unknown ({type(exc).__name__}: {exc})"[:200]
    return out


def forward_row(tokens: int, native: dict | None, repeats: int, top_k: int = TOP_K) -> dict:
    from harness import time_fns

    sets = [make_inputs(tokens, seed=100 * i) for i in range(2)]
    row: dict[str, Any] = {"T": tokens, "phase": "decode" if tokens <= max(DECODE) else "prefill"}
    row["rlk_ms"] = time_fns([lambda s=s: rlk_layer(s["x"], s["router"], s["w13"], s["w2"], top_k) for s in sets],
                             repeats=repeats)["median_ms"]
    routed = [moe_topk(ops.linear(s["x"], s["router"]), top_k, True) for s in sets]
    row["rlk_experts_ms"] = time_fns([lambda s=s, r=r: rlk_routed(s["x"], r[0], r[1], s["w13"], s["w2"])
                                      for s, r in zip(sets, routed, strict=True)], repeats=repeats)["median_ms"]
    if native is not None:
        row["native_ms"] = time_fns([lambda s=s: native_layer(native, s["x"], s["router"], s["w13"], s["w2"], top_k)
                                     for s in sets], repeats=repeats)["median_ms"]
        nat_routed = [native["topk"](s["x"], torch.nn.functional.linear(s["x"], s["router"]), top_k, True)[:2]
                      for s in sets]
        row["native_experts_ms"] = time_fns([lambda s=s, r=r: native["experts"](s["x"], s["w13"], s["w2"], r[0], r[1])
                                             for s, r in zip(sets, nat_routed, strict=True)],
                                            repeats=repeats)["median_ms"]
        row["ratio"] = row["native_ms"] / row["rlk_ms"]
        row["experts_ratio"] = row["native_experts_ms"] / row["rlk_experts_ms"]
        s = sets[0]
        y_r = rlk_layer(s["x"], s["router"], s["w13"], s["w2"], top_k).float()
        y_n = native_layer(native, s["x"], s["router"], s["w13"], s["w2"], top_k).float()
        row["max_abs_diff"] = float((y_r - y_n).abs().max())
        ids_r = routed[0][1].sort(-1).values
        ids_n = nat_routed[0][1].to(torch.int64).sort(-1).values
        row["routing_differs"] = float((ids_r != ids_n).any(-1).float().mean())
    flop = 2.0 * tokens * (HIDDEN * EXPERTS + top_k * 3 * HIDDEN * FFN)
    row["rlk_tflops"] = flop / row["rlk_ms"] / 1e9
    print(f"moe T={tokens:6d} rlk {row['rlk_ms']:.4f} ms (experts {row['rlk_experts_ms']:.4f}) "
          + (f"native {row['native_ms']:.4f} ms (experts {row['native_experts_ms']:.4f}) ratio {row['ratio']:.2f} "
             f"max|diff| {row['max_abs_diff']:.3g} routing differs {100 * row['routing_differs']:.2f}%"
             if native is not None else "native skipped"), flush=True)
    del sets
    return row


def backward_row(tokens: int, repeats: int, top_k: int = TOP_K) -> dict:
    """``moe_ffn`` forward + backward (dx and every weight's gradient), rlk's training path."""
    from harness import time_fns

    s = make_inputs(tokens, seed=7)
    leaves = [s[k].clone().requires_grad_() for k in ("x", "router", "w13", "w2")]
    g = torch.randn_like(s["x"])

    def step():
        y, _ = moe_ffn(leaves[0], leaves[1], leaves[2], leaves[3], top_k)
        return torch.autograd.grad(y, leaves, g)

    t = time_fns([step], repeats=repeats)["median_ms"]
    flop = 3 * 2.0 * tokens * (HIDDEN * EXPERTS + top_k * 3 * HIDDEN * FFN)
    print(f"moe backward T={tokens:6d} rlk forward+backward {t:.3f} ms ({flop / t / 1e9:.0f} TFLOP/s)", flush=True)
    return {"T": tokens, "rlk_fwd_bwd_ms": t, "rlk_tflops": flop / t / 1e9}


def parse_tokens(text: str | None, quick: bool) -> tuple[int, ...]:
    if text is None:
        return (1, 16, 128, 256, 4096) if quick else DECODE + PREFILL
    try:
        out = tuple(int(t) for t in text.split(",") if t)
    except ValueError:
        raise ValueError(f"--tokens {text!r}: a comma list of positive integers") from None
    if not out or any(t < 1 for t in out):
        raise ValueError(f"--tokens {text!r}: a comma list of positive integers")
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="five token counts (1, 16, 128, 256, 4096)")
    ap.add_argument("--tokens", help="comma list of token counts (default: 1..256 by powers of 2, 2048..16384)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backward", action="store_true", help="also rlk's forward + backward (moe_ffn) at prefill sizes")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        tokens = parse_tokens(args.tokens, args.quick)
    except ValueError as e:
        ap.error(str(e))  # exit 2
    from harness import copy_bandwidth, default_out_dir, environment, require_cuda, write_results

    require_cuda("bench_moe")
    native, why = native_sides()
    env = environment()
    env["vllm"] = native["version"] if native is not None else None
    meta: dict[str, Any] = {
        "env": env, "copy": copy_bandwidth(), "repeats": args.repeats, "target": f"ratio >= {TARGET}",
        "shape": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "expert_ffn": FFN, "dtype": "bfloat16",
                  "norm_topk_prob": True},
        "ratio": "native_ms / rlk_ms (>= 1: rlk faster); experts_ratio: the same for the experts alone",
        "rlk": "bench_moe.rlk_layer: rlk_core.ops linear (router), moe_topk, route + gather, moe_grouped_linear, "
               "swiglu, moe_grouped_linear, un-gather, moe_combine (rlk_vllm_plugin.moe.rlk_experts' sequence)",
        "native": "F.linear (router), vllm fused_topk (renormalize), vllm fused_experts (Triton fused_moe_kernel)",
        "native_skipped": why or None,
        "rlk_backends": backends(make_inputs(256, seed=1), TOP_K),
    }
    if why:
        print(f"bench_moe: native side skipped: {why}", flush=True)
    cols = [("phase", "phase"), ("T", "tokens"), ("rlk_ms", "rlk ms"), ("native_ms", "vLLM fused MoE ms"),
            ("ratio", "ratio"), ("rlk_experts_ms", "rlk experts ms"), ("native_experts_ms", "vLLM experts ms"),
            ("experts_ratio", "experts ratio"), ("rlk_tflops", "rlk TFLOP/s"), ("max_abs_diff", "max |diff|"),
            ("routing_differs", "routing differs")]
    rows: list[dict] = []
    for t in tokens:  # the files rewritten after every row: a run cut short by its time cap keeps what it measured
        rows.append(forward_row(t, native, args.repeats))
        meta["below_target"] = [r["T"] for r in rows if "ratio" in r and r["ratio"] < TARGET]
        write_results(default_out_dir(), "moe", meta, rows, cols)
    if args.backward:
        brows = [backward_row(t, args.repeats) for t in (t for t in tokens if t > max(DECODE))]
        bmeta = {**meta, "what": "moe_ffn forward + backward through autograd (dx, router, w13, w2 gradients), "
                                 "rlk only",
                 "tflops": "3x the forward's FLOPs"}
        bmeta.pop("below_target")
        write_results(default_out_dir(), "moe_backward", bmeta, brows,
                      [("T", "tokens"), ("rlk_fwd_bwd_ms", "rlk fwd+bwd ms"), ("rlk_tflops", "rlk TFLOP/s")])
    return 0


if __name__ == "__main__":
    sys.exit(main())
