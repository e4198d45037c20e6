#!/usr/bin/env python3
"""Step time of a Qwen3-MoE ``GPTModel`` in real megatron-core with rlk's MoE layer against the stock ``MoELayer``,
one GPU (issue 36's performance part: the Megatron training step R vs the stock MoE spec, target >= 1.0x).

    python benchmarks/frameworks/megatron_moe_gpu.py --out DIR [--model qwen3-moe-30b-a3b-L2] [--seqs 16 --seq-len 256]
    python benchmarks/frameworks/megatron_moe_gpu.py --out DIR --device cpu --tiny      # the flow, in seconds

The sides (each in a process of its own: the provider's plan is per process), on the same model, weights and batch:

- ``rlk``: every module R (``RL_KERNEL_*_CASE=R/R``): the provider's ``RlkMoELayer`` (``RlkTopKRouter``,
  ``RlkGroupedExperts``: ``moe_topk``, ``moe_grouped_linear``, ``moe_combine``), as the frameworks engine builds it
  (``rlk_repro.engine.frameworks_megatron``: Megatron's local MoE spec with the provider's slots);
- ``stock``: the ffn module P, attention and logp R: Megatron's own ``MoELayer`` with ``TopKRouter`` and
  ``SequentialMLP`` (one ``ColumnParallelLinear`` / ``RowParallelLinear`` pair per expert) and its all-gather token
  dispatcher — so the ratio is the MoE layer's (and its post-attention norm's: the ffn module) share only;
- ``stock-grouped``: the same with ``moe_grouped_gemm`` (``GroupedMLP``), where this megatron-core builds one
  without TransformerEngine: 0.16.1's ``GroupedMLP`` needs the ``grouped_gemm`` package; 0.19's local backend builds
  ``SequentialMLP`` for either setting (its grouped experts are ``TEGroupedMLP``). Skipped, with the reason, otherwise.

A step is forward + backward + AdamW on fp32 masters (``MasterOptimizer``, as the frameworks engine's), the batch
packed THD (the rlk attention in every side), the loss the local trainer's GRPO on rlk's log-probs from the hidden
states; timed by ``harness.step_times`` (CUDA events, medians after warm-up) and profiled (``megatron_gpu``'s
``device_profile``: kernels, launches, syncs per step). Each side also keeps its first step's log-probs: their
largest difference from rlk's is reported (the same model: only the MoE arithmetic differs). Writes
``megatron_moe_gpu.json`` / ``.md`` in ``--out``; ``speed_ratio`` = stock_ms / rlk_ms. Exit 1 if a side failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
for _p in (_ROOT / "benchmarks", _ROOT / "tests" / "frameworks", _ROOT / "tests" / "megatron",
           _ROOT / "benchmarks" / "frameworks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import megatron_setup as S  # noqa: E402

SIDES = ("rlk", "stock", "stock-grouped")
SPEED_TARGET = 1.0  # the issue's: rlk's step at least as fast as the stock MoE spec's
R_ALL = {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
         "RL_KERNEL_MODE": "strict"}


def side_env(side: str) -> dict[str, str]:
    """The plan of ``side``: every module R for rlk, the ffn module P (Megatron's MoE layer) for a stock side."""
    if side not in SIDES:
        raise ValueError(f"side {side!r} is not one of {', '.join(SIDES)}")
    return dict(R_ALL) if side == "rlk" else {**R_ALL, "RL_KERNEL_FFN_CASE": "P/P"}


def grouped_problem() -> str | None:
    """Why this megatron-core cannot build ``GroupedMLP`` without TransformerEngine (None: it can)."""
    from rlk_megatron_provider import _compat

    try:
        from megatron.core.transformer.moe.experts import GroupedMLP  # noqa: F401
    except ImportError:
        return (f"megatron-core {_compat.version()} has no GroupedMLP: its local backend builds SequentialMLP for "
                "moe_grouped_gemm too (the grouped experts are TEGroupedMLP, TransformerEngine's)")
    from megatron.core.transformer.moe import grouped_gemm_util

    if not grouped_gemm_util.grouped_gemm_is_available():
        return (f"megatron-core {_compat.version()}'s GroupedMLP needs the grouped_gemm package "
                "(github.com/fanshiqing/grouped_gemm), not installed here")
    return None


def model_cfg(name: str, tiny: bool):
    from rlk_repro.model.config import preset

    cfg = preset("qwen3-moe-tiny" if tiny else name)
    return cfg.with_overrides(max_position_embeddings=4096) if tiny else cfg


def build(cfg, dev, dtype, grouped: bool):
    """The frameworks engine's Qwen3-MoE ``GPTModel`` (the provider's spec on Megatron's local MoE spec; the plan in
    the environment decides the ffn slot), ``grouped``: the base spec's experts ``GroupedMLP``."""
    import dataclasses

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import rlk_megatron_provider as prov
    from rlk_megatron_provider.moe import stock_router_without_te
    from rlk_repro.engine.frameworks_megatron import transformer_config

    tc = transformer_config(cfg, 1, dev, dtype)
    if grouped:
        tc = dataclasses.replace(tc, moe_grouped_gemm=True)
    stock_router_without_te()  # a stock router's GEMM on megatron-core 0.16.1 without TE (a no-op elsewhere)
    base = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=grouped, qk_layernorm=True,
                                    normalization="RMSNorm")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(tc, transformer_layer_spec=prov.block_spec(tc, rope_theta=cfg.rope_theta, base=base),
                         vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                         position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
                         share_embeddings_and_output_weights=cfg.tie_word_embeddings, pre_process=True,
                         post_process=True, parallel_output=True)
    prov.prepare_model(model)
    return model.to(device=dev, dtype=dtype)


