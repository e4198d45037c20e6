"""Real vLLM with rlk-vllm-plugin, one engine per process: what the bitwise worker
(``tests/frameworks/vllm_worker.py``) and the throughput benchmark (``benchmarks/frameworks/vllm_gpu.py``) share.

A driver runs each stage as ``python3 <script> --stage NAME`` in a fresh subprocess with its own environment (clean
GPU state, one vLLM engine per process, the route variables of that stage only, killed by process group at its
time cap) and collects each stage's JSON.

Plugin discovery without pip: the driver writes ``<work>/plugin-site/rlk_vllm_plugin-<v>.dist-info`` (``METADATA``
+ ``entry_points.txt`` declaring ``vllm.general_plugins: rlk = rlk_vllm_plugin:register``, exactly what the
wheel installs) and puts that folder first on each stage's ``PYTHONPATH``; ``importlib.metadata`` then finds the
entry point in every process that vLLM starts (engine core and workers inherit the environment). The engine
core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) unless ``--multiprocessing`` is given. Each engine stage
gets its own ``VLLM_CACHE_ROOT`` and ``VLLM_DISABLE_COMPILE_CACHE=1``: vLLM's compile-cache key does not include the
plugin's routes, so a graph compiled with rlk ops must never be reused by the P/P or batch-invariant engines.

Model: rlk-repro's ``qwen3-0.6b`` preset (``tiny`` with ``--tiny``), random bf16 weights in a Hugging Face folder;
token-id prompts, ``skip_tokenizer_init=True``. ``--device cpu`` runs rlk-repro's local rollout engine under the same
plans instead of vLLM (the stand-in: vLLM's paged attention and sampler do not run on the CPU), so the drivers,
stages and comparisons are exercised without a GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_VERSION = "0.1.0"
ROUTE_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE")
CLEARED_VARS = (*ROUTE_VARS, "RL_KERNEL_MODE", "RL_KERNEL_READBACK_DIR", "RL_KERNEL_VLLM_UNFILTERED_LOGPROBS",
                "RL_KERNEL_VLLM_ATTENTION_OVERRIDE", "VLLM_PLUGINS", "VLLM_BATCH_INVARIANT", "RL_KERNEL_TP_INVARIANT")
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


def _json_dump(path: Path, data) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False, default=str))
    os.replace(tmp, path)


def _seed_of(prompt_idx: int, base: int) -> int:
    """Per-request seed (vLLM gives child ``i`` of an ``n``-sample request ``seed + i``)."""
    return base + 1000 * prompt_idx


def _model_cfg(tiny: bool, model: str = ""):
    """rlk-repro's ``qwen3-0.6b`` preset (``tiny`` with ``--tiny``), or a script's ``--model``: a preset's name or
    ``qwen3-8b-L<n>`` — Qwen3-8B's layer shape (hidden 4096, ffn 12288, 32 / 8 heads of 128) with ``n`` layers and
    the embedding tied (half the random checkpoint; the LM head's GEMM runs either way)."""
    from rlk_repro.model.config import PRESETS, Qwen3Config
    if model.startswith(QWEN3_8B_LAYERS):
        return Qwen3Config(num_hidden_layers=int(model[len(QWEN3_8B_LAYERS):]), **QWEN3_8B_SHAPE)
    if model:
        return PRESETS[model]
    return PRESETS["tiny"] if tiny else PRESETS["qwen3-0.6b"]


QWEN3_8B_LAYERS = "qwen3-8b-L"
QWEN3_8B_SHAPE = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, bos_token_id=None,
                      eos_token_id=151645)


# ------------------------------------------------------------------------------------------------
# stage: checkpoint + prompts
# ------------------------------------------------------------------------------------------------
def stage_ckpt(a, work: Path) -> dict:
    import torch

    from rlk_repro.model import weights as W

    cfg = _model_cfg(a.tiny, getattr(a, "model", "") or "")
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
def _flush_worker_readback(worker) -> dict:
    """Runs in each vLLM worker (``LLM.collective_rpc``): write its rlk readback now."""
    import torch.distributed as dist

    import rlk_vllm_plugin

    rlk_vllm_plugin.flush()
    return {"pid": os.getpid(), "rank": dist.get_rank() if dist.is_initialized() else None}


