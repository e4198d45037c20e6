"""Sampled-token log-probs and filtered sampling: vLLM's Model Runner V2 sampler on rlk under logp R.

Model Runner V2 (vLLM's default for Qwen3 in 0.22 and for every model in 0.33) processes the logits in
``Sampler.apply_sampling_params`` (an fp32 copy; logit bias, penalties, bad words; temperature; min-p; top-k /
top-p) and computes the returned log-probs in the module global
``vllm.v1.worker.gpu.sample.logprob.compute_token_logprobs(logits, token_ids)``. Under logp R:

- ``Sampler.apply_sampling_params`` keeps vLLM's logit processors (logit bias, penalties, bad words: refused in
  strict mode for requests that ask for log-probs, see :func:`refusals`) and replaces the rest with contract
  ``rlk.logp.processed.v1``: ``z = f32(logits) / f32(T)`` (one IEEE division), the kept set of each row's
  top-k / top-p / min-p (``rlk_core.ops.kept_set``: one threshold per row, batch-invariant), and the processed
  logits ``z`` with ``-inf`` outside the kept set. vLLM's own Gumbel sampler draws from them (seeded per
  request, a row's draw depends on that row only). Greedy rows (``temperature = 0``) take ``T = 1`` and are
  vLLM's greedy semantics (argmax of the filtered logits): served, not comparable with training.
- :func:`token_logprobs_hook` replaces ``compute_token_logprobs``: inside a sampling step, row ``i`` and column
  ``k`` get rlk's ``token_logprobs(logits, token_ids[:, k], T, kept=K)`` — ``z_y - logsumexp_K z``, vLLM's
  ``processed_logprobs`` semantics, the bits the trainer computes with the same kept set — or, with
  ``RL_KERNEL_VLLM_UNFILTERED_LOGPROBS=1``, the unfiltered ``log softmax(z)`` (sampling stays filtered);
  outside a sampling step (prompt log-probs) the given logits at temperature 1, which is vLLM's definition.

With ``RL_KERNEL_VLLM_KEPT_EXPORT=1`` each sampling step also appends one JSON line per sampled token to
``rlk-kept-<pid>.jsonl`` beside the readbacks (:func:`export_step`): the request, the sampled token and its
position, the kept set's threshold and size, and whether the row was greedy (then ``comparable: false``) — the
per-token threshold an orchestrator hands to the trainer (``metadata["rlk_kept"]`` of the Megatron provider).

Under every plan ``Sampler.add_request`` counts the requests the sampler takes into the readback's
``annotations.sampling`` (:func:`note_request`): greedy or sampled, with log-probs or not, and ``comparable: false``
once a greedy request asks for log-probs (rlk-validate's ``GREEDY_NOT_COMPARABLE``).

vLLM's V1 runner computes log-probs elsewhere (``vllm.v1.sample.sampler.Sampler.compute_logprobs``, a
full ``log_softmax``): under logp R that is a fallback (strict: raise; run vLLM with Model Runner V2).
"""

from __future__ import annotations

import contextvars
import json
import os
from pathlib import Path
from typing import Any

import torch

from rlk_core.errors import RlkPolicyError
from rlk_vllm_plugin import _compat, _runtime

LOGPROB_MODULE = "vllm.v1.worker.gpu.sample.logprob"
SAMPLER_MODULE = "vllm.v1.worker.gpu.sample.sampler"
PROMPT_LOGPROB_MODULE = "vllm.v1.worker.gpu.sample.prompt_logprob"
V1_SAMPLER_MODULE = "vllm.v1.sample.sampler"

# the sampling step in progress: {"logits": raw logits [R, V] (or the fp32 copy vLLM's logit processors ran on),
# "temperature": [R] float32 (greedy rows: 1), "kept": the rows' KeptSet or None}
_STEP: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("rlk_vllm_sampling_step", default=None)


