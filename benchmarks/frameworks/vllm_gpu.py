#!/usr/bin/env python3
"""rlk-vllm-plugin inside real vLLM on one GPU: bitwise rollout == training recompute, controls, throughput.

One command (the lead's, on one H200 after the two-call transfer of
``shared/tools/frameworks-on-h200/README.md``)::

    PYTHONPATH=/tmp/site:packages/rlk-core/src:packages/rlk-validate/src:packages/rlk-collectives/src:\
packages/rlk-vllm-plugin/src:packages/rlk-repro/src python3 benchmarks/frameworks/vllm_gpu.py --out $OUT

The driver (no ``--stage``) runs every stage as ``python3 vllm_gpu.py --stage NAME`` in a fresh subprocess
with its own environment (clean GPU state, one vLLM engine per process, the route variables of that stage
only), collects each stage's JSON and rewrites ``vllm_gpu.json`` / ``vllm_gpu.md`` after every stage.

Plugin discovery without pip: the driver writes ``<work>/plugin-site/rlk_vllm_plugin-<v>.dist-info`` (``METADATA``
+ ``entry_points.txt`` declaring ``vllm.general_plugins: rlk = rlk_vllm_plugin:register``, exactly what the
wheel installs) and puts that folder first on each stage's ``PYTHONPATH``; ``importlib.metadata`` then finds the
entry point in every process that vLLM starts (engine core and workers inherit the environment). The engine
core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as the H200 smoke test does) unless
``--multiprocessing`` is given. Each engine stage gets its own ``VLLM_CACHE_ROOT`` and
``VLLM_DISABLE_COMPILE_CACHE=1``: vLLM's compile-cache key does not include the plugin's routes, so a
graph compiled with rlk ops must never be reused by the P/P or batch-invariant engines.

Stages (in order; each guarded, its error and log tail recorded):

=============  ==============================================================================================
``ckpt``       Qwen3-0.6B-shaped random bf16 checkpoint (rlk-repro's writer, HF layout) + token-id prompts
``rr``         R/R strict, ``attention_backend=CUSTOM``, CUDA graphs: warm-up, the big ``generate``
               (prompts x samples, ``logprobs=0``, T=1, top_p 1, top_k 0, ignore_eos), a few prompts alone,
               TTFT / decode-step timing
``pp``         the plugin off (P/P, default backend): same prompts, seeds and settings (negative control, native
               throughput)
``bi``         P/P with ``VLLM_BATCH_INVARIANT=1`` (vLLM's own deterministic mode): throughput
``recompute``  rlk-repro's ``Trainer`` (consistency plan, train side, bf16, same checkpoint) recomputes every
               R/R sequence and a subset of the P/P / BI / eager ones; fp32 log-probs compared with
               ``torch.equal`` per token
``eager``      R/R with ``enforce_eager=True`` on a subset of the prompts: equal to the CUDA-graph run
=============  ==============================================================================================

CPU smoke of everything except vLLM's GPU engine: ``--tiny --device cpu`` (the engine stages then run
rlk-repro's local rollout engine, the vLLM stand-in, under the same plans; ``--engine vllm`` is refused on CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PLUGIN_VERSION = "0.1.0"
ROUTE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE")
CLEARED_VARS = (*ROUTE_VARS, "RL_KERNEL_MODE", "RL_KERNEL_READBACK_DIR", "RL_KERNEL_VLLM_UNFILTERED_LOGPROBS",
                "RL_KERNEL_VLLM_ATTENTION_OVERRIDE", "VLLM_PLUGINS", "VLLM_BATCH_INVARIANT")
VLLM_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_DEEP_GEMM": "0", "VLLM_NO_USAGE_STATS": "1",
            "HF_HUB_OFFLINE": "1", "VLLM_DISABLE_COMPILE_CACHE": "1", "TOKENIZERS_PARALLELISM": "false"}
# per engine stage: routes, extra env, engine kwargs
ENGINES = {
    "rr": {"case": "R/R", "env": {}, "backend": "CUSTOM", "eager": False},
    "pp": {"case": "P/P", "env": {}, "backend": None, "eager": False},
    "bi": {"case": "P/P", "env": {"VLLM_BATCH_INVARIANT": "1"}, "backend": None, "eager": False},
    "eager": {"case": "R/R", "env": {}, "backend": "CUSTOM", "eager": True},
}
TP_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
ORDER = ("ckpt", "rr", "pp", "eager", "recompute", "bi")
# per-stage wall-clock caps (s): a hung stage cannot eat the whole budget
STAGE_CAP_S = {"ckpt": 120, "rr": 260, "pp": 170, "eager": 120, "recompute": 170, "bi": 170}
REQUIRED = ("rr.logp_equal_trainer", "rr.alone_equal_batch", "eager.equal_cuda_graphs", "pp.differs_from_trainer",
            "rr.readback_rlk", "eager.readback_rlk")


# ------------------------------------------------------------------------------------------------
# shared helpers
# ------------------------------------------------------------------------------------------------
def _json_dump(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str))
    os.replace(tmp, path)


def _seed_of(prompt_idx: int, base: int) -> int:
    """Per-request seed (vLLM gives child ``i`` of an ``n``-sample request ``seed + i``)."""
    return base + 1000 * prompt_idx


def _model_cfg(tiny: bool):
    from rlk_repro.model.config import PRESETS
    return PRESETS["tiny"] if tiny else PRESETS["qwen3-0.6b"]


# ------------------------------------------------------------------------------------------------
# stage: checkpoint + prompts
# ------------------------------------------------------------------------------------------------
def stage_ckpt(a, work: Path) -> dict:
    import torch

    from rlk_repro.model import weights as W

    cfg = _model_cfg(a.tiny)
    t0 = time.perf_counter()
    w = W.random_weights(cfg, seed=a.seed, dtype=torch.bfloat16)
    ckpt = work / "ckpt"
    W.save_checkpoint(ckpt, cfg, w)
    # vLLM reads the dtype from config.json when dtype="auto"; we also pass dtype=bfloat16 explicitly
    conf = json.loads((ckpt / "config.json").read_text())
    conf["torch_dtype"] = "bfloat16"
    (ckpt / "config.json").write_text(json.dumps(conf, indent=2))
    g = torch.Generator().manual_seed(a.seed + 1)
    # token ids below 151643 (Qwen3's special tokens start there); lengths vary so chunks and batches mix
    top = min(cfg.vocab_size, 151643) if not a.tiny else 256
    prompts = []
    for _ in range(a.prompts + a.ttft_runs + a.decode_batch):
        n = int(torch.randint(a.prompt_min, a.prompt_max + 1, (1,), generator=g))
        prompts.append(torch.randint(0, top, (n,), generator=g).tolist())
    (work / "prompts.json").write_text(json.dumps(prompts))
    return {"config": cfg.as_dict(), "params": sum(t.numel() for t in w.values()),
            "weights_sha256": W.weights_sha256(w), "checkpoint_bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
            "prompts": a.prompts, "extra_prompts_for_timing": a.ttft_runs + a.decode_batch,
            "prompt_len": [a.prompt_min, a.prompt_max], "seconds": round(time.perf_counter() - t0, 2)}


# ------------------------------------------------------------------------------------------------
# engine stages: vLLM (GPU) or rlk-repro's local rollout engine (CPU smoke)
# ------------------------------------------------------------------------------------------------
def _flush_worker_readback(worker) -> dict:
    """Runs in each vLLM worker (``LLM.collective_rpc``): write its rlk readback now."""
    import torch.distributed as dist

    import rlk_vllm_plugin

    rlk_vllm_plugin.flush()
    return {"pid": os.getpid(), "rank": dist.get_rank() if dist.is_initialized() else None}


class _VllmEngine:
    def __init__(self, a, work: Path, spec: dict) -> None:
        from vllm import LLM

        kw = dict(model=str(work / "ckpt"), dtype="bfloat16", skip_tokenizer_init=True, seed=a.seed,
                  max_model_len=a.prompt_max + a.max_tokens + 16, enforce_eager=spec["eager"],
                  gpu_memory_utilization=a.gpu_mem, enable_chunked_prefill=True,
                  max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched_tokens,
                  disable_log_stats=True)
        if spec["backend"]:
            kw["attention_backend"] = spec["backend"]
        compilation: dict = {}
        if a.capture_max:  # every engine alike: the capture sizes are a setting, not a route
            compilation["max_cudagraph_capture_size"] = a.capture_max
        if a.tp > 1:
            kw["tensor_parallel_size"] = a.tp
            if spec["case"] != "P/P":  # the fused all-reduce + RMSNorm pass bypasses rlk (the plugin refuses it)
                compilation["pass_config"] = {"fuse_allreduce_rms": False}
        if compilation:
            kw["compilation_config"] = compilation
        self.kwargs = {k: v for k, v in kw.items() if k != "model"}
        t0 = time.perf_counter()
        self.llm = LLM(**kw)
        self.start_s = time.perf_counter() - t0

    @staticmethod
    def _sp(a, n: int, max_tokens: int, seed: int):
        from vllm import SamplingParams
        return SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, logprobs=0,
                              max_tokens=max_tokens, ignore_eos=True, seed=seed, detokenize=False)

    def generate(self, a, prompts: list[list[int]], idx: list[int], n: int, max_tokens: int) -> list[dict]:
        sps = [self._sp(a, n, max_tokens, _seed_of(i, a.seed)) for i in idx]
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        recs = []
        for i, out in zip(idx, outs, strict=True):
            for c in out.outputs:
                toks = list(c.token_ids)
                lps = [] if c.logprobs is None else [lp[t].logprob for lp, t in zip(c.logprobs, toks, strict=True)]
                recs.append({"p": i, "s": int(c.index), "tokens": toks, "logprobs": lps})
        return recs

    def reset_prefix_cache(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown()

    def info(self) -> dict:
        import vllm
        cfg = self.llm.llm_engine.vllm_config
        out = {"vllm": vllm.__version__, "engine_kwargs": self.kwargs, "engine_start_s": round(self.start_s, 1)}
        with contextlib.suppress(Exception):
            out["attention_backend_config"] = str(cfg.attention_config.backend)
        with contextlib.suppress(Exception):
            cc = cfg.compilation_config
            out["compilation"] = {"mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode),
                                  "capture_sizes": len(cc.cudagraph_capture_sizes or [])}
        with contextlib.suppress(Exception):
            out["use_v2_model_runner"] = bool(cfg.use_v2_model_runner)
        with contextlib.suppress(Exception):
            out["enable_prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
            out["chunked_prefill"] = bool(cfg.scheduler_config.enable_chunked_prefill)
        return out


class _LocalEngine:
    """CPU smoke: rlk-repro's rollout engine (vLLM stand-in) under the stage's plan."""

    def __init__(self, a, work: Path, spec: dict) -> None:
        import torch

        from rlk_core.plan import RoutePlan
        from rlk_core.readback import ReadbackRecorder
        from rlk_repro.engine.rollout import RolloutEngine
        from rlk_repro.model import weights as W
        from rlk_repro.model.ops import Ops

        cfg, w = W.load_checkpoint(work / "ckpt")
        plan = RoutePlan.from_env()
        self.rec = ReadbackRecorder("vllm", "rollout", plan)
        self.cfg = cfg
        self.engine = RolloutEngine(cfg, w, Ops(plan, "rollout", self.rec), device=torch.device(a.device),
                                    dtype=torch.bfloat16, chunk_size=16, max_num_seqs=min(a.max_num_seqs, 16),
                                    max_model_len=a.prompt_max + a.max_tokens + 16, seed=a.seed)
        self.start_s = 0.0

    def generate(self, a, prompts, idx, n, max_tokens):
        from rlk_repro.engine.rollout import Request
        from rlk_repro.engine.sampling import SamplingParams

        reqs = [Request(rid=i * 64 + s, prompt=list(p),
                        params=SamplingParams(temperature=1.0, max_new_tokens=max_tokens, seed=a.seed))
                for i, p in zip(idx, prompts, strict=True) for s in range(n)]
        self.engine.generate(reqs)
        return [{"p": r.rid // 64, "s": r.rid % 64, "tokens": list(r.output), "logprobs": list(r.logprobs)}
                for r in reqs]

    def reset_prefix_cache(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    def info(self) -> dict:
        return {"engine": "rlk-repro local rollout engine (CPU smoke stand-in for vLLM)"}

    def readback(self) -> dict:
        return self.rec.to_dict()


def _sm_clock_mhz() -> int | None:
    """The GPU's SM clock now (nvidia-smi), to tell a slow run from a slow GPU; None where it cannot be read."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits", "-i",
                              os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=10)
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def stage_engine(a, work: Path, name: str) -> dict:
    import torch

    spec = ENGINES[name]
    prompts_all = json.loads((work / "prompts.json").read_text())
    n_prompts = a.num_prompts or a.prompts
    if name == "eager":
        n_prompts = min(n_prompts, a.eager_prompts)
    engine = _LocalEngine(a, work, spec) if a.engine == "local" else _VllmEngine(a, work, spec)
    env_keys = (*CLEARED_VARS, "VLLM_ENABLE_V1_MULTIPROCESSING")
    res: dict = {"info": engine.info(), "route": spec["case"], "env": {k: os.environ.get(k) for k in env_keys}}
    # warm-up (Triton JIT of shapes the capture did not cover); also the throughput estimate for sizing
    warm_p = list(range(min(a.warm_prompts, n_prompts)))
    engine.generate(a, [prompts_all[i] for i in warm_p], warm_p, a.samples, min(8, a.max_tokens))  # JIT
    _, warm_s = _timed(lambda: engine.generate(a, [prompts_all[i] for i in warm_p], warm_p, a.samples, a.max_tokens))
    warm_tps = len(warm_p) * a.samples * a.max_tokens / max(warm_s, 1e-9)
    res["warmup"] = {"prompts": len(warm_p), "seconds": round(warm_s, 2), "output_tok_s": round(warm_tps)}
    if name == "rr" and a.engine == "vllm" and not a.num_prompts:
        # size the big run to the time budget (the warm-up rate underestimates the big batch's)
        fit = int(a.gen_budget_s * warm_tps / (a.samples * a.max_tokens))
        if fit < n_prompts:
            res["reduced"] = {"from_prompts": n_prompts, "to_prompts": max(fit, 64),
                              "why": f"warm-up rate {warm_tps:.0f} tok/s x gen budget {a.gen_budget_s}s"}
            n_prompts = max(fit, 64)
    idx = list(range(n_prompts))
    clocks = [_sm_clock_mhz()]
    recs, gen_s = _timed(lambda: engine.generate(a, [prompts_all[i] for i in idx], idx, a.samples, a.max_tokens))
    out_tokens = sum(len(r["tokens"]) for r in recs)
    times, repeats = [gen_s], []
    for _ in range(a.gen_repeats - 1 if name in ("rr", "pp", "bi") else 0):
        # the same requests again, prefix cache cleared (each run prefills every prompt): the rate is the median
        engine.reset_prefix_cache()
        clocks.append(_sm_clock_mhz())
        again, s = _timed(lambda: engine.generate(a, [prompts_all[i] for i in idx], idx, a.samples, a.max_tokens))
        times.append(s)
        repeats.append(_same_records(again, recs))
    gen_med = statistics.median(times)
    res["generate"] = {"prompts": n_prompts, "samples": a.samples, "max_tokens": a.max_tokens,
                       "sequences": len(recs), "output_tokens": out_tokens, "seconds": round(gen_med, 3),
                       "seconds_each": [round(t, 3) for t in times], "sm_clock_mhz_before_each": clocks,
                       "output_tok_s": round(out_tokens / gen_med, 1), "repeats_vs_first": repeats}
    data = {"batch": recs}
    if name in ("rr", "pp", "bi"):
        alone_idx = idx[: a.alone]
        engine.reset_prefix_cache()  # alone: the whole prompt prefilled again, not read from the batch's cache
        alone = []
        for i in alone_idx:
            alone += engine.generate(a, [prompts_all[i]], [i], a.samples, a.max_tokens)
        data["alone"] = alone
        res["alone"] = {"prompts": alone_idx}
        # TTFT: wall time of generate(max_tokens=1) for one fresh prompt (no prefix-cache hit), median
        base = a.prompts
        ttft = []
        for j in range(a.ttft_runs):
            i = base + j
            _, s = _timed(lambda i=i: engine.generate(a, [prompts_all[i]], [i], 1, 1))
            ttft.append(s)
        # decode step: a batch of fresh prompts, max_tokens 1 (prefill, caches the prompts) then 1 again
        # (cached prefill) then 1 + K: (t(1+K) - t(1)) / K is one decode step of the whole batch
        d_idx = list(range(base + a.ttft_runs, base + a.ttft_runs + a.decode_batch))
        d_p = [prompts_all[i] for i in d_idx]
        engine.generate(a, d_p, d_idx, 1, 1)
        _, t1 = _timed(lambda: engine.generate(a, d_p, d_idx, 1, 1))
        _, tk = _timed(lambda: engine.generate(a, d_p, d_idx, 1, 1 + a.decode_steps))
        res["timing"] = {"ttft_single_ms_median": round(1e3 * statistics.median(ttft), 2) if ttft else None,
                         "ttft_single_ms": [round(1e3 * s, 2) for s in ttft],
                         "decode_batch": len(d_idx), "decode_steps": a.decode_steps,
                         "decode_step_ms": round(1e3 * (tk - t1) / a.decode_steps, 3),
                         "note": "wall times of LLM.generate (front end included); decode step from "
                                 "t(max_tokens=1+K) - t(max_tokens=1) over K, prompts prefix-cached"}
    if a.profile and name in ("rr", "pp", "bi"):
        res["profile"] = _profile(a, engine, prompts_all, work, name)
    if a.engine == "vllm":
        with contextlib.suppress(Exception):
            import rlk_vllm_plugin
            from rlk_vllm_plugin import _runtime
            rt = _runtime.current()
            res["plugin_in_process"] = None if rt is None else {"plan": rt.plan.name, "hooks": len(rt.hooks)}
            rlk_vllm_plugin.flush()
        if a.tp > 1:  # TP workers are processes of their own: flush their readbacks now (also done at exit)
            try:
                res["worker_flush"] = engine.llm.collective_rpc(_flush_worker_readback, timeout=60)
            except Exception as exc:
                res["worker_flush"] = f"{type(exc).__name__}: {exc}"
    else:
        rb = Path(os.environ["RL_KERNEL_READBACK_DIR"])
        rb.mkdir(parents=True, exist_ok=True)
        _json_dump(rb / f"local-rollout-{os.getpid()}.json", engine.readback())
    torch.save(data, work / f"{name}.pt")
    engine.shutdown()
    engine = None
    gc.collect()
    return res


