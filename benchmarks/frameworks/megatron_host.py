#!/usr/bin/env python3
"""Host time per layer of a Megatron training step: the rlk provider's spec next to the stock local spec.

The H200 step of ``megatron_gpu.py`` is host-bound (rlk's kernels take a third of the step), so what the
provider's Python costs per layer is the number to cut. This measures it where compute is negligible or
can be taken out: a tiny-width, many-layer ``GPTModel`` (hidden 64, 4 heads, the builders, weights, batch
and GRPO loss of ``tests/frameworks/megatron_setup.py``) on the real megatron-core, forward + backward per step
(the AdamW step runs between timed steps, untimed, so the weight caches see a new weight every step as in
training).

Per layer = the difference between two depths (``--layers 2,10``: (t(10) - t(2)) / 8), so the embedding,
the LM head and the loss are not charged to the layers. Columns:

- ``wall``: the step's time per layer (CPU: this thread's CPU time, steady on a shared machine; CUDA: wall
  time, synchronised after the backward);
- ``in backends``: time inside the rlk backends' functions (``Backend.fn``, what the op layer runs after
  choosing a backend, or the launch plan ``Backend.plan_fn`` where it runs that itself: ``rlk.triton``). On CUDA
  that is the launchers' host time. On the CPU the backends are stubbed after the warm-up (``--backends stub``,
  :class:`BackendClock`): the ``rlk.reference`` arithmetic (fixed-order reductions written in PyTorch, the slow
  CPU specification) is ~10x the host time around it and its noise would hide that; a stub returns fresh zero
  tensors shaped as the real call's outputs were;
- ``host``: ``wall - in backends``: the provider, megatron-core, autograd and rlk-core's op layer around the
  backends — what the GPU run pays per layer besides the launches. The stock model has no rlk backends: its
  ``host`` is its wall, its CPU kernels included (at this width each costs about what a launch does).

``RLK_VALUE_CHECKS=never`` by default: the GPU path (its ``auto`` reads no device values; on the CPU
``auto`` adds the ops' range checks of index values, which a GPU run skips).

Then ``cProfile`` over ``--profile-steps`` steps of each model at both depths, the backends' subtrees left
out (the profiler is off inside them), per layer as the two depths' difference: the top self-time
functions, self time per source area (provider, rlk-core op layer, megatron-core, torch, other) and the
Python function calls (a count, not a time: the same on every run, so a change in it shows where timing
noise would hide it).

    .venv/bin/python benchmarks/frameworks/megatron_host.py --out benchmarks/results/cpu
    python3 benchmarks/frameworks/megatron_host.py --device cuda --out $OUT     # the H200 (bf16)

Writes ``megatron_host.json`` and ``megatron_host.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "frameworks"))
import megatron_gpu as mg  # the H200 step timing, beside this file
import megatron_setup as S  # the framework tests' model builders

AREAS = (("provider", "rlk_megatron_provider/"), ("rlk-core ops", "rlk_core/"),
         ("rlk-collectives", "rlk_collectives/"), ("megatron-core", "megatron/core/"), ("torch", "torch/"))


class BackendClock:
    """Wraps every registered rlk backend's ``fn`` — and its launch plan ``plan_fn``, which the op layer calls in
    place of ``fn`` (``rlk.triton``: the plan on the device's JIT plan) — to add up the time spent inside (outermost
    calls only), and to switch a running ``cProfile`` profiler off there, so the profile shows what is around them.

    ``stub=True`` (set after the warm-up): a call whose inputs (shapes, dtypes, devices, other arguments)
    were seen before returns fresh zero tensors shaped as that call's outputs were, instead of computing
    them. For the CPU, where the reference arithmetic is ~10x the host time around it and its run-to-run
    noise would swamp the host's: what remains is the host's work (the values are not looked at by it; the
    step's results are not used). Never on CUDA (the launches are host time there)."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock, self.seconds, self.calls, self.profiler, self._depth, self._orig = clock, 0.0, 0, None, 0, []
        self.stub, self._outputs = False, {}

    def install(self) -> BackendClock:
        from rlk_core.backends import REGISTRY
        from rlk_core.contracts import OP_CONTRACTS
        from rlk_core.ops._plan import resolve_fn

        for op in OP_CONTRACTS:
            for b in REGISTRY.backends(op):
                self._orig.append((b, b.fn, b.plan_fn))
                b.fn = self._wrap(b.fn, (op, b.id))
                # a plan the op layer would resolve at the backend's first call and then run past fn: resolved now
                plan = b.plan_fn or (resolve_fn(b.plan) if getattr(b, "plan", None) else None)
                if plan is not None:
                    b.plan_fn = self._wrap(plan, (op, b.id))
        return self

    def uninstall(self) -> None:
        for b, fn, plan_fn in self._orig:
            b.fn, b.plan_fn = fn, plan_fn
        self._orig.clear()

    def _wrap(self, fn, name):
        import torch

        clock, outputs = self.clock, self._outputs

        def sig(a):
            if isinstance(a, torch.Tensor):
                return tuple(a.shape), a.stride(), a.dtype, a.device
            return tuple(sig(x) for x in a) if isinstance(a, (tuple, list)) else a

        def signature(args):
            return (name, *(sig(a) for a in args))

        def zeros(out):
            if isinstance(out, torch.Tensor):
                return torch.zeros_like(out, memory_format=torch.preserve_format)
            return type(out)(zeros(o) for o in out) if isinstance(out, (tuple, list)) else out

        def run(args):
            if not self.stub:
                return fn(*args)
            key = signature(args)
            seen = outputs.get(key)
            if seen is None:
                seen = outputs[key] = fn(*args)
            return zeros(seen)

        def timed(*args):
            if self._depth:
                return fn(*args)
            prof = self.profiler
            if prof is not None:
                prof.disable()
            self._depth, t = 1, clock()
            try:
                return run(args)
            finally:
                self.seconds += clock() - t
                self.calls += 1
                self._depth = 0
                if prof is not None:
                    prof.enable()
        return timed


def _cfg(layers: int):
    from rlk_repro.model.config import Qwen3Config

    return Qwen3Config(**dict(S.SHAPES["tiny"], num_hidden_layers=layers), rms_norm_eps=1e-6, rope_theta=1e6,
                       max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None, eos_token_id=1)


def _setup(layers: int, rlk: bool, dev, dtype, n: int, s: int):
    """The model of ``layers`` layers (rlk spec or stock local spec), its optimizer, batch and a step
    function: ``fwd_bwd()`` (timed) and ``update()`` (the optimizer step, untimed)."""
    from rlk_repro.engine.frameworks_megatron import MasterOptimizer

    cfg = _cfg(layers)
    w = S.make_weights(cfg, dev, seed=5)
    model, _ = S.build(cfg, dev, dtype, rlk)
    opt = MasterOptimizer(model, S.load(model, cfg, w), lr=S.LR, foreach=True)
    b = S.Batch(cfg, [s] * n, 1, dev, seed=17)
    box = S.hidden_head(model) if rlk else None

    def fwd_bwd():
        opt.zero_grad()
        lp = S.rlk_logp(model, box, b) if rlk else S.stock_logp(model, b)
        S.grpo_loss(lp, b.adv).backward()

    return fwd_bwd, opt.step


def measure(layers: int, rlk: bool, dev, dtype, n: int, s: int, warmup: int, iters: int, clock: BackendClock,
            profile_steps: int = 0, stub: bool = False) -> dict:
    import torch

    fwd_bwd, update = _setup(layers, rlk, dev, dtype, n, s)
    cuda = dev.type == "cuda"
    now = clock.clock
    for _ in range(warmup):
        fwd_bwd()
        update()
    clock.stub = stub
    fwd_bwd()  # with stubs: records each call's outputs (computed once more)
    update()
    wall, inside, enqueue = [], [], []
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
        clock.seconds, clock.calls = 0.0, 0
        t0 = now()
        fwd_bwd()
        t1 = now()
        if cuda:
            torch.cuda.synchronize()
        wall.append(now() - t0)
        enqueue.append(t1 - t0)
        inside.append(clock.seconds)
        update()
    host = [w - i for w, i in zip(wall, inside)]
    out = {"layers": layers, "wall_ms": statistics.median(wall) * 1e3,
           "in_backends_ms": statistics.median(inside) * 1e3, "backend_calls": clock.calls,
           "host_ms": statistics.median(host) * 1e3, "host_min_ms": min(host) * 1e3}
    if cuda:
        out["enqueue_ms"] = statistics.median(enqueue) * 1e3
    if profile_steps:
        prof = cProfile.Profile()
        clock.profiler = prof
        prof.enable()
        for _ in range(profile_steps):
            fwd_bwd()
        prof.disable()
        clock.profiler = None
        out["profile"] = _profile_stats(prof, profile_steps)
    clock.stub = False
    return out


def _area(path: str) -> str:
    for name, mark in AREAS:
        if mark in path:
            return name
    return "other"


def _profile_stats(prof: cProfile.Profile, steps: int) -> dict:
    """Per step, by function: self time (us), calls and source area; a builtin's (a torch C method's ...)
    self time is split over the areas of the Python functions that called it."""
    out = {}
    for (path, line, name), (_cc, calls, tottime, _cum, callers) in pstats.Stats(prof).stats.items():
        if path == "~" and callers:
            by_area = {}
            for (cpath, _l, _n), (_c, _nc, tt, _ct) in callers.items():
                by_area[_area(cpath)] = by_area.get(_area(cpath), 0.0) + tt / steps * 1e6
            label = "builtin, from " + "/".join(sorted(by_area))
        else:
            by_area, label = {_area(path): tottime / steps * 1e6}, _area(path)
        out[f"{mg._short_path(path)}:{line}({name})"] = (tottime / steps * 1e6, calls / steps, label, by_area)
    return out


def profile_per_layer(a: dict, b: dict, layers: int, top: int = 25) -> dict:
    """The difference of two depths' profiles per layer: self time by area, Python calls (all and by area:
    deterministic, unlike times), the top ``top`` functions by self time."""
    rows, areas, calls = [], {}, {}
    for fn in set(a) | set(b):
        us_b, n_b, label, area_b = b.get(fn, (0.0, 0, None, {}))
        us_a, n_a, label_a, area_a = a.get(fn, (0.0, 0, None, {}))
        label = label or label_a
        for k in set(area_a) | set(area_b):
            areas[k] = areas.get(k, 0.0) + (area_b.get(k, 0.0) - area_a.get(k, 0.0)) / layers
        if not label.startswith("builtin"):
            calls[label] = calls.get(label, 0) + (n_b - n_a) / layers
        rows.append({"us": round((us_b - us_a) / layers, 2), "calls": round((n_b - n_a) / layers, 2), "area": label,
                     "function": fn})
    rows.sort(key=lambda r: -r["us"])
    return {"self_us_by_area": {k: round(v, 1) for k, v in sorted(areas.items(), key=lambda kv: -kv[1])},
            "python_calls": round(sum(calls.values()), 1),
            "python_calls_by_area": {k: round(v, 1) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])},
            "top_self": rows[:top]}