def token_logprobs_hook(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Drop-in for ``compute_token_logprobs``: float32 ``[R, K]`` log-probs of ``token_ids`` ``[R, K]``."""
    step = _STEP.get()
    kept = None
    if step is not None:  # inside Sampler.__call__: apply_sampling_params has filled the step
        if step.get("logits") is None or step["logits"].shape != logits.shape:
            raise RlkPolicyError("logp R: vLLM computed sampled-token log-probs without its apply_sampling_params "
                                 "step (rlk's processing did not run for these logits)")
        raw, temperature = step["logits"], step["temperature"]
        if not _runtime.get().unfiltered_logprobs:
            kept = step.get("kept")
    else:
        raw, temperature = logits, torch.ones(logits.shape[0], dtype=torch.float32, device=logits.device)
    ids = token_ids.to(torch.int64)
    cols = [_runtime.rlk("logp", "token_logprobs", raw, ids[:, k].contiguous(), temperature, kept=kept)[0]
            for k in range(ids.shape[1])]
    if not cols:
        return logits.new_empty((logits.shape[0], 0), dtype=torch.float32)
    return torch.stack(cols, dim=1)


def refusals(sp: Any) -> list[str]:
    """What in a request's ``SamplingParams`` no trainer recomputes: penalties, logit bias, bad words, allowed
    token ids, min_tokens (they change the logits before the kept set; contract ``rlk.logp.processed.v1`` covers
    temperature, top-k, top-p and min-p only)."""
    out = []
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(sp, name, neutral) != neutral:
            out.append(f"{name}={getattr(sp, name)}")
    for name in ("logit_bias", "bad_words", "allowed_token_ids"):
        if getattr(sp, name, None):
            out.append(name)
    if getattr(sp, "min_tokens", 0):
        out.append(f"min_tokens={sp.min_tokens}")
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
    """Refuse (strict) or log (audit) a request asking for log-probs with a logit processor no trainer recomputes.
    top-k / top-p / min-p are served through ``rlk.logp.processed.v1``; greedy requests are served (vLLM's greedy
    semantics, not comparable with training)."""
    if getattr(sp, "logprobs", None) is None or (getattr(sp, "extra_args", None) or {}).get(WARMUP_MARK):
        return
    processors = refusals(sp)
    if processors:
        rt.violation("logp R: a request asks for log-probs with " + ", ".join(processors) + ", which change the "
                     "logits before sampling and which no trainer recomputes (rlk covers temperature, top_k, top_p "
                     "and min_p: contract rlk.logp.processed.v1); drop them for an exact run")


SAMPLING_TOPIC = "sampling"
GREEDY_REASON = ("greedy requests (temperature 0) asked for log-probs: vLLM samples them by argmax and returns their "
                 "log-probs at temperature 1, not of a distribution a trainer recomputes; their tokens are not "
                 "comparable with training")
COUNTED = ("requests added to vLLM's sampler (Sampler.add_request: one per sequence of a request with n > 1, again for "
           "a request re-added after preemption), vLLM's own sampler warm-up left out")


def note_request(sp: Any, rt: _runtime.Runtime) -> None:
    """Count a request the sampler takes in the readback's ``annotations.sampling`` (whatever the plan: a greedy
    rollout is not comparable with training under P too): ``greedy`` (temperature 0 in float32, what vLLM's Gumbel
    sampler turns into an argmax) or ``sampled``, each also ``*_with_logprobs`` where it asks for log-probs, and
    ``comparable`` false with :data:`GREEDY_REASON` once a greedy request asks for log-probs. Host-side parameters
    read once per request: nothing per sampling step, no device sync."""
    if (getattr(sp, "extra_args", None) or {}).get(WARMUP_MARK):
        return
    greedy = abs(float(sp.temperature)) <= 2.0 ** -150  # rounds to 0 in float32 (to nearest, ties to even)
    kind = "greedy" if greedy else "sampled"
    asks = getattr(sp, "logprobs", None) is not None
    recorder = rt.recorder
    recorder.tally(SAMPLING_TOPIC, **{kind: 1, f"{kind}_with_logprobs": int(asks)})
    recorder.annotate(SAMPLING_TOPIC, replace=False, comparable=True, reason=None, counted=COUNTED)
    if greedy and asks:
        recorder.annotate(SAMPLING_TOPIC, comparable=False, reason=GREEDY_REASON)


def _add_request(original):
    """``Sampler.add_request``: 0.22 ``(req_idx, prompt_len, sampling_params)``, 0.33 ``(req_idx,
    sampling_params)``; the request's parameters are found by name, every argument passes through."""
    sampling_params = _compat.argument(original, "sampling_params")

    def add_request(self, *args, **kwargs):
        rt = _runtime.get()
        sp = sampling_params((self, *args), kwargs)
        if rt.r("logp"):
            check_request(sp, rt)
        note_request(sp, rt)
        return original(self, *args, **kwargs)
    add_request._rlk_original = original
    return add_request


