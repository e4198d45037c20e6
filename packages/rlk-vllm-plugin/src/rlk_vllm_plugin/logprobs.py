"""Sampled-token log-probs: vLLM's ``compute_token_logprobs`` -> rlk ``token_logprobs``.

Model Runner V2 (vLLM's default for Qwen3 in 0.22 and for every model in 0.33) computes the returned
log-probs in the module global ``vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs(logits,
token_ids)``, looked up at call time by ``compute_topk_logprobs`` / ``compute_topk_scores``. Under logp R
it is replaced by :func:`token_logprobs_hook`:

- inside a sampling step (``Sampler.__call__`` is wrapped to hand over the step's *raw* logits and each
  row's temperature), the result for row ``i`` and column ``k`` is rlk's
  ``token_logprobs(raw_logits, token_ids[:, k], temperature)`` — ``log softmax(logits / T)``, the
  trainer's definition — whichever ``--logprobs-mode`` (``processed_logprobs`` / ``raw_logprobs``) vLLM runs;
- outside a sampling step (prompt log-probs) the given logits at temperature 1, which is vLLM's definition.

With ``top_p = 1``, ``top_k`` off, ``min_p = 0`` and no penalties / logit bias / bad words these are vLLM's
processed log-probs; with any of them vLLM's processed log-probs differ from the trainer's by
construction, so ``Sampler.add_request`` refuses such a request that asks for log-probs (strict mode)
unless ``RL_KERNEL_VLLM_UNFILTERED_LOGPROBS=1`` accepts the unfiltered values. Greedy requests
(``temperature = 0``) are refused: the trainer's log-prob needs ``T > 0``.

vLLM's V1 runner computes log-probs elsewhere (``vllm.v1.sample.sampler.Sampler.compute_logprobs``, a
full ``log_softmax``): under logp R that is a fallback (strict: raise; run vLLM with Model Runner V2).
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from rlk_vllm_plugin import _compat, _runtime

LOGPROB_MODULE = "vllm.v1.worker.gpu.sample.logprob"
SAMPLER_MODULE = "vllm.v1.worker.gpu.sample.sampler"
PROMPT_LOGPROB_MODULE = "vllm.v1.worker.gpu.sample.prompt_logprob"
V1_SAMPLER_MODULE = "vllm.v1.sample.sampler"

# (raw logits [R, V], temperature [R] float32) of the sampling step in progress
_STEP: contextvars.ContextVar[tuple[torch.Tensor, torch.Tensor] | None] = contextvars.ContextVar(
    "rlk_vllm_sampling_step", default=None)


def token_logprobs_hook(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Drop-in for ``compute_token_logprobs``: float32 ``[R, K]`` log-probs of ``token_ids`` ``[R, K]``."""
    step = _STEP.get()
    if step is not None and step[0].shape == logits.shape:
        raw, temperature = step
    else:
        raw, temperature = logits, torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    ids = token_ids.to(torch.int64)
    cols = [_runtime.rlk("logp", "token_logprobs", raw, ids[:, k].contiguous(), temperature)[0]
            for k in range(ids.shape[1])]
    if not cols:
        return logits.new_empty((logits.shape[0], 0), dtype=torch.float32)
    return torch.stack(cols, dim=1)


def refusals(sp: Any) -> list[str]:
    """What in a request's ``SamplingParams`` makes vLLM's processed log-probs differ from the trainer's."""
    out = []
    if getattr(sp, "top_p", 1.0) < 1.0:
        out.append(f"top_p={sp.top_p}")
    if getattr(sp, "top_k", 0) not in (0, -1, None):
        out.append(f"top_k={sp.top_k}")
    if getattr(sp, "min_p", 0.0) > 0.0:
        out.append(f"min_p={sp.min_p}")
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(sp, name, neutral) != neutral:
            out.append(f"{name}={getattr(sp, name)}")
    for name in ("logit_bias", "bad_words", "allowed_token_ids"):
        if getattr(sp, name, None):
            out.append(name)
    return out


WARMUP_MARK = "rlk_sampler_warmup"


def _sampler_warmup(original):
    """vLLM's own sampler warm-up asks for log-probs with every filter on (``for_sampler_warmup``): mark
    those parameters so that strict mode does not refuse vLLM's start-up; users' requests are checked."""
    def for_sampler_warmup():
        sp = original()
        sp.extra_args = {**(sp.extra_args or {}), WARMUP_MARK: True}
        return sp
    for_sampler_warmup._rlk_original = original
    return for_sampler_warmup


def check_request(sp: Any, rt: _runtime.Runtime) -> None:
    if getattr(sp, "logprobs", None) is None or (getattr(sp, "extra_args", None) or {}).get(WARMUP_MARK):
        return
    if getattr(sp, "temperature", 1.0) <= 0.0:
        rt.violation("logp R: a request asks for log-probs with temperature 0 (greedy); the trainer's "
                     "log-prob needs temperature > 0")
    filters = refusals(sp)
    if filters and not rt.unfiltered_logprobs:
        rt.violation("logp R: a request asks for log-probs with " + ", ".join(filters) + "; vLLM's processed "
                     "log-probs then differ from the trainer's by construction. Use top_p=1, top_k=0, min_p=0 "
                     "and no penalties, or set RL_KERNEL_VLLM_UNFILTERED_LOGPROBS=1 to receive the unfiltered "
                     "log-probs")


