"""slime / VIME hook callables: the ``--spec`` model builder and the ``--custom-tis-function-path`` recorder.

:func:`slime_spec` — ``--spec rlk_megatron_provider slime_spec``. slime imports the attribute and calls it as
``fn(args, config, vp_stage)``; a result that is itself callable with a ``pre_process`` parameter is used as
the model provider (``result(pre_process=, post_process=, vp_stage=)``), anything else as the layer spec.
This returns a provider (:class:`SlimeModelProvider`) rather than a bare spec because an R ``logp`` needs
:func:`rlk_megatron_provider.prepare_model` on the built ``GPTModel`` (the LM head is not spec-swappable,
see :mod:`rlk_megatron_provider.patches`), which slime's own builder would never call. The provider's
``layer_spec`` and ``block_spec(vp_stage)`` are the specs it builds with: Megatron's stock *local* spec
(what ``--transformer-impl local`` selects, built from the same ``args`` slime uses) with rlk classes in the
slots of the R modules only (the block spec is made at build time: it needs the pipeline groups).

:func:`record_logprobs` — ``--custom-tis-function-path rlk_megatron_provider.record_logprobs`` (with
``--get-mismatch-metrics``). slime calls it once per training micro-batch as ``fn(**tis_kwargs)`` with
``args``, ``pg_loss``, ``train_log_probs`` (per sample: the forward-only pass before the update, CP-local),
``rollout_log_probs`` (per sample, CP-local), ``loss_masks`` (per sample, full response length),
``total_lengths``, ``response_lengths`` and expects ``(pg_loss, loss_masks, metrics)``. It returns
``(pg_loss, loss_masks, {})`` — the very objects it received, so the loss is untouched — and, on the
TP-rank-0 process of each data/context-parallel rank, writes one ``rlk.vime-logprobs.v1`` record per call
into ``$RL_KERNEL_LOGPROB_RECORDS_DIR`` (docs/vime.md §4): ``rollout-<NNNNNN>.rank<R>.call<K>.safetensors``
with ``train_logprobs`` / ``rollout_logprobs`` float32 ``[N]``, ``loss_mask`` uint8 ``[N]`` and
``response_lengths`` int64 ``[S]`` (the CP-local lengths, summing to N), written atomically.

Composed with the user's own TIS/MIS function: where ``RL_KERNEL_TIS_FUNCTION`` names one (``module.fn``, what
the user would have passed to ``--custom-tis-function-path``), it is called after recording with the very keyword
arguments slime passed, and its ``(pg_loss, loss_masks, metrics)`` is returned, so recording never replaces a
correction the run asked for.

The rollout id is not among slime's TIS arguments: it is taken from a ``rollout_id`` keyword when a caller
passes one, else from the nearest calling frame that holds an integer local ``rollout_id`` (slime's
``train`` / ``train_one_step``); a call where neither exists is an error (a record filed under a guessed
round would be false evidence).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
from typing import Any

import torch

from rlk_core.errors import RlkConfigError

log = logging.getLogger("rlk.megatron")
RECORDS_VAR = "RL_KERNEL_LOGPROB_RECORDS_DIR"
USER_TIS_VAR = "RL_KERNEL_TIS_FUNCTION"
RECORD_NAME = "rollout-{rollout:06d}.rank{rank}.call{call}.safetensors"
_MAX_FRAMES = 64


# -- --spec: the model provider -----------------------------------------------------------------------
def _local_base_spec(args, config):
    """Megatron's stock local layer spec for ``args`` (the keyword set the installed version accepts)."""
    from rlk_megatron_provider import _compat

    wanted = {"num_experts": getattr(args, "num_experts", None),
              "moe_grouped_gemm": getattr(args, "moe_grouped_gemm", False),
              "qk_layernorm": getattr(args, "qk_layernorm", False),
              "multi_latent_attention": getattr(args, "multi_latent_attention", False),
              "moe_use_legacy_grouped_gemm": getattr(args, "moe_use_legacy_grouped_gemm", False),
              "normalization": getattr(config, "normalization", None)}
    params = inspect.signature(_compat.get_gpt_layer_local_spec).parameters
    return _compat.get_gpt_layer_local_spec(**{k: v for k, v in wanted.items() if k in params})