def run_side(args) -> dict:
    """One side in this process: build, load, time the steps; its first step's log-probs go to ``--child-out``.pt."""
    import torch
    from harness import step_times

    from rlk_megatron_provider.weights import to_megatron
    from rlk_repro.engine.frameworks_megatron import MasterOptimizer

    os.environ.update(side_env(args.side))
    os.environ.setdefault("RL_KERNEL_READBACK_DIR", os.path.join(args.out, "readbacks", args.side))
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    dev = torch.device(args.device)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    S.init_world(args.device)
    cfg = model_cfg(args.model, args.tiny)
    model = build(cfg, dev, dtype, grouped=args.side == "stock-grouped")
    layer = model.decoder.layers[0].mlp
    classes = [type(m).__name__ for m in (layer, layer.router, layer.experts)]
    layout = "grouped" if hasattr(layer.experts, "weight1") else "sequential"
    sd = to_megatron(cfg, S.make_weights(cfg, dev, seed=5), 1, 0, experts=layout)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"state dict mismatch: missing {missing[:6]}, unexpected {unexpected[:6]}")
    opt = MasterOptimizer(model, sd, lr=S.LR, foreach=True)
    del sd
    b = S.Batch(cfg, [args.seq_len] * args.seqs, 1, dev, seed=17)
    box = S.hidden_head(model)
    first: list = []

    def step():
        opt.zero_grad()
        lp = S.rlk_logp(model, box, b)
        if not first:
            first.append(lp.detach().float().cpu())
        S.grpo_loss(lp, b.adv).backward()
        opt.step()

    cuda = dev.type == "cuda"
    out = {"side": args.side, "classes": classes, "experts_layout": layout, "tokens": b.T,
           "layers": cfg.num_hidden_layers, "plan": side_env(args.side), **step_times(step, args.warmup, args.iters,
                                                                                       cuda)}
    if cuda and args.profile_steps:
        from megatron_gpu import device_profile

        out["profile"] = device_profile(step, args.profile_steps)
    torch.save(first[0], args.child_out + ".pt")
    return out


def child_main(args) -> int:
    try:
        res = {"status": "ok", **run_side(args)}
    except Exception as exc:  # the parent reports it
        import traceback

        res = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:4000],
               "traceback": traceback.format_exc()[-6000:]}
    Path(args.child_out).write_text(json.dumps(res, default=str))
    return 0 if res["status"] == "ok" else 1