def _add_request(original):
    """``Sampler.add_request``: 0.22 ``(req_idx, prompt_len, sampling_params)``, 0.33 ``(req_idx,
    sampling_params)``; the request's parameters are found by name, every argument passes through."""
    sampling_params = _compat.argument(original, "sampling_params")

    def add_request(self, *args, **kwargs):
        rt = _runtime.get()
        if rt.r("logp"):
            check_request(sampling_params((self, *args), kwargs), rt)
        return original(self, *args, **kwargs)
    add_request._rlk_original = original
    return add_request


def _sampler_call(original):
    def __call__(self, logits, input_batch):
        if not _runtime.get().r("logp"):
            return original(self, logits, input_batch)
        temperature = self.sampling_states.temperature.gpu[input_batch.expanded_idx_mapping].to(torch.float32)
        token = _STEP.set((logits, temperature))
        try:
            return original(self, logits, input_batch)
        finally:
            _STEP.reset(token)
    __call__._rlk_original = original
    return __call__


def _v1_compute_logprobs(original):
    def compute_logprobs(*args, **kwargs):
        rt = _runtime.get()
        if rt.r("logp"):
            rt.violation("logp R: vLLM computes log-probs on its V1 runner (vllm.v1.sample.sampler), which rlk "
                         "does not hook; run Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, needs Triton)")
        return original(*args, **kwargs)
    compute_logprobs._rlk_original = original
    return compute_logprobs


def _set_global(module_name: str, attr: str, value: Any) -> None:
    mod = _compat.module(module_name)
    current = getattr(mod, attr)
    if getattr(current, "_rlk_original", None) is None:
        value = _with_original(value, current)
        setattr(mod, attr, value)


def _with_original(fn: Any, original: Any) -> Any:
    def hook(logits, token_ids):
        if not _runtime.get().r("logp"):
            return original(logits, token_ids)
        return fn(logits, token_ids)
    hook._rlk_original = original
    hook.__name__ = "compute_token_logprobs"
    return hook


def _restore_global(module_name: str, attr: str) -> None:
    mod = _compat.module(module_name)
    original = getattr(getattr(mod, attr), "_rlk_original", None)
    if original is not None:
        setattr(mod, attr, original)


def install(probe: _compat.Probe) -> list[str]:
    """Install the log-prob hooks; returns the targets patched."""
    targets = [f"{LOGPROB_MODULE}.compute_token_logprobs"]
    _set_global(LOGPROB_MODULE, "compute_token_logprobs", token_logprobs_hook)
    if probe.features.get("prompt_logprob_binding"):
        _set_global(PROMPT_LOGPROB_MODULE, "compute_token_logprobs", token_logprobs_hook)
        targets.append(f"{PROMPT_LOGPROB_MODULE}.compute_token_logprobs")
    sampler = _compat.module(SAMPLER_MODULE).Sampler
    _runtime.patch(sampler, "__call__", _sampler_call)
    _runtime.patch(sampler, "add_request", _add_request)
    params = _compat.module("vllm.sampling_params").SamplingParams
    warmup = getattr(params, "for_sampler_warmup", None)
    if warmup is not None and getattr(warmup, "_rlk_original", None) is None:  # a staticmethod
        params.for_sampler_warmup = staticmethod(_sampler_warmup(warmup))
        targets.append("vllm.sampling_params.SamplingParams.for_sampler_warmup")
    v1 = _compat.module(V1_SAMPLER_MODULE).Sampler
    if getattr(v1.compute_logprobs, "_rlk_original", None) is None:  # a staticmethod in both versions
        v1.compute_logprobs = staticmethod(_v1_compute_logprobs(v1.compute_logprobs))
    return [*targets, f"{SAMPLER_MODULE}.Sampler.__call__", f"{SAMPLER_MODULE}.Sampler.add_request",
            f"{V1_SAMPLER_MODULE}.Sampler.compute_logprobs"]


def uninstall() -> None:
    _restore_global(LOGPROB_MODULE, "compute_token_logprobs")
    try:
        _restore_global(PROMPT_LOGPROB_MODULE, "compute_token_logprobs")
    except (ImportError, AttributeError):
        pass
    sampler = _compat.module(SAMPLER_MODULE).Sampler
    _runtime.unpatch(sampler, "__call__")
    _runtime.unpatch(sampler, "add_request")
    params = _compat.module("vllm.sampling_params").SamplingParams
    original = getattr(getattr(params, "for_sampler_warmup", None), "_rlk_original", None)
    if original is not None:
        params.for_sampler_warmup = staticmethod(original)
    v1 = _compat.module(V1_SAMPLER_MODULE).Sampler
    original = getattr(v1.compute_logprobs, "_rlk_original", None)
    if original is not None:
        v1.compute_logprobs = staticmethod(original)