def slime_problems(args) -> dict[str, list[str]]:
    """Launch arguments (beyond the TransformerConfig) whose features the R routes do not cover."""
    attention = []
    if getattr(args, "position_embedding_type", "rope") != "rope":
        attention.append(f"position_embedding_type={args.position_embedding_type!r} (rlk RoPE only)")
    if float(getattr(args, "rotary_percent", 1.0)) != 1.0:
        attention.append(f"rotary_percent={args.rotary_percent} (rlk RoPE rotates the whole head)")
    if getattr(args, "use_rope_scaling", False):
        attention.append("use_rope_scaling=True is not covered")
    common = []
    if getattr(args, "mtp_num_layers", None):
        common.append(f"mtp_num_layers={args.mtp_num_layers} (multi-token prediction) is not covered")
    if getattr(args, "fp8_param_gather", False):
        common.append("fp8_param_gather (a TE feature) is requested")
    return {"attention": common + attention, "ffn": list(common), "logp": list(common)}


class SlimeModelProvider:
    """What :func:`slime_spec` returns: slime calls it as ``provider(pre_process=, post_process=,
    vp_stage=)`` and takes the ``GPTModel`` it returns (built with :meth:`block_spec`, then
    :func:`rlk_megatron_provider.prepare_model`)."""

    def __init__(self, args, config, base, layer_spec):
        self.args, self.config, self.base, self.layer_spec = args, config, base, layer_spec
        self.rope_theta = float(getattr(args, "rotary_base", 10000))

    def block_spec(self, vp_stage: int | None = None):
        """The decoder block spec of (virtual) pipeline stage ``vp_stage`` (needs the pipeline groups)."""
        from rlk_megatron_provider import spec

        return spec.rlk_block_spec(self.config, rope_theta=self.rope_theta, base=self.base, vp_stage=vp_stage)

    def __call__(self, pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None):
        from rlk_megatron_provider import _compat, spec

        a = self.args
        kwargs: dict[str, Any] = dict(
            config=self.config, transformer_layer_spec=self.block_spec(vp_stage), vocab_size=a.padded_vocab_size,
            max_sequence_length=a.max_position_embeddings, pre_process=pre_process, post_process=post_process,
            fp16_lm_cross_entropy=getattr(a, "fp16_lm_cross_entropy", False), parallel_output=True,
            share_embeddings_and_output_weights=not getattr(a, "untie_embeddings_and_output_weights", False),
            position_embedding_type=getattr(a, "position_embedding_type", "rope"),
            rotary_percent=getattr(a, "rotary_percent", 1.0), rotary_base=a.rotary_base,
            rope_scaling=getattr(a, "use_rope_scaling", False))
        if vp_stage is not None:
            kwargs["vp_stage"] = vp_stage
        model = _compat.GPTModel(**kwargs)
        spec.prepare_model(model)
        return model

    def __repr__(self) -> str:
        return f"SlimeModelProvider(rlk modules: {self.rlk_modules()})"

    def rlk_modules(self) -> list[str]:
        from rlk_megatron_provider import _state

        st = _state.get()
        return [m for m in ("attention", "ffn", "logp") if st.rlk(m)]


def slime_spec(args, config, vp_stage: int | None = None) -> SlimeModelProvider:
    """``--spec rlk_megatron_provider slime_spec``: the model provider of the plan in ``RL_KERNEL_*``
    (module docstring). Strict mode: an R module whose features are not covered raises naming it."""
    import rlk_megatron_provider as prov
    from rlk_megatron_provider import _state, spec

    st = prov.initialize_from_environment()
    impl = getattr(args, "transformer_impl", "local")
    if impl != "local":
        raise RlkConfigError(f"--spec rlk_megatron_provider slime_spec builds Megatron's local spec; "
                             f"--transformer-impl is {impl!r} (the launch passes --transformer-impl local)")
    for module, reasons in slime_problems(args).items():
        if st.rlk(module) and reasons:
            st.refuse(module, "; ".join(reasons))
    base = _local_base_spec(args, config)
    layer = spec.rlk_layer_spec(config, rope_theta=float(getattr(args, "rotary_base", 10000)), base=base)
    _state.get().recorder.add_hook("slime_spec", "--spec rlk_megatron_provider slime_spec", "model-provider")
    return SlimeModelProvider(args, config, base, layer)