def per_layer(a: dict, b: dict, key: str) -> float:
    return (b[key] - a[key]) / (b["layers"] - a["layers"]) * 1e3  # ms per step -> us per layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--layers", default="2,10", help="two depths, per layer = their difference")
    ap.add_argument("--seqs", type=int, default=2, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=16, help="tokens per sequence")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=25)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (tiny tensors: 1 is steadier)")
    ap.add_argument("--value-checks", default="never", choices=("never", "auto"),
                    help="RLK_VALUE_CHECKS: 'never' (default) is the GPU's path (auto reads no device values); "
                         "'auto' on the CPU adds the ops' range checks of index values, which a GPU run skips")
    ap.add_argument("--backends", default=None, choices=("stub", "real"),
                    help="rlk backends after the warm-up: 'stub' (default on the CPU; see BackendClock) or 'real' "
                         "(always on CUDA)")
    args = ap.parse_args()
    stub = (args.backends or ("stub" if args.device == "cpu" else "real")) == "stub"
    if stub and args.device == "cuda":
        ap.error("--backends stub is for the CPU (on CUDA the launches are the host time measured)")
    lo, hi = (int(x) for x in args.layers.split(","))
    os.environ.update(S.R_ENV)
    os.environ["RLK_VALUE_CHECKS"] = args.value_checks
    import torch

    torch.set_num_threads(args.threads)
    if args.device == "cpu":  # denormal fp32 gradients would make the stock model's CPU kernels crawl
        torch.set_flush_denormal(True)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    S.init_world(args.device)
    import rlk_megatron_provider as prov

    prov.initialize_from_environment()
    # CPU: this thread's CPU time (steady on a shared machine: time descheduled is not counted); CUDA: wall
    clock = BackendClock(time.thread_time if args.device == "cpu" else time.perf_counter).install()
    res = {"meta": {"device": args.device, "dtype": str(dtype), "python": platform.python_version(),
                    "torch": torch.__version__, "commit": _commit(), "argv": sys.argv,
                    "threads": torch.get_num_threads(), "RLK_VALUE_CHECKS": args.value_checks,
                    "backends": "stub (zero outputs of the recorded shapes, after the warm-up)" if stub else "real",
                    "model": {**S.SHAPES["tiny"], "num_hidden_layers": [lo, hi]},
                    "tokens": args.seqs * args.seq_len, "layout": {"rlk": "thd packed", "stock": "sbhd"},
                    "clock": "thread CPU time" if args.device == "cpu" else "wall (CUDA synchronised)",
                    "what": "forward + backward (AdamW between steps, untimed); per layer = (t(hi) - t(lo)) / "
                            "(hi - lo), medians (host_min: minima); host = wall - time inside rlk backends"}}
    if args.device == "cuda":
        res["meta"]["gpu"] = torch.cuda.get_device_name(0)
    for name, rlk in (("rlk", True), ("stock", False)):
        a, b = (measure(n, rlk, dev, dtype, args.seqs, args.seq_len, args.warmup, args.iters, clock,
                        args.profile_steps, stub) for n in (lo, hi))
        r = res[name] = {"per_layer_us": {k: round(per_layer(a, b, k), 1) for k in
                                          ("wall_ms", "in_backends_ms", "host_ms", "host_min_ms")}}
        if args.profile_steps:
            r["profile_per_layer"] = profile_per_layer(a.pop("profile"), b.pop("profile"), hi - lo)
        r["depths"] = [a, b]
        if "enqueue_ms" in a:
            r["per_layer_us"]["enqueue_ms"] = round(per_layer(a, b, "enqueue_ms"), 1)
        S._free()
        S.log(f"{name}: per layer {r['per_layer_us']}")
    res["host_ratio_rlk_over_stock"] = round(res["rlk"]["per_layer_us"]["host_ms"]
                                             / res["stock"]["per_layer_us"]["host_ms"], 3)
    clock.uninstall()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "megatron_host.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    with open(os.path.join(args.out, "megatron_host.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


