"""The rollout side of ``--engine frameworks``: a real ``vllm.LLM`` with rlk-vllm-plugin.

The plugin is loaded by vLLM itself (its ``vllm.general_plugins`` entry point) and reads the plan from the
``RL_KERNEL_*`` variables the run sets before the engine starts. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the uni-process executor on one GPU, ``external_launcher`` under
torchrun for tensor parallelism (every rank holds one engine; same prompts and seeds, so every rank samples
the same tokens). The model starts from dummy weights and receives the trainer's before the first round
(:mod:`rlk_vllm_plugin.weight_sync`), exactly as after every update. Sampling: ``n`` samples per prompt,
``logprobs=0`` (the sampled token's log-prob, ``logprobs_mode=processed_logprobs`` as VIME runs it: after
temperature and the filters), temperature, top-p, top-k and min-p as configured, one seed per prompt.

A Qwen3-MoE model (issue 36): ``config.json`` says ``Qwen3MoeForCausalLM`` and vLLM's ``FusedMoE`` layers receive the
trainer's experts as every other weight (per expert, into ``w13_weight`` / ``w2_weight``). vLLM 0.22 runs MoE models on
its V1 runner by default, whose log-probs rlk does not hook: the run asks for Model Runner V2
(``VLLM_USE_V2_MODEL_RUNNER=1``, both modes). vLLM's own routed-experts record is V1-only there, so the plugin keeps one
(``RL_KERNEL_VLLM_MOE_ROUTING=1``, ``rlk_vllm_plugin.moe.RoutingRecord``: every computed token's expert ids from the
routers' capture hook, filed by request id and position); prefix caching is off so that every sample's prompt
positions are computed (a cache hit would skip them). Each sample's record is ``[prompt + response - 1, layers, k]``.
FlashInfer's fused MoE is kept off (``VLLM_USE_FLASHINFER_MOE_FP16=0``): it reorders the expert weights at load time,
which an in-place update from the trainer's layout would leave wrong.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# set before vLLM is imported or an engine starts (a variable already set by the user is kept)
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "VLLM_USE_DEEP_GEMM": "0",
            "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1", "VLLM_DISABLE_COMPILE_CACHE": "1",
            "TOKENIZERS_PARALLELISM": "false", "VLLM_USE_FLASHINFER_MOE_FP16": "0"}


@dataclass
class Completion:
    prompt_index: int
    tokens: list[int]
    logprobs: list[float]
    finish_reason: str | None
    routing: Any = None  # MoE: [prompt + response - 1, layers, k] expert ids (torch.int64), the plugin's record


@dataclass
class RolloutResult:
    completions: list[Completion]  # prompt-major: all samples of prompt 0, then prompt 1, ...
    seconds: float
    prompt_tokens: int
    generated: int


def write_model_dir(path: Path, cfg) -> Path:
    """``config.json`` only: vLLM builds the model from it with dummy weights (the trainer's follow)."""
    path.mkdir(parents=True, exist_ok=True)
    conf = cfg.to_hf()
    conf["torch_dtype"] = "bfloat16"
    (path / "config.json").write_text(json.dumps(conf, indent=2), encoding="utf-8")
    return path


class VllmRollout:
    def __init__(self, model_dir: Path, *, dtype: str, seed: int, tp: int, max_model_len: int,
                 gpu_memory_utilization: float, enforce_eager: bool, attention_r: bool, max_num_seqs: int,
                 max_num_batched_tokens: int, cuda_graphs: dict[str, Any] | None = None,
                 routed_experts: bool = False, quantization: str = "none") -> None:
        for k, v in VLLM_ENV.items():
            os.environ.setdefault(k, v)
        if routed_experts:  # an MoE model: Model Runner V2 (rlk's log-probs) and the plugin's routing record
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
            os.environ["RL_KERNEL_VLLM_MOE_ROUTING"] = "1"
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError("--engine frameworks needs vLLM's engine core in this process "
                               "(VLLM_ENABLE_V1_MULTIPROCESSING=0): the weight update passes tensors by reference")
        from vllm import LLM

        kw: dict[str, Any] = dict(model=str(model_dir), dtype=dtype, skip_tokenizer_init=True, seed=seed,
                                  load_format="dummy", max_model_len=max_model_len, enforce_eager=enforce_eager,
                                  gpu_memory_utilization=gpu_memory_utilization, enable_chunked_prefill=True,
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  tensor_parallel_size=tp, disable_log_stats=True,
                                  logprobs_mode="processed_logprobs")  # VIME's default: after temperature / filters
        if tp > 1:
            kw["distributed_executor_backend"] = "external_launcher"
            # vLLM 0.22's fused all-reduce + RMSNorm pass bypasses the plugin's all-reduce and norm; its sequence-
            # parallel / async-TP passes its all-reduce (and rlk.gemm.tp.v1's merge): the plugin refuses all three
            kw["compilation_config"] = {"pass_config": {"fuse_allreduce_rms": False, "enable_sp": False,
                                                        "fuse_gemm_comms": False}}
        if cuda_graphs is not None:  # issue 37: e.g. FULL_DECODE_ONLY with exact sizes (the plugin records replays)
            kw.setdefault("compilation_config", {}).update(cudagraph_mode=cuda_graphs["cudagraph_mode"],
                                                           cudagraph_capture_sizes=cuda_graphs["capture_sizes"])
        if attention_r:
            kw["attention_backend"] = "CUSTOM"
        self.routed_experts = routed_experts
        if routed_experts:  # every prompt position computed for every sample (the routing record covers it)
            kw["enable_prefix_caching"] = False
        self.quantization = quantization
        if quantization == "fp8":  # issue 38: vLLM's online FP8 W8A8 (rlk_repro.engine.fp8); training stays BF16
            kw["quantization"] = "fp8"
        self.kwargs = {k: v for k, v in kw.items() if k != "model"}
        t0 = time.perf_counter()
        self.llm = LLM(**kw)
        self.start_seconds = time.perf_counter() - t0

    def generate(self, prompts: list[list[int]], seeds: list[int], limits: list[int], n: int,
                 temperature: float, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 stop_token_ids: list[int] | None = None) -> RolloutResult:
        """``stop_token_ids``: the run's stop tokens (its EOS and the tokenizer's, issue 37), given to vLLM
        explicitly: its tokenizer is not loaded (``skip_tokenizer_init``), so it knows no EOS of its own."""
        from vllm import SamplingParams

        sps = [SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, logprobs=0,
                              max_tokens=lim, seed=seed, detokenize=False, stop_token_ids=list(stop_token_ids or ()))
               for seed, lim in zip(seeds, limits, strict=True)]
        t0 = time.perf_counter()
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
        seconds = time.perf_counter() - t0
        routing = self._take_routing()
        comps = []
        for i, out in enumerate(outs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                if c.logprobs is None or len(c.logprobs) != len(toks):
                    raise RuntimeError(f"vLLM returned no log-prob for some sampled tokens of prompt {i}")
                lps = [float(lp[t].logprob) for lp, t in zip(c.logprobs, toks, strict=True)]
                ids = None
                if routing is not None:
                    ids = self._routing(routing, (str(out.request_id), int(c.index)), len(prompts[i]) + len(toks) - 1,
                                        i)
                comps.append(Completion(i, toks, lps, c.finish_reason, ids))
        gen = sum(len(c.tokens) for c in comps)
        return RolloutResult(comps, seconds, sum(len(p) for p in prompts) * n, gen)

    def _take_routing(self) -> dict[tuple[str, int], Any] | None:
        """The plugin's routing record of the requests just run, by (request id, sample index); None unless asked."""
        if not self.routed_experts:
            return None
        from rlk_vllm_plugin import moe

        keyed = {moe.request_key(req): ids for req, ids in moe.take_routing().items()}
        return {k: v for k, v in keyed.items() if k is not None}

    @staticmethod
    def _routing(routing: dict, key: tuple[str, int], positions: int, prompt: int):
        """A sample's ``[positions, layers, k]`` expert ids; refused when the record lacks the sample or covers
        another number of positions than prompt + response - 1."""
        if key not in routing:
            raise RuntimeError(f"the vLLM routing record has no sample {key[1]} of request {key[0]} (prompt {prompt})")
        ids = routing[key]
        if ids is None:
            raise RuntimeError(f"the vLLM routing record of sample {key[1]} of prompt {prompt} lacks positions (a "
                               "prefix-cache hit skipped computing them)")
        if ids.shape[0] != positions:
            raise RuntimeError(f"the vLLM routing record of sample {key[1]} of prompt {prompt} covers {ids.shape[0]} "
                               f"positions, not {positions} (prompt + response - 1)")
        return ids

    def load_weights(self, weights) -> dict[str, Any]:
        from rlk_vllm_plugin.weight_sync import load_weights

        if self.quantization == "fp8":  # re-quantized into vLLM's FP8 parameters (rlk_repro.engine.fp8)
            from rlk_repro.engine.fp8 import load_weights
        t0 = time.perf_counter()
        out = load_weights(self.llm, weights)
        out["seconds"] = time.perf_counter() - t0
        return out

    def info(self) -> dict[str, Any]:
        import vllm

        out: dict[str, Any] = {"vllm": vllm.__version__, "engine_kwargs": self.kwargs,
                               "engine_start_s": round(self.start_seconds, 1)}
        try:
            cfg = self.llm.llm_engine.vllm_config
            out["attention_backend_config"] = str(cfg.attention_config.backend)
            cc = cfg.compilation_config
            out["compilation"] = {"mode": str(cc.mode), "cudagraph_mode": str(cc.cudagraph_mode)}
            out["enable_prefix_caching"] = bool(cfg.cache_config.enable_prefix_caching)
            out["v2_model_runner"] = bool(cfg.use_v2_model_runner)
        except Exception as exc:  # informational only
            out["config_error"] = f"{type(exc).__name__}: {exc}"
        if self.quantization == "fp8":  # what serves the FP8 rollout, read from the model (not informational only)
            from rlk_repro.engine.fp8 import describe

            out["fp8"] = self.llm.apply_model(describe)[0]
        return out

    def shutdown(self) -> None:
        try:
            self.llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