# -- --custom-tis-function-path: the log-prob recorder ------------------------------------------------
_LOCK = threading.Lock()
_CALLS: dict[int, int] = {}
_NOTED: set[str] = set()


def _note_once(key: str, level: int, msg: str, *a) -> None:
    if key not in _NOTED:
        _NOTED.add(key)
        log.log(level, msg, *a)


def _caller_rollout_id(start) -> int | None:
    frame, depth = start, 0
    while frame is not None and depth < _MAX_FRAMES:
        value = frame.f_locals.get("rollout_id")
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        frame, depth = frame.f_back, depth + 1
    return None


def parallel_ranks() -> dict[str, int]:
    """``global`` rank, ``tp`` rank, ``cp`` rank and ``cp_size`` of this process (0/1 without groups)."""
    import torch.distributed as dist

    out = {"global": dist.get_rank() if dist.is_available() and dist.is_initialized() else 0,
           "tp": 0, "cp": 0, "cp_size": 1}
    mpu = sys.modules.get("megatron.core.parallel_state")
    if mpu is not None and mpu.model_parallel_is_initialized():
        out.update(tp=mpu.get_tensor_model_parallel_rank(), cp=mpu.get_context_parallel_rank(),
                   cp_size=mpu.get_context_parallel_world_size())
    return out