def _gpu_clocks() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,temperature.gpu,power.draw,"
                               "clocks_throttle_reasons.active", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # informational only
        return f"{type(exc).__name__}: {exc}"


def _profile(a, engine, prompts_all, work: Path, name: str) -> dict:
    """``--profile``: torch.profiler (CPU + CUDA) over a decode run of the timing batch and over a mixed
    run (prefill + decode, the throughput case); the tables go to ``<work>/profile-<stage>.txt`` (the driver
    copies them to ``--out``). Where the time goes, per kernel and per host op, for R/R beside P/P."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    base = a.prompts + a.ttft_runs
    d_idx = list(range(base, base + a.decode_batch))
    m_idx = list(range(min(32, a.prompts)))
    runs = {"decode": lambda: engine.generate(a, [prompts_all[i] for i in d_idx], d_idx, 1, 1 + a.decode_steps),
            "mixed": lambda: engine.generate(a, [prompts_all[i] for i in m_idx], m_idx, a.samples, a.max_tokens)}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    out: dict = {"clocks_before": _gpu_clocks()}
    lines = [f"# profile of stage {name}", f"clocks before: {out['clocks_before']}", ""]
    for what, fn in runs.items():
        engine.reset_prefix_cache()
        fn()  # same shapes once unprofiled (JIT, allocator)
        sync()
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            fn()
            sync()
            wall = time.perf_counter() - t0
        ka = prof.key_averages()
        cuda_total = sum(e.self_device_time_total for e in ka) / 1e3
        out[what] = {"wall_ms": round(1e3 * wall, 1), "self_cuda_ms_total": round(cuda_total, 1)}
        lines += [f"## {what}: wall {1e3 * wall:.1f} ms, summed self CUDA time {cuda_total:.1f} ms", ""]
        for key in ("self_cuda_time_total", "self_cpu_time_total"):
            lines += [f"### by {key}", ka.table(sort_by=key, row_limit=30, max_name_column_width=90), ""]
    out["clocks_after"] = _gpu_clocks()
    (work / f"profile-{name}.txt").write_text("\n".join(lines) + "\n")
    return out


# ------------------------------------------------------------------------------------------------
# stage: training-side recompute (rlk-repro Trainer) and the bitwise comparisons
# ------------------------------------------------------------------------------------------------
def _recompute(trainer, prompts_all, recs, max_tokens_per_chunk: int):
    """Per record: the trainer's fp32 log-probs of its sampled tokens (a list of tensors)."""
    import torch

    out, chunk, ntok = [], [], 0

    def flush():
        if not chunk:
            return
        seqs = [prompts_all[r["p"]] + r["tokens"] for r in chunk]
        rows, start = [], 0
        for r, s in zip(chunk, seqs, strict=True):
            lp = len(prompts_all[r["p"]])
            rows.append(torch.arange(start + lp - 1, start + len(s) - 1))
            start += len(s) - 1
        with torch.no_grad():
            lps = trainer.forward_logprobs(seqs, torch.cat(rows).to(trainer.device)).float().cpu()
        out.extend(lps.split([len(r["tokens"]) for r in chunk]))
        chunk.clear()

    for r in recs:
        n = len(prompts_all[r["p"]]) + len(r["tokens"])
        if chunk and ntok + n > max_tokens_per_chunk:
            flush()
            ntok = 0
        chunk.append(r)
        ntok += n
    flush()
    return out


