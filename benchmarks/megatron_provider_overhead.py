#!/usr/bin/env python3
"""rlk-megatron-provider's own per-step cost on a CPU: the torch ops it issues around the rlk ops, and its
Python time, vs Megatron's stock local spec.

One training step (forward + backward of the GRPO loss, no optimizer) of a ``GPTModel`` built as
``tests/frameworks/megatron_setup.py`` builds it (rlk layer spec, every module R, strict; or the stock
local spec), on the CPU (fp32, gloo, a world of 1). Two measurements, each on its own step:

1. **ops**: ``tests/megatron/_opcount.py``'s ``OpCounter`` (a ``TorchDispatchMode``) sees every top-level op
   the step issues — an rlk op (``rlk::linear``, ``rlk::rms_norm`` ...) counts as one, its own inner kernels
   are not seen — and charges each to the innermost Python frame outside torch that issued it: ``provider``
   (rlk_megatron_provider), ``rlk_core`` (an rlk op's Python around its kernel, e.g. the linear backward's
   transposes), ``rlk_ref`` (the insides of a CPU reference kernel, e.g. a backward written in torch ops: one
   Triton / CUDA kernel on the GPU instead), ``collectives``, ``megatron``, ``harness`` (this script's loss)
   or ``autograd`` (C++ backward formulas of torch ops, gradient accumulation). Each is split into kernels
   (ops that launch work), allocations and views. The same torch ops run on the GPU outside ``rlk_ref``, so
   those counts are the GPU's launches around the rlk kernels.
2. **python**: cProfile of a step without the mode (the mode sends rlk ops through the dispatcher): the
   time of the provider's functions themselves plus the torch C calls they make directly.

Usage: ``python benchmarks/megatron_provider_overhead.py [--shape tiny|qwen3-0.6b] [--layers N]
[--tokens T] [--json out.json]``. With ``--shape qwen3-0.6b`` the model has the 0.6B widths and
``--layers`` layers (default 2); ``--vocab`` shrinks its LM head (the CPU reference GEMMs of the real
shape take minutes per step). ``--dtype bfloat16`` as on the H200.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "frameworks"))  # the framework tests' model builders
sys.path.insert(0, os.path.join(HERE, "..", "tests", "megatron"))  # the op and sync counters (test support)


def provider_python(prof: cProfile.Profile) -> dict:
    """ms of the provider's own functions (self time) + the C functions they call directly."""
    st = pstats.Stats(prof)
    own = c_calls = 0.0
    by_fn = collections.Counter()
    for func, (_cc, _nc, tt, _ct, callers) in st.stats.items():
        fname = func[0]
        if "rlk_megatron_provider" in fname:
            own += tt
            by_fn[f"{os.path.basename(fname)}:{func[1]}:{func[2]}"] += tt
        elif fname == "~":  # a builtin / C function: charge the part called from provider functions
            for caller, (_c2, _n2, tt2, _ct2) in callers.items():
                if "rlk_megatron_provider" in caller[0]:
                    c_calls += tt2
                    by_fn[f"{os.path.basename(caller[0])}:{caller[1]}:{caller[2]} -> {func[2]}"] += tt2
    return {"self_ms": own * 1e3, "c_calls_ms": c_calls * 1e3, "total_ms": (own + c_calls) * 1e3,
            "top": [(k, round(v * 1e3, 3)) for k, v in by_fn.most_common(15)]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="tiny", choices=("tiny", "qwen3-0.6b"))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=256, help="packed tokens per step (sequences of 64)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=None,
                    help="override the vocabulary (the CPU reference LM head of 151,936 rows is slow; the "
                         "provider's per-layer cost does not depend on it)")
    ap.add_argument("--stock", action="store_true", help="also measure Megatron's stock local spec")
    ap.add_argument("--repeat", type=int, default=3, help="profiled python steps (median of the provider ms)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                    help="model dtype (the H200 benchmark trains bf16; casts show only there)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sites", type=int, default=25, help="print this many provider / rlk_core op sites")
    args = ap.parse_args()

    os.environ.update({"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R",
                       "RL_KERNEL_LOGP_CASE": "R/R", "RL_KERNEL_MODE": "strict"})
    import warnings

    warnings.filterwarnings("ignore")
    import megatron_setup as mg
    import torch
    from _opcount import OpCounter, kind

    from rlk_repro.model.config import Qwen3Config

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    mg.init_world("cpu")
    import rlk_megatron_provider as prov

    prov.initialize_from_environment()
    base = dict(mg.SHAPES[args.shape])
    base["num_hidden_layers"] = args.layers if args.shape != "tiny" else base["num_hidden_layers"]
    if args.vocab:
        base["vocab_size"] = args.vocab
    cfg = Qwen3Config(**base, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                      tie_word_embeddings=True, bos_token_id=None, eos_token_id=1)
    dev, dtype = torch.device("cpu"), getattr(torch, args.dtype)
    w = mg.make_weights(cfg, dev, seed=5)
    n = max(1, args.tokens // args.seq)
    b = mg.Batch(cfg, [args.seq] * n, 1, dev, seed=17)
    layers = cfg.num_hidden_layers
    result = {"shape": args.shape, "layers": layers, "tokens": b.T, "dtype": args.dtype, "torch": torch.__version__}
    try:
        from rlk_megatron_provider import _compat

        result["megatron_core"] = _compat.version()
    except Exception:
        pass

    for name, rlk in (("rlk", True), ("stock", False)) if args.stock else (("rlk", True),):
        model, _ = mg.build(cfg, dev, dtype, rlk=rlk)
        mg.load(model, cfg, w)
        box = mg.hidden_head(model) if rlk else None

        def step(model=model, box=box, rlk=rlk):
            model.zero_grad(set_to_none=True)
            lp = mg.rlk_logp(model, box, b) if rlk else mg.stock_logp(model, b)
            mg.grpo_loss(lp, b.adv).backward()

        step()  # warm-up: caches (QKV rows, batch index) built as in a training loop's second step
        with OpCounter() as oc:
            step()
        by_owner = collections.Counter()
        by_kind = collections.Counter()  # (owner, kind)
        for (owner, op), c in oc.counts.items():
            by_owner[owner] += c
            by_kind[(owner, kind(op))] += c
        rlk_ops = sum(c for (o, op), c in oc.counts.items() if op.startswith("rlk::"))
        torch_ops = sum(by_owner.values()) - rlk_ops
        rec = {"ops_per_step": dict(by_owner), "rlk_ops_per_step": rlk_ops, "torch_ops_per_step": torch_ops,
               "provider_torch_ops_per_step": by_owner.get("provider", 0),
               "rlk_core_torch_ops_per_step": sum(c for (o, op), c in oc.counts.items()
                                                  if o == "rlk_core" and not op.startswith("rlk::")),
               "kernels_per_step": {o: by_kind[(o, "kernel")] for o in by_owner},
               "allocs_per_step": {o: by_kind[(o, "alloc")] for o in by_owner},
               "views_per_step": {o: by_kind[(o, "view")] for o in by_owner},
               "ops": {f"{o} {op}": c for (o, op), c in sorted(oc.counts.items(), key=lambda kv: -kv[1])},
               "sites": [f"{c:5d}  {o:9s} {site}  {op}" for (o, site, op), c in oc.where.most_common(args.sites)]}
        walls, provs = [], []
        for _ in range(args.repeat):
            prof = cProfile.Profile()
            t = time.perf_counter()
            prof.enable()
            step()
            prof.disable()
            walls.append((time.perf_counter() - t) * 1e3)
            provs.append(provider_python(prof))
        provs.sort(key=lambda p: p["total_ms"])
        med = provs[len(provs) // 2]
        rec["profiled_step_ms"] = round(sorted(walls)[len(walls) // 2], 1)
        rec["provider_python_ms_per_step"] = round(med["total_ms"], 3)
        rec["provider_python_ms_per_layer"] = round(med["total_ms"] / layers, 4)
        rec["provider_python_top"] = med["top"]
        result[name] = rec
        del model
        print(f"== {name}: {args.shape}, {layers} layers, {b.T} tokens, fwd+bwd")
        print(f"ops per step by issuer: {dict(by_owner)}")
        for k in ("kernels", "allocs", "views"):
            print(f"  torch {k:7s} by issuer: {rec[k + '_per_step']}")
        print(f"  rlk ops {rlk_ops}, torch ops {torch_ops} ({torch_ops / layers:.1f} per layer incl. head/embedding)")
        if rlk:
            print(f"  provider-issued torch ops: {rec['provider_torch_ops_per_step']}"
                  f" ({rec['provider_torch_ops_per_step'] / layers:.1f} per layer);"
                  f" rlk_core Python-issued torch ops: {rec['rlk_core_torch_ops_per_step']}")
            print(f"provider Python: {rec['provider_python_ms_per_step']} ms/step"
                  f" ({rec['provider_python_ms_per_layer']} ms/layer; profiled step {rec['profiled_step_ms']} ms)")
            for k, v in med["top"]:
                print(f"    {v:8.3f} ms  {k}")
            print("top op sites (provider / rlk_core):")
            for s in rec["sites"]:
                print("   ", s)
        print("top torch ops:")
        for k, v in list(rec["ops"].items())[:20]:
            print(f"    {v:6d}  {k}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