def cp_response_ranges(total_length: int, response_length: int, cp_size: int,
                       cp_rank: int) -> list[tuple[int, int]]:
    """The response-token index ranges this CP rank's log-probs cover, in order (zigzag: the sample's
    token stream is cut into ``2*cp_size`` chunks of ``ceil(total/(2*cp_size))``; rank ``r`` holds chunks
    ``r`` and ``2*cp_size-1-r``; the log-prob at stream position ``i`` is response token ``i - (prompt-1)``
    for ``prompt-1 <= i < total-1``)."""
    if cp_size == 1:
        return [(0, response_length)]
    first = total_length - response_length - 1
    chunk = -(-total_length // (2 * cp_size))
    out = []
    for c in (cp_rank, 2 * cp_size - 1 - cp_rank):
        lo, hi = max(c * chunk, first), min((c + 1) * chunk, total_length - 1)
        if lo < hi:
            out.append((lo - first, hi - first))
    return out


def _host_fp32(*groups) -> list[torch.Tensor]:
    """Each group (a list of tensors) flattened, concatenated and cast to fp32, on the host — in one
    device-to-host copy for all groups together where they share a device (one host sync per record, not
    one per group); the cast is exact or the same rounding on either side."""
    sizes = [sum(p.numel() for p in g) for g in groups]
    parts = [p.detach().reshape(-1).float() for g in groups for p in g]
    if not parts:
        return [torch.zeros(0, dtype=torch.float32) for _ in groups]
    flat = torch.cat(parts).cpu() if len({p.device for p in parts}) == 1 else torch.cat([p.cpu() for p in parts])
    return list(flat.split(sizes))


def record_tensors(train_log_probs, rollout_log_probs, loss_masks, total_lengths=None, response_lengths=None,
                   cp_size: int = 1, cp_rank: int = 0) -> dict[str, torch.Tensor]:
    """The record's tensors from slime's per-sample lists (one concatenation each; the loss masks, full
    response length under CP, are cut to the CP-local tokens with :func:`cp_response_ranges`)."""
    lengths = [int(t.numel()) for t in train_log_probs]
    if len(rollout_log_probs) != len(lengths) or len(loss_masks) != len(lengths):
        raise RlkConfigError(f"record_logprobs: {len(lengths)} train, {len(rollout_log_probs)} rollout, "
                             f"{len(loss_masks)} mask tensors (one per sample each)")
    masks = list(loss_masks)
    for i, n in enumerate(lengths):
        if int(rollout_log_probs[i].numel()) != n:
            raise RlkConfigError(f"record_logprobs: sample {i} has {n} train and "
                                 f"{rollout_log_probs[i].numel()} rollout log-probs")
        m = masks[i].reshape(-1)
        if m.numel() != n and cp_size > 1 and total_lengths is not None and response_lengths is not None:
            m = torch.cat([m[a:b] for a, b in cp_response_ranges(int(total_lengths[i]), int(response_lengths[i]),
                                                                 cp_size, cp_rank)] or [m[:0]])
        if m.numel() != n:
            raise RlkConfigError(f"record_logprobs: sample {i} has {n} log-probs and a loss mask of {m.numel()}")
        masks[i] = m
    train, rollout, mask = _host_fp32(train_log_probs, rollout_log_probs, masks)
    return {"train_logprobs": train.clone(), "rollout_logprobs": rollout.clone(),
            "loss_mask": (mask != 0).to(torch.uint8), "response_lengths": torch.tensor(lengths, dtype=torch.int64)}


def record_logprobs(args=None, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths=None,
                    response_lengths=None, rollout_id: int | None = None, **kwargs):
    """``--custom-tis-function-path``: write this call's record (module docstring); then return the user's TIS
    function's result on the same arguments (``RL_KERNEL_TIS_FUNCTION``), else ``(pg_loss, loss_masks, {})``."""
    from rlk_core import envs

    user = envs.get(USER_TIS_VAR)
    fn = _user_function(user) if user else None  # a bad name fails before anything is written
    _record(args, pg_loss=pg_loss, train_log_probs=train_log_probs, rollout_log_probs=rollout_log_probs,
            loss_masks=loss_masks, total_lengths=total_lengths, response_lengths=response_lengths,
            rollout_id=rollout_id, caller=sys._getframe(1))
    if fn is None:
        return pg_loss, loss_masks, {}
    call = dict(kwargs, args=args, pg_loss=pg_loss, train_log_probs=train_log_probs,
                rollout_log_probs=rollout_log_probs, loss_masks=loss_masks, total_lengths=total_lengths,
                response_lengths=response_lengths)
    if rollout_id is not None:
        call["rollout_id"] = rollout_id
    return fn(**call)


def _user_function(path: str):
    """The user's TIS/MIS function ``module.fn`` (slime's ``load_function`` convention)."""
    import importlib

    module, _, name = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise RlkConfigError(f"{USER_TIS_VAR}={path!r}: cannot load it ({type(exc).__name__}: {exc})") from None
    import rlk_megatron_provider

    if fn in (record_logprobs, rlk_megatron_provider.record_logprobs) or not callable(fn):
        raise RlkConfigError(f"{USER_TIS_VAR}={path!r} is not the user's own callable TIS function")
    return fn


def _record(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
            rollout_id, caller) -> None:
    from rlk_core import envs

    directory = envs.get(RECORDS_VAR)
    if directory is None:
        _note_once("unset", logging.WARNING, "rlk record_logprobs: %s is unset; no log-prob records are written",
                   RECORDS_VAR)
        return
    ranks = parallel_ranks()
    if ranks["tp"] != 0:  # the TP ranks of one data/context-parallel rank hold the same log-probs
        return
    rid = rollout_id if rollout_id is not None else _caller_rollout_id(caller)
    if rid is None:
        raise RlkConfigError("rlk record_logprobs: no caller holds a 'rollout_id' (not called from slime's "
                             "train loop?); a record needs the round it belongs to")
    tensors = record_tensors(train_log_probs, rollout_log_probs, loss_masks, total_lengths, response_lengths,
                             ranks["cp_size"], ranks["cp"])
    with _LOCK:
        call = _CALLS.get(rid, 0)
        _CALLS[rid] = call + 1
    from safetensors.torch import save

    from rlk_validate.evidence import VIME_LOGPROBS_SCHEMA, write_bytes_atomic

    meta = {"schema": VIME_LOGPROBS_SCHEMA, "rollout_id": str(rid), "rank": str(ranks["global"]),
            "call": str(call), "cp_rank": str(ranks["cp"]), "cp_size": str(ranks["cp_size"]),
            "producer": "rlk_megatron_provider.record_logprobs"}
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, RECORD_NAME.format(rollout=rid, rank=ranks["global"], call=call))
    write_bytes_atomic(path, save(tensors, metadata=meta))
    if "hook" not in _NOTED:
        _NOTED.add("hook")
        from rlk_megatron_provider import _state

        st = _state.current()
        if st is not None:
            st.recorder.add_hook("record_logprobs", "--custom-tis-function-path", "tis-function")


def reset_calls() -> None:
    """Forget the per-rollout call counters (tests)."""
    with _LOCK:
        _CALLS.clear()
        _NOTED.discard("hook")