def _compare(recs, ref) -> dict:
    """Bitwise comparison of engine log-probs (fp32) with the trainer's."""
    import torch

    tokens = mism = seq_mism = 0
    max_abs = 0.0
    examples = []
    for r, t in zip(recs, ref, strict=True):
        got = torch.tensor(r["logprobs"], dtype=torch.float32)
        if got.shape != t.shape:
            seq_mism += 1
            mism += len(r["tokens"])
            tokens += len(r["tokens"])
            examples.append({"p": r["p"], "s": r["s"], "error": f"shape {tuple(got.shape)} vs {tuple(t.shape)}"})
            continue
        bad = got != t
        tokens += got.numel()
        k = int(bad.sum())
        if k:
            mism += k
            seq_mism += 1
            d = float((got.double() - t.double()).abs().max())
            max_abs = max(max_abs, d)
            if len(examples) < 5:
                j = int(bad.nonzero()[0])
                examples.append({"p": r["p"], "s": r["s"], "pos": j, "engine": float(got[j]), "trainer": float(t[j])})
    return {"tokens": tokens, "mismatched_tokens": mism, "sequences": len(recs), "mismatched_sequences": seq_mism,
            "max_abs_diff": max_abs, "examples": examples}


def stage_recompute(a, work: Path) -> dict:
    import torch

    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model import weights as W
    from rlk_repro.model.ops import Ops

    dev = torch.device(a.device)
    cfg, w = W.load_checkpoint(work / "ckpt")
    plan = RoutePlan.preset("consistency")
    rec = ReadbackRecorder("megatron", "train", plan)  # the local trainer is the Megatron stand-in
    trainer = Trainer(cfg, w, Ops(plan, "train", rec), device=dev, dtype=torch.bfloat16, temperature=1.0)
    del w
    prompts_all = json.loads((work / "prompts.json").read_text())
    res: dict = {"plan": plan.name, "device": str(dev)}
    for name, limit in (("rr", None), ("pp", a.control_seqs), ("bi", a.control_seqs), ("eager", None)):
        f = work / f"{name}.pt"
        if not f.exists():
            res[name] = {"skipped": f"{f.name} missing (stage did not finish)"}
            continue
        recs = torch.load(f)["batch"]
        recs = recs if limit is None else recs[:limit]
        t0 = time.perf_counter()
        ref = _recompute(trainer, prompts_all, recs, a.recompute_chunk)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        res[name] = {**_compare(recs, ref), "recompute_s": round(time.perf_counter() - t0, 2)}
    res["readback"] = rec.to_dict().get("modules")
    rb = Path(os.environ["RL_KERNEL_READBACK_DIR"])
    rb.mkdir(parents=True, exist_ok=True)
    _json_dump(rb / f"trainer-{os.getpid()}.json", rec.to_dict())
    return res