class _VllmEngine:
    def __init__(self, a, work: Path, spec: dict) -> None:
        from vllm import LLM

        kw = dict(model=str(work / spec.get("ckpt", "ckpt")), dtype="bfloat16", skip_tokenizer_init=True, seed=a.seed,
                  max_model_len=a.prompt_max + a.max_tokens + 16, enforce_eager=spec["eager"],
                  gpu_memory_utilization=a.gpu_mem, enable_chunked_prefill=True,
                  max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_batched_tokens,
                  disable_log_stats=True)
        if a.top_k or a.top_p < 1.0 or a.min_p or a.temperature != 1.0:
            kw["logprobs_mode"] = "processed_logprobs"  # after temperature / filters, as VIME runs filtered sampling
        if spec["backend"]:
            kw["attention_backend"] = spec["backend"]
        compilation: dict = {}
        if a.capture_max:  # every engine alike: the capture sizes are a setting, not a route
            compilation["max_cudagraph_capture_size"] = a.capture_max
        if a.tp > 1:
            kw["tensor_parallel_size"] = a.tp
            if spec["case"] != "P/P":  # these passes bypass rlk's all-reduce / norm (the plugin refuses them)
                compilation["pass_config"] = {"fuse_allreduce_rms": False, "enable_sp": False, "fuse_gemm_comms": False}
        if compilation:
            kw["compilation_config"] = compilation
        kw.update(spec.get("kwargs", {}))  # a stage's own engine arguments (pd_worker.py: kv_transfer_config)
        self.kwargs = {k: v for k, v in kw.items() if k != "model"}
        t0 = time.perf_counter()
        self.llm = LLM(**kw)
        self.start_s = time.perf_counter() - t0

    @staticmethod
    def _sp(a, n: int, max_tokens: int, seed: int):
        from vllm import SamplingParams
        return SamplingParams(n=n, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, logprobs=0,
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
                        params=SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                                              min_p=a.min_p, max_new_tokens=max_tokens, seed=a.seed))
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


def _tar(out: Path, name: str, src: Path) -> None:
    if src.is_dir() and any(src.rglob("*")):
        with tarfile.open(out / name, "w:gz") as tf:
            tf.add(src, arcname=src.name)