def _sampler_call(original):
    def __call__(self, logits, input_batch):
        if not _runtime.get().r("logp"):
            return original(self, logits, input_batch)
        token = _STEP.set({})  # filled by apply_sampling_params (processed_logits), read by the log-prob hook
        try:
            out = original(self, logits, input_batch)
            if _runtime.get().kept_export:
                export_step(_STEP.get(), input_batch, out)
            return out
        finally:
            _STEP.reset(token)
    __call__._rlk_original = original
    return __call__


# vLLM's logit processors that apply_sampling_params runs before the temperature (0.22's names and arguments;
# each a no-op for rows that do not use it, and refused in strict mode for requests asking for log-probs)
_PROCESSORS = (("logit_bias_state", "apply_logit_bias", ("expanded_idx_mapping", "idx_mapping_np", "pos")),
               ("penalties_state", "apply_penalties",
                ("expanded_idx_mapping", "idx_mapping_np", "input_ids", "expanded_local_pos")),
               ("bad_words_state", "apply_bad_words",
                ("expanded_idx_mapping", "idx_mapping_np", "input_ids", "expanded_local_pos")))


# 0.33's LogitsContext fields (all arguments of its apply_sampling_params)
_CONTEXT_FIELDS = ("expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "expanded_local_pos", "input_ids", "pos",
                   "seq_lens_upper_bound_np")


def processed_logits(sampler: Any, logits: torch.Tensor, expanded_idx_mapping: torch.Tensor, idx_mapping_np: Any,
                     named: dict[str, Any]) -> torch.Tensor:
    """The processed logits of a sampling step under logp R (contract ``rlk.logp.processed.v1``): an fp32 copy,
    vLLM's logit processors, then ``z = x / T``, each row's kept set and ``-inf`` outside it. The step's kept sets
    go to :func:`token_logprobs_hook` through ``_STEP``."""
    from rlk_core.ops.kept_set import PATH_ALL
    from rlk_core.ops.kept_set.reference import choose_path, tempered

    states = sampler.sampling_states
    if named.get("skip_top_k_top_p"):  # 0.33: its FlashInfer sampler filters on its own, outside the kept set
        _runtime.get().violation("logp R: vLLM asked for its logits without top-k / top-p (its FlashInfer sampler "
                                 "then filters on its own, not through rlk's kept set); run with "
                                 "VLLM_USE_FLASHINFER_SAMPLER=0")
    x = torch.empty_like(logits, dtype=torch.float32).copy_(logits)
    processors = getattr(sampler, "logits_processors", None)
    if processors is not None:  # 0.33: the processor list and the thinking budget, as apply_sampling_params runs them
        context = _compat.module(SAMPLER_MODULE).LogitsContext
        ctx = context(**{k: named[k] for k in _CONTEXT_FIELDS if k in named})
        for processor in processors:
            x = processor.apply(x, ctx)
        budget = getattr(sampler, "thinking_budget_state", None)
        if budget is not None:
            budget.apply(x, ctx)
    else:
        for state, method, args in _PROCESSORS:
            fn = getattr(getattr(sampler, state, None), method, None)
            if fn is not None and all(a in named for a in args):
                fn(x, *(named[a] for a in args))
    vocab = x.shape[1]
    temp = states.temperature.gpu[expanded_idx_mapping].to(torch.float32)
    greedy = temp == 0.0
    temp = torch.where(greedy, torch.ones_like(temp), temp)  # greedy rows: T = 1, vLLM's argmax semantics
    top_k = states.top_k.gpu[expanded_idx_mapping].to(torch.int64)
    top_p = states.top_p.gpu[expanded_idx_mapping].to(torch.float32)
    min_p = states.min_p.gpu[expanded_idx_mapping].to(torch.float32)
    host = None
    if len(idx_mapping_np) == x.shape[0]:  # one logits row per request (no speculative expansion): host values
        host = ([int(k) if 0 < k < vocab else 0 for k in states.top_k.np[idx_mapping_np]],
                [float(p) for p in states.top_p.np[idx_mapping_np]],
                [float(m) for m in states.min_p.np[idx_mapping_np]])
    kept = None
    if host is None or choose_path(vocab, *host)[0] != PATH_ALL:  # some row filters (else: the whole vocabulary)
        kept = _runtime.rlk("logp", "kept_set", x, temp, top_k, top_p, min_p, host=host)
    step = _STEP.get()
    if step is not None:
        step.update(logits=x, temperature=temp, kept=kept, greedy=greedy)
    return tempered(x, temp) if kept is None else _runtime.rlk("logp", "apply_kept", x, temp, kept)