def markdown(res: dict) -> str:
    m = res["meta"]
    lo, hi = m["model"]["num_hidden_layers"]
    lines = [f"# Megatron provider host time per layer ({m['device']}, {m['dtype']}, commit {m['commit']})", "",
             f"GPTModel hidden {m['model']['hidden_size']}, {m['model']['num_attention_heads']} heads, "
             f"{lo} and {hi} layers, {m['tokens']} tokens; {m['what']}.", "",
             f"Clock: {m['clock']}; RLK_VALUE_CHECKS={m['RLK_VALUE_CHECKS']}; rlk backends: {m['backends']}.", "",
             "| spec | wall us/layer | in rlk backends us/layer | host us/layer | host us/layer (minima) |",
             "| --- | --- | --- | --- | --- |"]
    for name in ("rlk", "stock"):
        p = res[name]["per_layer_us"]
        lines.append(f"| {name} | {p['wall_ms']} | {p['in_backends_ms']} | {p['host_ms']} | {p['host_min_ms']} |")
    lines += ["", f"host rlk / stock: {res['host_ratio_rlk_over_stock']}"]
    if "enqueue_ms" in res["rlk"]["per_layer_us"]:
        lines.append("enqueue (the Python thread's time to the end of the backward, before the synchronize), us per "
                     "layer: " + ", ".join(f"{n} {res[n]['per_layer_us']['enqueue_ms']}" for n in ("rlk", "stock")))
    lines.append("")
    for name in ("rlk", "stock"):
        prof = res[name].get("profile_per_layer")
        if not prof:
            continue
        lines += [f"## {name}: cProfile per layer (two depths' difference; rlk backends left out)", "",
                  "Self time, us (under cProfile, which adds about 1 us per Python call): "
                  + ", ".join(f"{k} {v}" for k, v in prof["self_us_by_area"].items()) + ".", "",
                  f"Python calls: {prof['python_calls']} ("
                  + ", ".join(f"{k} {v}" for k, v in prof["python_calls_by_area"].items()) + ").", "",
                  "| self us | calls | area | function |", "| --- | --- | --- | --- |"]
        lines += [f"| {r['us']} | {r['calls']} | {r['area']} | `{r['function']}` |" for r in prof["top_self"]]
        lines.append("")
    return "\n".join(lines)


def _commit() -> str:
    if os.environ.get("RLK_COMMIT"):
        return os.environ["RLK_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


if __name__ == "__main__":
    sys.exit(main())