# ------------------------------------------------------------------------------------------------
# the driver: one subprocess per stage
# ------------------------------------------------------------------------------------------------
def drive(a, script: Path, name: str, order: tuple[str, ...], caps: dict[str, float], evaluate, markdown) -> dict:
    """Run ``order``'s stages of ``script`` (each ``script --stage NAME``) and return the result; ``evaluate(result,
    work)`` adds what the stages' outputs say, ``markdown(result)`` the table, both rewritten into ``--out`` as
    ``<name>.json`` / ``<name>.md`` after every stage. ``rr``'s prompt count (``--num-prompts``) carries on to the
    stages after it."""
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or tempfile.mkdtemp(prefix=f"rlk-{name}-")).resolve()
    (work / "logs").mkdir(parents=True, exist_ok=True)
    _write_plugin_site(work / "plugin-site")
    t_start = time.perf_counter()
    result: dict = {"meta": _meta(a), "settings": {k: v for k, v in vars(a).items() if k != "stage"},
                    "plugin_discovery": {"dist_info": str(work / "plugin-site"),
                                         "entry_point": "vllm.general_plugins: rlk = rlk_vllm_plugin:register",
                                         "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if a.multiprocessing else "0"},
                    "work": str(work), "stages": {}}

    def save():
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        _json_dump(out / f"{name}.json", result)
        (out / f"{name}.md").write_text(markdown(result))

    skip = set(a.skip.split(",")) if a.skip else set()
    num_prompts = 0
    for stage in order:
        left = a.budget_s - (time.perf_counter() - t_start)
        entry: dict = {"status": "skipped"}
        result["stages"][stage] = entry
        if stage in skip or left < a.min_stage_s:
            entry["why"] = "--skip" if stage in skip else f"time budget: {left:.0f}s left of {a.budget_s}s"
            save()
            continue
        cmd = [sys.executable, str(script), "--stage", stage, "--work", str(work), *pass_args(a)]
        if num_prompts:
            cmd += ["--num-prompts", str(num_prompts)]
        log = work / "logs" / f"{stage}.log"
        t0 = time.perf_counter()
        try:
            with open(log, "w") as fh:
                # own session: on timeout the stage and every process it started (vLLM engine core,
                # workers) are killed by the group id of the process started here
                proc = subprocess.Popen(cmd, env=_stage_env(a, work, stage), stdout=fh, stderr=subprocess.STDOUT,
                                        cwd=ROOT, start_new_session=True)
                try:
                    cap = caps[stage] * (1.5 if a.tp > 1 and stage in ENGINES else 1)  # 2 workers to start
                    proc.wait(timeout=max(min(left - a.reserve_s, cap), 30))
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    raise
            entry["rc"] = proc.returncode
            rj = work / f"{stage}.json"
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
        if stage == "rr" and entry.get("result"):
            num_prompts = entry["result"]["generate"]["prompts"]
            with contextlib.suppress(Exception):
                result["meta"]["vllm"] = entry["result"]["info"].get("vllm", result["meta"].get("vllm"))
        if stage in ENGINES or stage == "recompute":
            with contextlib.suppress(Exception):
                result.setdefault("readbacks", {})[stage] = _readback_summary(work / "readbacks" / stage)
        with contextlib.suppress(Exception):
            evaluate(result, work)
        save()
    try:
        evaluate(result, work)
    except Exception as exc:  # recorded: the caller's verdict must see it
        result["evaluate_error"] = f"{type(exc).__name__}: {exc}"
        result["evaluate_traceback"] = traceback.format_exc()
    save()
    with contextlib.suppress(Exception):
        _tar(out, "readbacks.tar.gz", work / "readbacks")
    with contextlib.suppress(Exception):
        _tar(out, "logs.tar.gz", work / "logs")
    result["work_dir"] = work
    return result


def finish_work(result: dict, keep: bool) -> None:
    """Remove the driver's scratch folder (the checkpoint, the stages' tensors) unless ``keep``."""
    import shutil

    if not keep:
        shutil.rmtree(result.pop("work_dir"), ignore_errors=True)


def run_stage(a, stages: dict) -> int:
    """``--stage NAME``: ``stages[NAME](a, work)``, its result or error in ``<work>/<NAME>.json``; leaves hard."""
    work = Path(a.work)
    res: dict = {"stage": a.stage, "pid": os.getpid()}
    try:
        res["result"] = stages[a.stage](a, work)
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


def engine_readbacks(a, engine) -> dict:
    """Flush the plugin's readbacks of this process (and of every TP worker); the local engine's go to
    ``RL_KERNEL_READBACK_DIR`` as the plugin's would."""
    res: dict = {}
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
    return res


def open_engine(a, work: Path, name: str):
    return _LocalEngine(a, work, ENGINES[name]) if a.engine == "local" else _VllmEngine(a, work, ENGINES[name])


def engine_info(engine, name: str) -> dict:
    env_keys = (*CLEARED_VARS, "VLLM_ENABLE_V1_MULTIPROCESSING")
    return {"info": engine.info(), "route": ENGINES[name]["case"], "env": {k: os.environ.get(k) for k in env_keys}}


def close_engine(engine) -> None:
    engine.shutdown()
    gc.collect()


def prompts_of(work: Path) -> list[list[int]]:
    return json.loads((work / "prompts.json").read_text())


# ------------------------------------------------------------------------------------------------
# the options both scripts take (passed on to every stage)
# ------------------------------------------------------------------------------------------------
COMMON = ("tiny", "device", "engine", "seed", "prompts", "samples", "max_tokens", "prompt_min", "prompt_max",
          "gpu_mem", "max_num_seqs", "max_batched_tokens", "multiprocessing", "tp", "capture_max", "ttft_runs",
          "decode_batch", "temperature", "top_k", "top_p", "min_p")


def parser(description: str, stages: tuple[str, ...]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", help="output folder")
    p.add_argument("--stage", choices=stages, help=argparse.SUPPRESS)
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
    p.add_argument("--gpu-mem", type=float, default=0.85)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-batched-tokens", type=int, default=4096)
    p.add_argument("--ttft-runs", type=int, default=5, help="extra prompts kept for the single-prompt timing")
    p.add_argument("--decode-batch", type=int, default=256, help="extra prompts kept for the decode-step timing")
    p.add_argument("--budget-s", type=float, default=400.0, help="whole run; later stages are skipped past it")
    p.add_argument("--min-stage-s", type=float, default=45.0)
    p.add_argument("--reserve-s", type=float, default=5.0)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size of every engine (2 on nvidia-h200-x2)")
    p.add_argument("--multiprocessing", action="store_true", help="VLLM_ENABLE_V1_MULTIPROCESSING=1 (engine core "
                   "in its own process; the plugin must load there through the dist-info on PYTHONPATH)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="every request's top-k (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, help="every request's top-p (1: off)")
    p.add_argument("--min-p", type=float, default=0.0, help="every request's min-p (0: off)")
    p.add_argument("--skip", default="", help="comma-separated stages to skip")
    p.add_argument("--capture-max", type=int, default=0, help="vLLM's max_cudagraph_capture_size for every engine "
                   "(default: vLLM's, min(2 x max_num_seqs, 512)); up to --max-batched-tokens, prefill chunks replay "
                   "piecewise graphs instead of running every op through Python")
    return p


def checked(p: argparse.ArgumentParser, a):
    """The parsed options, with the engine resolved and the usage errors refused in one line (exit 2)."""
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


def pass_args(a) -> list[str]:
    """The options of ``a.passed`` (``COMMON`` and the script's own) as command-line flags for a stage."""
    out = []
    for k in a.passed:
        v = getattr(a, k)
        flag = "--" + k.replace("_", "-")
        if isinstance(v, bool):
            out += [flag] if v else []
        else:
            out += [flag, str(v)]
    return out