KEPT_EXPORT_PREFIX = "rlk-kept-"


def kept_records(step: dict[str, Any], input_batch: Any, sampled: torch.Tensor) -> list[dict[str, Any]]:
    """One record per row of a sampling step (one sampled token per request): ``req_id``, ``pos`` (the sampled
    token's position in the sequence: the last input token's position + 1), ``token`` (the sampled id),
    ``temperature`` (the one applied: 1 for greedy rows), the kept set's threshold ``value`` (fp32 as a float,
    ``null`` where the kept set is the whole vocabulary, i.e. ``-inf``), ``value_hex`` (its exact bits,
    ``float.hex``), ``token_id`` and ``size`` (contract ``rlk.logp.processed.v1``), ``greedy`` and
    ``comparable`` (false for greedy rows: vLLM's argmax, not a distribution a trainer recomputes)."""
    logits = step["logits"]
    rows, vocab = logits.shape
    req_ids = list(input_batch.req_ids)
    if len(req_ids) != rows:
        _runtime.get().violation(f"RL_KERNEL_VLLM_KEPT_EXPORT: {rows} logits rows for {len(req_ids)} requests "
                                 "(speculative decoding); the export covers one sampled token per request per step")
        return []
    kept = step.get("kept")
    if kept is None:  # no row filters: every kept set is the whole vocabulary
        value, token_id, size = [float("-inf")] * rows, [vocab - 1] * rows, [vocab] * rows
    else:
        value, token_id, size = kept.value.tolist(), kept.token_id.tolist(), kept.size.tolist()
    pos = (input_batch.positions[input_batch.logits_indices[:rows]] + 1).tolist()
    temperature, greedy = step["temperature"].tolist(), step["greedy"].tolist()
    tokens = sampled[:rows, 0].tolist()
    return [{"req_id": req_ids[i], "pos": int(pos[i]), "token": int(tokens[i]), "temperature": temperature[i],
             "value": None if value[i] == float("-inf") else value[i], "value_hex": float.hex(value[i]),
             "token_id": int(token_id[i]), "size": int(size[i]), "greedy": bool(greedy[i]),
             "comparable": not greedy[i]} for i in range(rows)]


def export_step(step: dict[str, Any] | None, input_batch: Any, output: Any) -> Path | None:
    """Append the step's :func:`kept_records` to ``rlk-kept-<pid>.jsonl`` in the readback directory (a host sync:
    the kept sets and sampled ids are read back). Returns the file (None when the step sampled nothing)."""
    if not step or step.get("logits") is None:
        return None
    rt = _runtime.get()
    directory = rt.recorder.directory
    if directory is None:
        rt.violation("RL_KERNEL_VLLM_KEPT_EXPORT=1 needs RL_KERNEL_READBACK_DIR (the records go beside the "
                     "readbacks)")
        return None
    records = kept_records(step, input_batch, output.sampled_token_ids)
    path = Path(directory) / f"{KEPT_EXPORT_PREFIX}{os.getpid()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.writelines(json.dumps(r, allow_nan=False) + "\n" for r in records)
    return path