def tables(data: dict) -> list[str]:
    t = data.get("timing", {})
    if not t:
        return []
    lines = ["", "| side | MoE layer / router / experts | step ms (median) | wall ms | peak GiB | stock / rlk speed "
                 "| kernel ms | kernels | max abs logp diff vs rlk |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for side, r in t.items():
        if not isinstance(r, dict) or "median_ms" not in r:
            continue
        pr = r.get("profile", {})
        lines.append(f"| {side} | {' / '.join(r.get('classes', []))} | {r['median_ms']} | {r.get('median_wall_ms')} | "
                     f"{r.get('peak_gib')} | {r.get('speed_ratio', '')} | {pr.get('kernel_ms_per_step')} | "
                     f"{pr.get('kernels_per_step')} | {r.get('logp_max_abs_diff_vs_rlk', '')} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="qwen3-moe-tiny, fp32, gloo (CPU smoke run)")
    ap.add_argument("--model", default="qwen3-moe-30b-a3b-L2", help="a Qwen3-MoE preset (rlk_repro.model.config)")
    ap.add_argument("--seqs", type=int, default=None, help="sequences per step (default 16; --tiny 4)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default 256; --tiny 16)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2; --tiny 1)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps (default 5; --tiny 2)")
    ap.add_argument("--profile-steps", type=int, default=2, help="torch.profiler steps per side on CUDA (0: none)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"comma list of {', '.join(SIDES)}")
    ap.add_argument("--budget-s", type=float, default=260.0, help="a side starts only while this much time is left")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # a child process: one side
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name, tiny, full in (("seqs", 4, 16), ("seq_len", 16, 256), ("warmup", 1, 2), ("iters", 2, 5)):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else full)
    sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad or not sides or sides[0] != "rlk":
        ap.error(f"--sides {args.sides!r}: a comma list of {', '.join(SIDES)} starting with rlk")
    if args.side:
        return child_main(args)
    S.NAME = "megatron_moe_gpu"
    meta = S.meta(argparse.Namespace(device=args.device, tiny=args.tiny, hybrid=False))
    meta.update(model="GPTModel (Qwen3-MoE)", preset="qwen3-moe-tiny" if args.tiny else args.model,
                seqs=args.seqs, seq_len=args.seq_len, warmup=args.warmup, iters=args.iters,
                speed_ratio="stock median_ms / rlk median_ms", speed_target=f">= {SPEED_TARGET}")
    rep = S.Report(args.out, meta, "megatron_moe_gpu")
    timing = rep.data["timing"] = {}
    lp = {}
    for side in sides:
        why = grouped_problem() if side == "stock-grouped" else None
        left = args.budget_s - (time.monotonic() - S.T0)
        if why is None and left < 30:
            why = f"time budget: {left:.0f} s left"
        if why:
            rep.skip(f"timing_{side}", why)
            timing[side] = {"skipped": why}
            continue
        with rep.stage(f"timing_{side}", required=side != "stock-grouped") as rec:
            res_path = os.path.join(args.out, f".{side}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--device", args.device,
                   "--model", args.model, "--seqs", str(args.seqs), "--seq-len", str(args.seq_len), "--warmup",
                   str(args.warmup), "--iters", str(args.iters), "--profile-steps", str(args.profile_steps),
                   "--side", side, "--child-out", res_path] + (["--tiny"] if args.tiny else [])
            S.log(f"{side}: {' '.join(cmd[2:])}")
            env = {**os.environ, "RLK_BENCH_PORT": str(29000 + (os.getpid() + len(lp) + 1) % 1000)}
            proc = subprocess.run(cmd, env=env, timeout=max(left, 30), text=True, capture_output=True)
            if not os.path.exists(res_path):
                raise RuntimeError(f"{side}: no result (rc {proc.returncode}): {proc.stderr[-3000:]}")
            res = json.loads(Path(res_path).read_text())
            os.unlink(res_path)
            if res["status"] != "ok":
                raise RuntimeError(f"{side}: {res['error']}\n{res.get('traceback', '')[-2000:]}")
            import torch

            lp[side] = torch.load(res_path + ".pt")
            os.unlink(res_path + ".pt")
            timing[side] = res
            if side != "rlk" and "rlk" in lp:
                res["speed_ratio"] = round(res["median_ms"] / timing["rlk"]["median_ms"], 3)
                res["logp_max_abs_diff_vs_rlk"] = S.max_abs(lp[side], lp["rlk"])
            rec.update(median_ms=res["median_ms"], classes=res["classes"],
                       **{k: res[k] for k in ("speed_ratio", "logp_max_abs_diff_vs_rlk") if k in res})
            S.log(f"{side}: {res['classes']} median {res['median_ms']} ms (wall {res['median_wall_ms']})"
                  + (f", stock / rlk {res['speed_ratio']}" if "speed_ratio" in res else ""))
    ratios = {s: r["speed_ratio"] for s, r in timing.items() if "speed_ratio" in r}
    rep.data.update(speed_ratios=ratios, below_target=sorted(s for s, v in ratios.items() if v < SPEED_TARGET))
    return rep.finish(0, tables(rep.data))


if __name__ == "__main__":
    sys.exit(main())