# ------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------
def _write_plugin_site(site: Path) -> None:
    """What ``pip install rlk-vllm-plugin`` contributes to discovery: a dist-info with the entry point."""
    di = site / f"rlk_vllm_plugin-{PLUGIN_VERSION}.dist-info"
    di.mkdir(parents=True, exist_ok=True)
    (di / "METADATA").write_text(f"Metadata-Version: 2.1\nName: rlk-vllm-plugin\nVersion: {PLUGIN_VERSION}\n")
    (di / "entry_points.txt").write_text("[vllm.general_plugins]\nrlk = rlk_vllm_plugin:register\n")
    (di / "top_level.txt").write_text("rlk_vllm_plugin\n")


def _stage_env(a, work: Path, name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED_VARS}
    paths = [str(work / "plugin-site")] + [str(Path(p).resolve()) for p in
                                           os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update(VLLM_ENV)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.multiprocessing else "0"
    env["VLLM_CACHE_ROOT"] = str(work / f"vllm-cache-{name}")
    env["RL_KERNEL_READBACK_DIR"] = str(work / "readbacks" / name)
    env["RL_KERNEL_MODE"] = "strict"
    if a.tp > 1:  # x2 machines: NVLink multicast off (NCCL NVLS, symmetric memory, NVSHMEM)
        env.update(TP_ENV)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of _flush_worker_readback
    spec = ENGINES.get(name)
    if spec is not None:
        for k in ROUTE_VARS:
            env[k] = spec["case"]
        env.update(spec["env"])
    if a.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _meta(a) -> dict:
    import torch
    meta: dict = {"python": platform.python_version(), "torch": torch.__version__,
                  "cuda": torch.version.cuda, "device": a.device, "engine": a.engine,
                  "RLK_COMMIT": os.environ.get("RLK_COMMIT"), "argv": sys.argv, "tp": a.tp}
    if not meta["RLK_COMMIT"]:
        with contextlib.suppress(Exception):
            meta["RLK_COMMIT"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                                text=True, timeout=10).stdout.strip() or None
    for mod in ("triton", "vllm", "transformers"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version
            meta[mod] = version(mod)
    with contextlib.suppress(Exception):
        meta["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=20).stdout.strip() or None
    return meta


def _check(checks: list, name: str, passed, required: bool, **numbers) -> None:
    checks.append({"name": name, "passed": passed, "required": required, **numbers})


def _same_records(x: list[dict], y: list[dict]) -> dict:
    """Tokens and log-probs of the same (prompt, sample) in two runs: equal bit for bit?"""
    import torch
    ym = {(r["p"], r["s"]): r for r in y}
    seqs = tok_diff = lp_diff = tokens = 0
    for r in x:
        o = ym.get((r["p"], r["s"]))
        if o is None:
            continue
        seqs += 1
        tokens += len(r["tokens"])
        if r["tokens"] != o["tokens"]:
            tok_diff += 1
            continue
        if not torch.equal(torch.tensor(r["logprobs"], dtype=torch.float32),
                           torch.tensor(o["logprobs"], dtype=torch.float32)):
            lp_diff += 1
    return {"sequences": seqs, "tokens": tokens, "token_ids_differ": tok_diff, "logprobs_differ": lp_diff}


def _readback_summary(rb_dir: Path) -> dict:
    """Modules over every readback of a stage (the recorder files them under ``<dir>/<hostname>/``) and, per
    process, its rank and the backends of its TP all-reduces."""
    files = sorted(rb_dir.rglob("*.json")) if rb_dir.is_dir() else []
    mods: dict = {}
    hooks: set = set()
    procs: list = []
    for f in files:
        with contextlib.suppress(Exception):
            d = json.loads(f.read_text())
            hooks.update(h.get("name") for h in d.get("hooks") or [])
            procs.append({"file": f.name, "rank": d.get("rank"), "world_size": d.get("world_size"),
                          "all_reduce": {m: {"backend_id": v["ops"]["all_reduce"]["backend_id"],
                                             "call_count": v["ops"]["all_reduce"]["call_count"]}
                                         for m, v in (d.get("modules") or {}).items()
                                         if "all_reduce" in (v.get("ops") or {})}})
            for m, v in (d.get("modules") or {}).items():
                cur = mods.setdefault(m, {"backend_ids": set(), "call_count": 0, "fallback": False})
                cur["backend_ids"].update(op["backend_id"] for op in v.get("ops", {}).values())
                cur["call_count"] += int(v.get("call_count", 0))
                cur["fallback"] |= bool(v.get("fallback"))
    return {"files": [f.name for f in files], "processes": procs, "hooks": sorted(h for h in hooks if h),
            "modules": {m: {**v, "backend_ids": sorted(v["backend_ids"])} for m, v in mods.items()}}


def _evaluate(result: dict, work: Path) -> list:
    import torch
    checks: list = []
    st = result["stages"]
    rc = st.get("recompute", {}).get("result") or {}
    rr = rc.get("rr") or {}
    tp_meta = int(result.get("meta", {}).get("tp", 1) or 1)
    if "tokens" in rr:  # the trainer recomputes at TP 1: under TP > 1 the row-parallel sums differ by contract
        _check(checks, "rr.logp_equal_trainer", rr["mismatched_tokens"] == 0 and rr["tokens"] > 0, tp_meta == 1,
               tokens=rr["tokens"], mismatched_tokens=rr["mismatched_tokens"],
               mismatched_sequences=rr["mismatched_sequences"], max_abs_diff=rr["max_abs_diff"],
               target_100k_tokens=rr["tokens"] >= 100_000)
    pp = rc.get("pp") or {}
    if "tokens" in pp:
        _check(checks, "pp.differs_from_trainer", pp["mismatched_tokens"] > 0, True, tokens=pp["tokens"],
               mismatched_tokens=pp["mismatched_tokens"], max_abs_diff=pp["max_abs_diff"])
    bi = rc.get("bi") or {}
    if "tokens" in bi:
        _check(checks, "bi.vs_trainer", None, False, tokens=bi["tokens"], mismatched_tokens=bi["mismatched_tokens"],
               max_abs_diff=bi["max_abs_diff"], note="vLLM's batch-invariant mode against rlk's trainer (info)")
    eg = rc.get("eager") or {}
    if "tokens" in eg:
        _check(checks, "eager.logp_equal_trainer", eg["mismatched_tokens"] == 0 and eg["tokens"] > 0, False,
               tokens=eg["tokens"], mismatched_tokens=eg["mismatched_tokens"])
    data = {}
    for name in ENGINES:
        f = work / f"{name}.pt"
        if f.exists():
            with contextlib.suppress(Exception):
                data[name] = torch.load(f)
    if "rr" in data and data["rr"].get("alone"):
        s = _same_records(data["rr"]["alone"], data["rr"]["batch"])
        _check(checks, "rr.alone_equal_batch", s["sequences"] > 0 and s["token_ids_differ"] == 0
               and s["logprobs_differ"] == 0, True, **s)
    for name in ("pp", "bi"):
        if name in data and data[name].get("alone"):
            s = _same_records(data[name]["alone"], data[name]["batch"])
            _check(checks, f"{name}.alone_equal_batch", None, False, **s,
                   note="vLLM's own kernels, alone vs in the batch (info)")
    rep = ((st.get("rr", {}).get("result") or {}).get("generate") or {}).get("repeats_vs_first") or []
    if rep:
        _check(checks, "rr.repeats_equal_first", all(r["sequences"] > 0 and r["token_ids_differ"] == 0
                                                     and r["logprobs_differ"] == 0 for r in rep), False,
               repeats=rep, note="the timed generate run again on a cleared prefix cache: run-to-run bits")
    if "rr" in data and "eager" in data:
        s = _same_records(data["eager"]["batch"], data["rr"]["batch"])
        _check(checks, "eager.equal_cuda_graphs", s["sequences"] > 0 and s["token_ids_differ"] == 0
               and s["logprobs_differ"] == 0, True, **s)
    if "rr" in data and "pp" in data:
        s = _same_records(data["pp"]["batch"], data["rr"]["batch"])
        _check(checks, "pp.vs_rr_same_seeds", None, False, **s, note="P/P vs R/R, same seeds (info)")
    # readbacks. Under CUDA graphs the compiled pieces (the FFN, the attention block's GEMMs) run as opaque
    # torch.ops.rlk.* without the plugin's module scope, so only eager-side calls are counted there: the
    # graph run must show no production backend and no fallback for any module it counts, and the eager
    # run must count rlk calls for all three modules.
    rb = result.get("readbacks", {})
    for name, need_all in (("rr", False), ("eager", True)):
        if rb.get(name) is None:
            continue
        mods = rb[name]["modules"]
        counted = {m for m, v in mods.items() if v["call_count"] > 0}
        clean = not any(v["fallback"] for v in mods.values()) and not any(
            b.startswith("production") for v in mods.values() for b in v["backend_ids"])
        ok = clean and bool(counted) and (counted == {"attention", "ffn", "logp"} or not need_all)
        _check(checks, f"{name}.readback_rlk", ok, True, counted_modules=sorted(counted), modules=mods,
               files=rb[name]["files"], hooks=rb[name].get("hooks"))
    tp = int(result.get("meta", {}).get("tp", 1) or 1)
    if tp > 1:  # every TP worker's readback shows the rlk all-reduce (custom all-reduce / fused pass not taken)
        for name in ("rr", "eager"):
            if rb.get(name) is None:
                continue
            procs = [p for p in rb[name].get("processes", []) if p.get("world_size") == tp]
            ranks = {p["rank"] for p in procs if p["all_reduce"] and all(
                v["backend_id"].startswith("rlk.") and v["call_count"] > 0 for v in p["all_reduce"].values())}
            _check(checks, f"{name}.tp{tp}_rlk_all_reduce_every_worker", ranks == set(range(tp)), True,
                   ranks_with_rlk_all_reduce=sorted(ranks), processes=procs)
    if rb.get("pp") is not None:
        mods = rb["pp"]["modules"]
        rlk_ran = [m for m, v in mods.items() if any(not b.startswith("production") for b in v["backend_ids"])]
        _check(checks, "pp.readback_nothing_rlk", not rlk_ran, False, modules=mods, files=rb["pp"]["files"])
    # throughput
    tps = {n: st[n]["result"]["generate"]["output_tok_s"] for n in ("rr", "pp", "bi")
           if (st.get(n, {}).get("result") or {}).get("generate")}
    if "rr" in tps and "pp" in tps:
        _check(checks, "perf.rr_vs_native", tps["rr"] / tps["pp"] >= 0.8, False,
               ratio=round(tps["rr"] / tps["pp"], 3), target=">= 0.8", tok_s=tps)
    if "rr" in tps and "bi" in tps:
        _check(checks, "perf.rr_vs_batch_invariant", tps["rr"] > tps["bi"], False,
               ratio=round(tps["rr"] / tps["bi"], 3), target="> 1", tok_s=tps)
    names = {c["name"] for c in checks}
    for req in REQUIRED:
        if req not in names and not (tp_meta > 1 and req == "rr.logp_equal_trainer"):
            _check(checks, req, False, True, error="not evaluated (its stage failed, was skipped or ran out of time)")
    return checks


def _markdown(result: dict) -> str:
    m = result["meta"]
    lines = ["# rlk-vllm-plugin in real vLLM: bitwise rollout vs training recompute", "",
             f"GPU: {m.get('gpu')} · torch {m.get('torch')} · vLLM {m.get('vllm')} · Triton {m.get('triton')} · "
             f"RLK_COMMIT {m.get('RLK_COMMIT')} · engine {m.get('engine')} · "
             f"{'PASS' if result.get('passed') else 'FAIL'}",
             "", "| check | required | result | numbers |", "| --- | --- | --- | --- |"]
    for c in result.get("checks", []):
        res = {True: "PASS", False: "FAIL", None: "info"}[c["passed"]]
        nums = {k: v for k, v in c.items()
                if k not in ("name", "passed", "required", "modules", "files", "examples", "hooks")}
        lines.append(f"| {c['name']} | {'yes' if c['required'] else 'no'} | {res} | `{json.dumps(nums)[:400]}` |")
    lines += ["", "| stage | status | seconds | output tok/s (median) | timed generates s (SM MHz before) | "
              "TTFT ms (single) | decode step ms |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in result["stages"].items():
        r = s.get("result") or {}
        g, t = r.get("generate") or {}, r.get("timing") or {}
        each = ", ".join(f"{x} ({c})" for x, c in zip(g.get("seconds_each", []), g.get("sm_clock_mhz_before_each", [])))
        lines.append(f"| {name} | {s.get('status')} | {s.get('seconds')} | {g.get('output_tok_s', '')} | {each} | "
                     f"{t.get('ttft_single_ms_median', '')} | {t.get('decode_step_ms', '')} |")
    errs = [(n, s["error"]) for n, s in result["stages"].items() if s.get("error")]
    if errs:
        lines += ["", "## Errors", ""] + [f"- `{n}`: {e[:500]}" for n, e in errs]
    return "\n".join(lines) + "\n"


def _tar(out: Path, name: str, src: Path) -> None:
    if src.is_dir() and any(src.rglob("*")):
        with tarfile.open(out / name, "w:gz") as tf:
            tf.add(src, arcname=src.name)


def driver(a) -> int:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="rlk-vllm-gpu-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    (work / "logs").mkdir(exist_ok=True)
    _write_plugin_site(work / "plugin-site")
    t_start = time.perf_counter()
    result: dict = {"meta": _meta(a), "settings": {k: v for k, v in vars(a).items() if k not in ("stage",)},
                    "plugin_discovery": {"dist_info": str(work / "plugin-site"),
                                         "entry_point": "vllm.general_plugins: rlk = rlk_vllm_plugin:register",
                                         "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if a.multiprocessing else "0"},
                    "work": str(work), "stages": {}, "checks": [], "passed": False}
    jpath, mpath = out / "vllm_gpu.json", out / "vllm_gpu.md"

    def save():
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        _json_dump(jpath, result)
        mpath.write_text(_markdown(result))

    skip = set(a.skip.split(",")) if a.skip else set()
    num_prompts = 0
    for name in ORDER:
        left = a.budget_s - (time.perf_counter() - t_start)
        entry: dict = {"status": "skipped"}
        result["stages"][name] = entry
        if name in skip:
            entry["why"] = "--skip"
            save()
            continue
        if left < a.min_stage_s:
            entry["why"] = f"time budget: {left:.0f}s left of {a.budget_s}s"
            save()
            continue
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--work", str(work),
               *_pass_args(a)]
        if num_prompts:
            cmd += ["--num-prompts", str(num_prompts)]
        log = work / "logs" / f"{name}.log"
        t0 = time.perf_counter()
        try:
            with open(log, "w") as fh:
                # own session: on timeout the stage and every process it started (vLLM engine core,
                # workers) are killed by the group id of the process started here
                proc = subprocess.Popen(cmd, env=_stage_env(a, work, name), stdout=fh, stderr=subprocess.STDOUT,
                                        cwd=ROOT, start_new_session=True)
                try:
                    cap = STAGE_CAP_S[name] * (1.5 if a.tp > 1 and name in ENGINES else 1)  # 2 workers to start
                    proc.wait(timeout=max(min(left - a.reserve_s, cap), 30))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise
            entry["rc"] = proc.returncode
            rj = work / f"{name}.json"
            stage_res = json.loads(rj.read_text()) if rj.exists() else {}
            entry["result"] = stage_res.get("result")
            if stage_res.get("error"):
                entry["error"] = stage_res["error"]
                entry["traceback"] = stage_res.get("traceback")
            elif proc.returncode != 0:
                entry["error"] = f"exit code {proc.returncode}"
            entry["status"] = "ok" if proc.returncode == 0 and not entry.get("error") else "failed"
        except subprocess.TimeoutExpired:
            entry.update(status="failed", error="timeout (budget)")
        except Exception as exc:  # recorded, the run goes on
            entry.update(status="failed", error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        if entry["status"] != "ok":
            with contextlib.suppress(Exception):
                entry["log_tail"] = log.read_text(errors="replace")[-4000:]
        if name == "rr" and entry.get("result"):
            num_prompts = entry["result"]["generate"]["prompts"]
            with contextlib.suppress(Exception):
                result["meta"]["vllm"] = entry["result"]["info"].get("vllm", result["meta"].get("vllm"))
        if name in ENGINES or name == "recompute":
            with contextlib.suppress(Exception):
                result.setdefault("readbacks", {})[name] = _readback_summary(work / "readbacks" / name)
        with contextlib.suppress(Exception):
            result["checks"] = _evaluate(result, work)
        save()
    try:
        result["checks"] = _evaluate(result, work)
    except Exception as exc:
        result["evaluate_error"] = f"{type(exc).__name__}: {exc}"
        result["checks"] = [{"name": "evaluate", "passed": False, "required": True, "error": str(exc)}]
    result["passed"] = all(c["passed"] for c in result["checks"] if c["required"])
    save()
    with contextlib.suppress(Exception):
        _tar(out, "readbacks.tar.gz", work / "readbacks")
    with contextlib.suppress(Exception):
        _tar(out, "logs.tar.gz", work / "logs")
    for prof in work.glob("profile-*.txt"):
        shutil.copy(prof, out / prof.name)
    if not a.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"passed": result["passed"], "elapsed_s": result["elapsed_s"],
                      "checks": {c["name"]: c["passed"] for c in result["checks"]}}, indent=1))
    return 0 if result["passed"] else 1


_PASSED = ("tiny", "device", "engine", "seed", "prompts", "samples", "max_tokens", "prompt_min", "prompt_max",
           "alone", "eager_prompts", "warm_prompts", "control_seqs", "recompute_chunk", "gpu_mem", "max_num_seqs",
           "max_batched_tokens", "ttft_runs", "decode_batch", "decode_steps", "gen_budget_s", "gen_repeats",
           "multiprocessing", "tp", "profile", "capture_max")


def _pass_args(a) -> list[str]:
    out = []
    for k in _PASSED:
        v = getattr(a, k)
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out += [flag] if v else []
        else:
            out += [flag, str(v)]
    return out


def run_stage(a) -> int:
    work = Path(a.work)
    res: dict = {"stage": a.stage, "pid": os.getpid()}
    try:
        if a.stage == "ckpt":
            res["result"] = stage_ckpt(a, work)
        elif a.stage in ENGINES:
            res["result"] = stage_engine(a, work, a.stage)
        elif a.stage == "recompute":
            res["result"] = stage_recompute(a, work)
        else:
            raise SystemExit(f"unknown stage {a.stage}")
        rc = 0
    except BaseException as exc:  # the driver records it
        res["error"] = f"{type(exc).__name__}: {exc}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], file=sys.stderr, flush=True)
        rc = 1
    _json_dump(work / f"{a.stage}.json", res)
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM engines in-process sometimes hang at interpreter exit; the JSON is written, leave hard
    # (readbacks were flushed explicitly by the stage)
    os._exit(rc)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (vllm_gpu.json, vllm_gpu.md, readbacks.tar.gz, logs.tar.gz)")
    p.add_argument("--stage", choices=ORDER, help=argparse.SUPPRESS)
    p.add_argument("--work", help="scratch folder (default: a new temp dir; removed unless --keep-work)")
    p.add_argument("--keep-work", action="store_true")
    p.add_argument("--tiny", action="store_true", help="rlk-repro's 'tiny' preset instead of the Qwen3-0.6B shape")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--engine", choices=("vllm", "local"), help="default: vllm on cuda, local on cpu")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-min", type=int, default=16)
    p.add_argument("--prompt-max", type=int, default=96)
    p.add_argument("--alone", type=int, default=4, help="prompts also generated alone (batch of 1)")
    p.add_argument("--eager-prompts", type=int, default=32, help="prompts of the enforce_eager run")
    p.add_argument("--warm-prompts", type=int, default=16)
    p.add_argument("--control-seqs", type=int, default=512, help="P/P and BI sequences recomputed by the trainer")
    p.add_argument("--recompute-chunk", type=int, default=16384, help="tokens per trainer forward")
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-batched-tokens", type=int, default=4096)
    p.add_argument("--ttft-runs", type=int, default=5)
    p.add_argument("--decode-batch", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--gen-budget-s", type=float, default=60.0, help="the R/R big generate is sized to this")
    p.add_argument("--gen-repeats", type=int, default=3,
                   help="timed runs of the big generate in the rr / pp / bi stages (tok/s: their median)")
    p.add_argument("--budget-s", type=float, default=400.0, help="whole run; later stages are skipped past it")
    p.add_argument("--min-stage-s", type=float, default=45.0)
    p.add_argument("--reserve-s", type=float, default=5.0)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine (2 on nvidia-h200-x2; "
                   "the trainer recompute stays TP 1, so rr.logp_equal_trainer becomes informational)")
    p.add_argument("--multiprocessing", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=1 (engine core "
                   "in its own process; the plugin must load there through the dist-info on PYTHONPATH)")
    p.add_argument("--skip", default="", help="comma-separated stages to skip")
    p.add_argument("--capture-max", type=int, default=0, help="vLLM's max_cudagraph_capture_size for every engine "
                   "(default: vLLM's, min(2 x max_num_seqs, 512)); up to --max-batched-tokens, prefill chunks replay "
                   "piecewise graphs instead of running every op through Python")
    p.add_argument("--profile", action="store_true", help="torch.profiler tables of a decode and a mixed run per "
                   "engine stage (rr, pp, bi) -> profile-<stage>.txt in --out")
    a = p.parse_args(argv)
    if a.engine is None:
        a.engine = "vllm" if a.device == "cuda" else "local"
    if a.engine == "vllm" and a.device == "cpu":
        p.error("--engine vllm needs --device cuda (vLLM's paged attention and MRv2 sampler do not run on CPU)")
    if a.tp > 1 and a.engine != "vllm":
        p.error("--tp > 1 needs --engine vllm (the local stand-in engine has no tensor parallelism)")
    if a.tiny and a.stage is None:
        a.prompt_max = min(a.prompt_max, 24)
        a.prompt_min = min(a.prompt_min, 4)
    if a.stage is None and not a.out:
        p.error("--out is required")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    if a.stage:
        return run_stage(a)
    return driver(a)


if __name__ == "__main__":
    sys.exit(main())