def _apply_sampling_params(original):
    """``Sampler.apply_sampling_params``: rlk's processing under logp R (:func:`processed_logits`); the arguments
    are found by name in the installed vLLM's signature."""
    params = set(_compat.parameters(original))  # the probe made sure of logits, expanded_idx_mapping, idx_mapping_np
    getters = {n: _compat.argument(original, n) for n in
               ("logits", "expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "pos", "input_ids",
                "expanded_local_pos", "seq_lens_upper_bound_np", "skip_top_k_top_p") if n in params}

    def apply_sampling_params(self, *args, **kwargs):
        if not _runtime.get().r("logp"):
            return original(self, *args, **kwargs)
        named = {}
        for n, get in getters.items():
            try:
                named[n] = get((self, *args), kwargs)
            except IndexError:  # an argument left at its default (0.33's skip_top_k_top_p)
                pass
        return processed_logits(self, named["logits"], named["expanded_idx_mapping"], named["idx_mapping_np"], named)
    apply_sampling_params._rlk_original = original
    return apply_sampling_params


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
    _runtime.patch(sampler, "apply_sampling_params", _apply_sampling_params)
    targets += install_counting()
    v1 = _compat.module(V1_SAMPLER_MODULE).Sampler
    if getattr(v1.compute_logprobs, "_rlk_original", None) is None:  # a staticmethod in both versions
        v1.compute_logprobs = staticmethod(_v1_compute_logprobs(v1.compute_logprobs))
    return [*targets, f"{SAMPLER_MODULE}.Sampler.__call__", f"{SAMPLER_MODULE}.Sampler.apply_sampling_params",
            f"{V1_SAMPLER_MODULE}.Sampler.compute_logprobs"]


def install_counting() -> list[str]:
    """The request counting of every plan (:func:`note_request`, the readback's ``annotations.sampling``):
    ``Sampler.add_request`` (under logp P it only counts; every argument passes through) and the mark on vLLM's
    own sampler warm-up (left out of the counts). Returns the targets."""
    _runtime.patch(_compat.module(SAMPLER_MODULE).Sampler, "add_request", _add_request)
    targets = [f"{SAMPLER_MODULE}.Sampler.add_request"]
    params = _compat.module("vllm.sampling_params").SamplingParams
    warmup = getattr(params, "for_sampler_warmup", None)
    if warmup is not None and getattr(warmup, "_rlk_original", None) is None:  # a staticmethod
        params.for_sampler_warmup = staticmethod(_sampler_warmup(warmup))
    if warmup is not None:
        targets.append("vllm.sampling_params.SamplingParams.for_sampler_warmup")
    return targets


def uninstall() -> None:
    _restore_global(LOGPROB_MODULE, "compute_token_logprobs")
    try:
        _restore_global(PROMPT_LOGPROB_MODULE, "compute_token_logprobs")
    except (ImportError, AttributeError):
        pass
    sampler = _compat.module(SAMPLER_MODULE).Sampler
    _runtime.unpatch(sampler, "__call__")
    _runtime.unpatch(sampler, "add_request")
    _runtime.unpatch(sampler, "apply_sampling_params")
    params = _compat.module("vllm.sampling_params").SamplingParams
    original = getattr(getattr(params, "for_sampler_warmup", None), "_rlk_original", None)
    if original is not None:
        params.for_sampler_warmup = staticmethod(original)
    v1 = _compat.module(V1_SAMPLER_MODULE).Sampler
    original = getattr(v1.compute_logprobs, "_rlk_original", None)
    if original is not None:
        v1.compute_logprobs = staticmethod(original)
