"""Paper projection of the 8-GPU headline run (issue 22) from the throughputs measured on the H200.

    python benchmarks/projection.py [--tokens-per-step N] [--tokens-per-gpu N] [--out DIR]

The run the seeds describe (Qwen3-8B shape, training TP 4 / CP 2 on eight GPUs, rollout TP 4) needs a
kind of machine that is not lent. Until it is, this script estimates per-GPU memory and the training
step's device time from numbers committed in ``benchmarks/results/``:

- GEMMs: rlk ``linear`` TFLOP/s on the 8B shapes at TP 4 and M = 8192 (``h200/linear.json``). The
  backward's dX and dW products are charged at the same rate (an assumption: dW runs with K = tokens);
- attention: rlk forward and backward TFLOP/s at L = 8192 with the 8B heads (``h200/attention_*.json``),
  charged for the 8 query / 2 KV heads each TP rank holds; zigzag CP gives each CP rank half the causal
  work;
- collectives: rlk bus bandwidth of all-gather-like and reduce-scatter transfers at the largest measured
  size on two GPUs (``h200x2/collectives/collectives.json``). A ring's bus bandwidth on a full NVLink
  switch is roughly independent of the world size, so the W = 2 figure stands in for W = 4 and W = 2 —
  the largest assumption here; nothing is overlapped with compute;
- element-wise ops (RMSNorm, SwiGLU, RoPE) at the measured copy bandwidth.

Host time is not modelled: at 8192 tokens per GPU the smallest GEMM takes ~0.1 ms, above the ~0.09 ms host
time of an rlk launch measured in ``h200/host_overhead.json``, so the step is device-bound on paper; the
0.6B Megatron profile (``h200/frameworks/megatron_profile.json``) shows that smaller shapes are not.

Writes ``projection_qwen3-8b_tp4_cp2.json`` / ``.md`` to ``--out`` (default
``benchmarks/results/projection``). Every input is named in the JSON with its file and row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent / "results"
GIB = 1024**3

# Qwen3-8B shape (as rlk-repro's presets and the seeds use it).
MODEL = {
    "layers": 36,
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "ffn": 12288,
    "vocab": 151936,
    "tied": False,
}
TP, CP = 4, 2
GPUS = TP * CP


def _load(rel: str) -> dict:
    return json.loads((ROOT / rel).read_text())


def _params(m: dict) -> dict:
    h, d = m["hidden"], m["head_dim"]
    qkv = h * (m["heads"] + 2 * m["kv_heads"]) * d
    per_layer = qkv + m["heads"] * d * h + 3 * h * m["ffn"] + 2 * h + 2 * d
    embed = m["vocab"] * h
    total = m["layers"] * per_layer + embed * (1 if m["tied"] else 2) + h
    return {"per_layer": per_layer, "embedding": embed, "total": total}


def _gemm_rates(linear: dict) -> dict:
    """rlk TFLOP/s per 8B TP-4 projection at the largest measured M."""
    rates = {}
    for row in linear["rows"]:
        shape = row["shape"]
        if not shape.startswith("qwen3-8b/tp4/"):
            continue
        name = shape.rsplit("/", 1)[1]
        if name not in rates or row["M"] > rates[name]["M"]:
            rates[name] = {
                "M": row["M"],
                "N": row["N"],
                "K": row["K"],
                "rlk": row["rlk_tflops"],
                "native": row["native_tflops"],
            }
    return rates


def _attention_rate(rel: str, case: str) -> dict:
    """rlk and cuDNN (what a TE-based native run uses) TFLOP/s of one attention bench row."""
    for row in _load(rel)["rows"]:
        if row["case"] == case:
            return {"rlk": row["rlk_tflops"], "native": row["cudnn_tflops"]}
    raise KeyError(f"{rel}: no row {case!r}")


def _collective_busbw(coll: dict) -> dict:
    """rlk bus bandwidth (GB/s) at the largest measured size, per collective."""
    best: dict[str, dict] = {}
    for row in coll["rows"]:
        if row["op"] not in best or row["bytes"] > best[row["op"]]["bytes"]:
            best[row["op"]] = row
    return {op: {"bytes": r["bytes"], "rlk": r["rlk_busbw"], "native": r["nccl_busbw"]} for op, r in best.items()}


def _step(which: str, t_local: int, micro_batches: int, rates: dict, attn: dict, bw: dict, copy_tbps: float) -> dict:
    """Device time of one training step on one GPU with ``which`` ("rlk" or "native") throughputs."""
    m = MODEL
    h, d, layers = m["hidden"], m["head_dim"], m["layers"]
    seq_len = t_local * CP  # the packed sequence length a micro-batch covers

    # GEMMs per layer per rank: the forward at the measured rate, backward = 2x the forward's work.
    gemm_ms = 0.0
    for name in ("qkv", "o", "gate_up", "down"):
        r = rates[name]
        gemm_ms += 3 * 2.0 * t_local * r["N"] * r["K"] / (r[which] * 1e12) * 1e3
    gemm_ms *= layers
    head = rates["lm_head"]
    head_ms = 3 * 2.0 * t_local * head["N"] * head["K"] / (head[which] * 1e12) * 1e3

    # Attention per rank: local heads over the full causal sequence, half of it per CP rank (zigzag);
    # the backward does 2.5x the forward's work.
    causal_flop = 4.0 * seq_len * seq_len * (m["heads"] // TP) * d / 2
    attn_ms = layers * causal_flop / CP * (1 / attn["fwd"][which] + 2.5 / attn["bwd"][which]) / 1e12 * 1e3

    # Element-wise ops: ~2 norms, SwiGLU, RoPE per layer, read+write, forward and backward (~3x); the
    # same on both paths (rlk's are at copy bandwidth, SUMMARY.md).
    act_bytes = t_local * (2 * h + 2 * m["ffn"] // TP + (m["heads"] + m["kv_heads"]) // TP * d) * 2 * 2
    elementwise_ms = layers * 3 * act_bytes / (copy_tbps * 1e12) * 1e3

    # TP (sequence parallel): 2 all-gathers + 2 reduce-scatters of the CP shard (t_local x hidden, bf16)
    # per layer forward, the mirror in backward. CP: K/V all-gather forward, dK/dV reduce-scatter
    # backward. All-gathers are charged at the reduce-scatter's bus bandwidth (no all-gather row).
    gbps = bw["reduce_scatter"][which]
    tp_ms = layers * 8 * (t_local * h * 2 * (TP - 1) / TP) / (gbps * 1e9) * 1e3
    kv_bytes = 2 * seq_len * (m["kv_heads"] // TP) * d * 2
    cp_ms = layers * 2 * (kv_bytes * (CP - 1) / CP) / (gbps * 1e9) * 1e3

    per_micro = {
        "gemm_ms": gemm_ms,
        "lm_head_ms": head_ms,
        "attention_ms": attn_ms,
        "elementwise_ms": elementwise_ms,
        "tp_collectives_ms": tp_ms,
        "cp_collectives_ms": cp_ms,
    }
    micro_ms = sum(per_micro.values())
    params = _params(m)["total"]
    # Optimizer: fp32 master + moments (16 B/param read and written) over this rank's shard, at copy speed;
    # gradient reduce-scatter over the CP pair (the distributed optimizer's data-parallel group).
    optimizer_ms = params / TP / CP * 16 * 2 / (copy_tbps * 1e12) * 1e3
    grad_sync_ms = (params / TP * 4) * (CP - 1) / CP / (gbps * 1e9) * 1e3
    step_s = (micro_batches * micro_ms + optimizer_ms + grad_sync_ms) / 1e3
    return {
        "per_micro_batch_ms": per_micro,
        "micro_batch_ms": micro_ms,
        "optimizer_ms": optimizer_ms,
        "grad_sync_ms": grad_sync_ms,
        "step_s": step_s,
    }


def tp_invariant_partials(t_local: int, micro_batches: int, bw: dict, step_s: float, tp: int) -> dict:
    """The extra bytes of TP-invariant mode (``rlk.gemm.tp.v1``, docs/ops/linear_tp.md) at TP ``tp``: the two
    row-parallel reductions per layer (o_proj, down_proj) move fp32 partials instead of the bf16 sums, forward only
    (their backward moves bf16 gradients as before). Training with sequence parallelism: a reduce-scatter of
    ``t_local x hidden`` per reduction, ``(W-1)/W`` of it per rank (plus the same again where activation
    checkpointing recomputes the forward, not charged here). Rollout decode (no SP): an all-reduce per reduction,
    ``2 (W-1)/W`` of ``hidden`` elements per token per rank. Time at the bus bandwidth measured on two H200s over
    NVLink, NCCL's and rlk's (W = 2 standing in for W = 4 / 8, as everywhere in this projection)."""
    m = MODEL
    h, layers = m["hidden"], m["layers"]
    share = (tp - 1) / tp
    per_micro = {
        dtype: layers * 2 * share * t_local * h * size for dtype, size in (("bf16", 2), ("fp32", 4))
    }
    extra = per_micro["fp32"] - per_micro["bf16"]
    out = {
        "tp": tp,
        "train_bytes_per_rank_per_micro_batch": per_micro,
        "train_extra_bytes_per_rank_per_step": extra * micro_batches,
        "rollout_decode_extra_bytes_per_token_per_rank": layers * 2 * 2 * share * h * (4 - 2),
    }
    for which in ("native", "rlk"):
        gbps = bw["reduce_scatter"][which]
        ms = extra * micro_batches / (gbps * 1e9) * 1e3
        out[f"train_extra_ms_per_step_at_{which}_busbw"] = ms
        out[f"train_extra_share_of_rlk_step_at_{which}_busbw"] = ms / 1e3 / step_s
    return out


def project(tokens_per_step: int, tokens_per_gpu: int) -> dict:
    m = MODEL
    h, d, layers = m["hidden"], m["head_dim"], m["layers"]
    params = _params(m)
    linear = _load("h200/linear.json")
    rates = _gemm_rates(linear)
    attn = {
        "fwd": _attention_rate("h200/attention_prefill.json", "qwen3-8b 1x8192 causal"),
        "bwd": _attention_rate("h200/attention_backward.json", "qwen3-8b 1x8192 causal backward"),
    }
    bw = _collective_busbw(_load("h200x2/collectives/collectives.json"))
    copy_tbps = linear["meta"]["copy"]["tb_per_s"]
    # Tokens one CP rank holds in a micro-batch: the TP region's GEMMs see all of them (M = t_local);
    # sequence parallelism splits the rest of the layer over the TP ranks.
    t_local = tokens_per_gpu
    micro_batches = max(1, -(-tokens_per_step // (t_local * CP)))
    steps = {which: _step(which, t_local, micro_batches, rates, attn, bw, copy_tbps) for which in ("rlk", "native")}
    for step in steps.values():
        step["train_tokens_per_s"] = tokens_per_step / step["step_s"]

    # Memory per GPU (training side): bf16 weights, fp32 main grads, distributed optimizer over DP x CP.
    mem = {
        "weights_bf16_gib": params["total"] / TP * 2 / GIB,
        "main_grads_fp32_gib": params["total"] / TP * 4 / GIB,
        "optimizer_fp32_gib": params["total"] / TP / CP * 12 / GIB,
        "checkpointed_activations_gib": layers * t_local // TP * h * 2 / GIB,
        "one_layer_recompute_gib": t_local
        * (6 * h + 3 * m["ffn"] // TP + 4 * (m["heads"] + 2 * m["kv_heads"]) // TP * d)
        * 2
        / GIB,
        "logp_rlk_gib": t_local * 256 * 4 / GIB,
        "logp_native_logits_gib": t_local * (m["vocab"] // TP) * 4 / GIB,
    }
    train_gib = sum(v for k, v in mem.items() if k != "logp_native_logits_gib")
    rollout = {
        "weights_bf16_gib": params["total"] / TP * 2 / GIB,
        "kv_bytes_per_token_per_gpu": 2 * layers * (m["kv_heads"] // TP) * d * 2,
    }
    return {
        "model": m,
        "parallel": {"tp": TP, "cp": CP, "gpus": GPUS, "dp": 1},
        "params": params,
        "tokens_per_step": tokens_per_step,
        "tokens_per_gpu": tokens_per_gpu,
        "micro_batches": micro_batches,
        "inputs": {
            "gemm_tflops": rates,
            "gemm_rows": {k: f"h200/linear.json qwen3-8b/tp4/{k} M={v['M']}" for k, v in rates.items()},
            "attention_tflops": attn,
            "attention_rows": "h200/attention_prefill.json / attention_backward.json, qwen3-8b 1x8192 (native = cuDNN)",
            "collective_busbw_gbps": bw,
            "copy_tbps": copy_tbps,
        },
        "steps": steps,
        "rlk_vs_native": steps["native"]["step_s"] / steps["rlk"]["step_s"],
        "tp_invariant_partials": {
            f"tp{tp}": tp_invariant_partials(t_local, micro_batches, bw, steps["rlk"]["step_s"], tp) for tp in (4, 8)},
        "memory_per_gpu": {**mem, "training_total_gib": train_gib},
        "rollout_per_gpu": rollout,
        "not_modelled": [
            "host time (launches); the 0.6B provider step is host-bound today",
            "overlap of collectives with compute (none assumed on either path)",
            "W = 4 bus bandwidth (W = 2 measured stands in)",
            "activation memory of the attention backward's scratch and allocator fragmentation",
        ],
    }


def _markdown(p: dict) -> str:
    rlk, nat = p["steps"]["rlk"], p["steps"]["native"]
    mem = p["memory_per_gpu"]
    rows = [
        f"| {k.removesuffix('_ms').replace('_', ' ')} | {v:.1f} | {nat['per_micro_batch_ms'][k]:.1f} |"
        for k, v in rlk["per_micro_batch_ms"].items()
    ]
    lines = [
        "# Paper projection: Qwen3-8B shape, training TP 4 / CP 2 on 8 H200s (issue 22)",
        "",
        f"Not a measurement: derived by `benchmarks/projection.py` from the committed H200 results "
        f"(rlk's measured throughputs beside cuBLAS / cuDNN / NCCL measured in the same runs). "
        f"{p['params']['total'] / 1e9:.2f} B parameters; {p['tokens_per_step']:,} tokens per step in "
        f"{p['micro_batches']} micro-batches of {p['tokens_per_gpu']:,} tokens per GPU (sequence "
        f"{p['tokens_per_gpu'] * p['parallel']['cp']:,} across CP).",
        "",
        "| per micro-batch, per GPU (ms) | rlk | native |",
        "| --- | --- | --- |",
        *rows,
        f"| **micro-batch total** | **{rlk['micro_batch_ms']:.1f}** | **{nat['micro_batch_ms']:.1f}** |",
        f"| optimizer + CP gradient sync (per step) | {rlk['optimizer_ms'] + rlk['grad_sync_ms']:.1f} | "
        f"{nat['optimizer_ms'] + nat['grad_sync_ms']:.1f} |",
        f"| **step (s)** | **{rlk['step_s']:.2f}** | **{nat['step_s']:.2f}** |",
        f"| training tokens/s (8 GPUs) | {rlk['train_tokens_per_s']:,.0f} | {nat['train_tokens_per_s']:,.0f} |",
        "",
        f"Projected rlk / native training throughput: **{p['rlk_vs_native']:.2f}x** (device time only).",
        "",
        "| memory per GPU (training) | GiB |",
        "| --- | --- |",
        *[f"| {k.removesuffix('_gib').replace('_', ' ')} | {v:.2f} |" for k, v in mem.items()],
        "",
        f"Rollout (vLLM TP 4): weights {p['rollout_per_gpu']['weights_bf16_gib']:.2f} GiB per GPU, KV cache "
        f"{p['rollout_per_gpu']['kv_bytes_per_token_per_gpu']:,} bytes per token per GPU.",
        "",
        "TP-invariant mode (`rlk.gemm.tp.v1`): the row-parallel reductions move fp32 partials instead of bf16 "
        "sums (forward only; SP reduce-scatter in training, all-reduce per decode token in rollout):",
        "",
        "| TP | extra bytes per rank per step (training) | ms per step at NCCL / rlk bus bandwidth | share of the "
        "rlk step | extra bytes per decode token per rank |",
        "| --- | --- | --- | --- | --- |",
        *[f"| {t['tp']} | {t['train_extra_bytes_per_rank_per_step'] / GIB:.2f} GiB | "
          f"{t['train_extra_ms_per_step_at_native_busbw']:.1f} / {t['train_extra_ms_per_step_at_rlk_busbw']:.1f} | "
          f"{100 * t['train_extra_share_of_rlk_step_at_rlk_busbw']:.1f}% | "
          f"{t['rollout_decode_extra_bytes_per_token_per_rank']:,.0f} |" for t in p["tp_invariant_partials"].values()],
        "",
        "Not modelled: " + "; ".join(p["not_modelled"]) + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens-per-step", type=int, default=256 * 2048, help="tokens per optimizer step")
    parser.add_argument("--tokens-per-gpu", type=int, default=8192, help="tokens per GPU per micro-batch")
    parser.add_argument("--out", type=Path, default=ROOT / "projection")
    args = parser.parse_args(argv)
    p = project(args.tokens_per_step, args.tokens_per_gpu)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "projection_qwen3-8b_tp4_cp2"
    stem.with_suffix(".json").write_text(json.dumps(p, indent=2) + "\n")
    stem.with_suffix(".md").write_text(_markdown(p))
    print(_markdown(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
