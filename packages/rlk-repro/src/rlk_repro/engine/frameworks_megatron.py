"""The train side of ``--engine frameworks``: real megatron-core with rlk-megatron-provider.

A ``GPTModel`` is built from the provider's block spec (rlk classes in the slots of the plan's train-side R
modules, Megatron's stock local spec everywhere else; all P = the stock local spec) and finished with
``prepare_model`` (the rlk LM head, production recording for P modules, verification). Sequences are
packed THD (``PackedSeqParams``, global ``cu_seqlens``) when the train-side attention is R; Megatron's
local ``DotProductAttention`` refuses THD, so a P attention runs right-padded sbhd batches with a causal
mask (a real token never attends to padding). The per-token log-probs of the response tokens come from
the forward before the update: rlk's ``vocab_parallel_logprobs`` from the final hidden states and the LM
head for an R ``logp``; Megatron's logits + fp32 ``log_softmax`` for a P one. The loss is the local
trainer's GRPO (PPO-clip, token mean), accumulated over micro-batches; the update is AdamW on fp32 master
weights whose cast is what the model (and vLLM) then holds.

A Qwen3-MoE model (issue 36) is built from Megatron's local MoE layer spec (``get_gpt_layer_local_spec(num_experts=E,
moe_grouped_gemm=False)``): for an R ffn the provider puts its MoE layer there (``rlk_megatron_provider.moe``: rlk's
router, grouped experts — ``GroupedMLP``'s parameter layout — and slot-order combine); for a P ffn the stock
``MoELayer`` runs (``TopKRouter``, ``SequentialMLP``, the all-gather dispatcher). Both load the same Hugging Face
weights (the converter's ``grouped`` / ``sequential`` expert layouts). No aux / z loss (the local trainer has none),
EP 1, TP 1. Every forward records each token's ``k`` expert ids at every layer (a forward hook on each router), so a
round reports how many tokens the two sides routed differently (``rlk_repro.engine.routing``).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rlk_core.errors import RlkConfigError
from rlk_repro.engine.trainer import Sample, grpo_surrogate, make_optimizer


@dataclass
class MegatronStep:
    train_logprobs: list[torch.Tensor]  # per sample, fp32 on CPU
    loss: float
    grad_norm: float
    tokens: int
    seconds: float
    routing: list[torch.Tensor] | None = None  # MoE: per sample, [tokens, layers, k] expert ids (prompt + response - 1)


class MasterOptimizer:
    """fp32 master weights (copies of ``masters``, on each parameter's device) beside a bf16 (or fp32) model,
    the local trainer's scheme: the optimizer updates the masters from the model's gradients, the model's
    parameters are then copied from the masters (the forward runs on their cast), so both trainers apply the
    same update to the same gradients."""

    def __init__(self, model: torch.nn.Module, masters: dict[str, torch.Tensor], optimizer: str = "adamw",
                 lr: float = 3e-4, foreach: bool = False) -> None:
        self.params = dict(model.named_parameters())
        self.master = {n: torch.nn.Parameter(masters[n].detach().to(device=p.device, dtype=torch.float32, copy=True))
                       for n, p in self.params.items()}
        self.opt = make_optimizer([self.master[n] for n in sorted(self.master)], optimizer, lr, foreach)

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None

    def step(self) -> None:
        for n, p in self.params.items():
            self.master[n].grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        with torch.no_grad():
            for n, p in self.params.items():
                p.copy_(self.master[n])


def _snapshot(obj):
    """``obj`` (a state dict: nested dicts / lists of tensors and plain values) with every tensor copied to the CPU,
    so that it no longer changes with the live state."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


def rng_state(device: torch.device) -> dict:
    """Every RNG stream of this process that the frameworks engine's rounds could draw from: torch's CPU generator,
    the device's CUDA generator, Megatron's CUDA RNG tracker (its named states, e.g. the model-parallel one that
    ``model_parallel_cuda_manual_seed`` seeds), Python's and NumPy's global generators (vLLM seeds them at start-up).
    vLLM samples with per-request generators seeded from the run seed and the round (``frameworks._Run._requests``):
    nothing of them carries over between rounds."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    out = {"torch_cpu": torch.get_rng_state(),
           "megatron_tracker": _snapshot(tensor_parallel.get_cuda_rng_tracker().get_states()),
           "python": random.getstate(),
           "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                     "has_gauss": int(has_gauss), "cached_gaussian": float(gauss)}}
    if device.type == "cuda":
        out["torch_cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_state(state: dict, device: torch.device) -> None:
    """Put back what :func:`rng_state` saved (on the same kind of device)."""
    from megatron.core import tensor_parallel

    if ("torch_cuda" in state) != (device.type == "cuda"):
        raise RlkConfigError(f"the round state's RNG streams are for {'cuda' if 'torch_cuda' in state else 'cpu'}, "
                             f"this run is on {device.type}")
    import random

    import numpy as np

    torch.set_rng_state(state["torch_cpu"])
    if device.type == "cuda":
        torch.cuda.set_rng_state(state["torch_cuda"], device)
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["megatron_tracker"]))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))


def init_model_parallel(tp: int, seed: int) -> None:
    """Megatron's parallel state on the already-initialised default process group (shared with vLLM)."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def moe_fields(cfg) -> dict:
    """The ``TransformerConfig`` fields of a Qwen3-MoE model (none for a dense one): every layer sparse, top-k of a
    softmax router renormalised over the k (``norm_topk_prob``: Megatron's ``moe_router_pre_softmax`` off), no aux /
    z loss, no token dropping, the all-gather dispatcher."""
    if not getattr(cfg, "is_moe", False):
        return {}
    return dict(num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
                moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_pre_softmax=not cfg.norm_topk_prob,
                moe_token_dispatcher_type="allgather", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
                moe_router_load_balancing_type="none", moe_grouped_gemm=False)


def transformer_config(cfg, tp: int, device: torch.device, dtype: torch.dtype):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**moe_fields(cfg),
        num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads, kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, context_parallel_size=1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16, use_cpu_initialization=device.type == "cpu", perform_initialization=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False)


class MegatronTrainer:
    """One TP rank of the Megatron model, its fp32 masters and optimizer."""

    def __init__(self, cfg, weights: dict[str, torch.Tensor], *, tp: int, rank: int, device: torch.device,
                 dtype: torch.dtype, temperature: float, optimizer: str, lr: float, micro_tokens: int,
                 clip_eps: float = 0.2, sampling=None, processed: bool = False, pad_tokens_to: int = 1) -> None:
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel

        import rlk_megatron_provider as prov
        from rlk_megatron_provider.weights import to_megatron

        self.cfg, self.tp, self.device, self.dtype = cfg, tp, device, dtype
        self.temperature, self.clip_eps, self.micro_tokens = temperature, clip_eps, micro_tokens
        # a THD pack's tokens a multiple of this (sequence parallelism, emulated: the tokens split over the ranks):
        # one padding sequence at the end, outside the compared rows and the loss
        self.pad_tokens_to = pad_tokens_to
        # processed log-probs: the rollout's filters (engine.sampling.SamplingParams); each position's kept set is
        # found from this side's own logits (rlk's kept_set under R, the native filter under P)
        self.sampling, self.processed = sampling, processed and sampling is not None
        self.kept_sizes: list[torch.Tensor] = []  # per micro-batch of the last step (processed only)
        self.state = prov.initialize_from_environment()
        self.r_attention = self.state.rlk("attention")
        self.r_logp = self.state.rlk("logp")
        self.group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
        tc = transformer_config(cfg, tp, device, dtype)
        self.moe = bool(getattr(cfg, "is_moe", False))
        base = None
        if self.moe:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

            from rlk_megatron_provider.moe import stock_router_without_te

            if tp != 1:
                raise RlkConfigError(f"a Qwen3-MoE model runs at TP 1 in the frameworks engine, not {tp}")
            stock_router_without_te()  # a P router's GEMM on megatron-core 0.16.1 without TransformerEngine
            base = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                            normalization="RMSNorm")
        spec = prov.block_spec(tc, rope_theta=cfg.rope_theta, base=base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = GPTModel(tc, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                             max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                             rotary_base=int(cfg.rope_theta),
                             share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                             pre_process=True, post_process=True, parallel_output=True)
        self.layer_counts = prov.prepare_model(model)
        self.model = model.to(device=device, dtype=dtype)  # what Float16Module does
        self.experts = self._expert_layout() if self.moe else "grouped"
        self._routing: list[torch.Tensor] = []  # this forward's [S * B, k] expert ids, one per layer
        if self.moe:
            self._record_routing()
        sd = to_megatron(cfg, weights, tp, rank, experts=self.experts)
        missing, unexpected = self.model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RlkConfigError(f"Megatron state dict mismatch: missing {missing[:6]}, unexpected {unexpected[:6]}")
        self.optim = MasterOptimizer(self.model, sd, optimizer, lr)
        self.params, self.master = self.optim.params, self.optim.master
        del sd
        self.box: dict = {}
        if self.r_logp:
            self._hidden_head()

    def _expert_layout(self) -> str:
        """The converter's expert layout of the built model: rlk's experts keep ``GroupedMLP``'s parameters
        (``grouped``), the stock local spec builds ``SequentialMLP`` (``sequential``)."""
        from rlk_megatron_provider.moe import RlkGroupedExperts

        kinds = {type(layer.mlp.experts).__name__ for layer in self.model.decoder.layers}
        if kinds == {RlkGroupedExperts.__name__}:
            return "grouped"
        if kinds == {"SequentialMLP"}:
            return "sequential"
        raise RlkConfigError(f"the MoE layers' experts are {sorted(kinds)}: neither rlk's nor SequentialMLP")

    def _record_routing(self) -> None:
        """A forward hook on every layer's router keeping its tokens' ``k`` expert ids: rlk's router returns them
        (``(weights, ids)``), the stock ``TopKRouter`` a ``[T, E]`` routing map (each row's ``k`` set columns, in
        ascending id order: the set is what is compared)."""
        k, e = self.cfg.num_experts_per_tok, self.cfg.num_experts
        from rlk_megatron_provider.moe import RlkTopKRouter

        def grab(mod, args, output):
            if isinstance(mod, RlkTopKRouter):
                ids = output[1]
            else:
                routing_map = output[1]
                ids = torch.arange(e, device=routing_map.device).expand(routing_map.shape)[routing_map]
                ids = ids.view(routing_map.shape[0], k)
            self._routing.append(ids.detach())

        for layer in self.model.decoder.layers:
            layer.mlp.router.register_forward_hook(grab)

    def _sample_routing(self, lens: list[int], starts: list[int], batch: int) -> list[torch.Tensor]:
        """This forward's routing per sample, ``[len, layers, k]`` on the CPU: the router rows are the flattened
        ``[S, B]`` positions (s-major; THD: B = 1 and ``starts`` the packed offsets, sbhd: sample ``i`` is column
        ``i`` from position 0)."""
        layers, self._routing = self._routing, []
        if len(layers) != self.cfg.num_hidden_layers:
            raise RuntimeError(f"routing recorded for {len(layers)} of {self.cfg.num_hidden_layers} MoE layers")
        ids = torch.stack([t.view(-1, batch, t.shape[-1]) for t in layers], dim=2).cpu()  # [S, B, L, k]
        cols = range(len(lens)) if batch > 1 else [0] * len(lens)
        return [ids[st:st + n, c] for st, n, c in zip(starts, lens, cols, strict=True)]

    def _hidden_head(self) -> None:
        """``output_layer`` returns its input (the final-normed hidden states) and keeps the LM-head weight:
        the rlk logp module then runs from hidden states, never from ``[T, V]`` logits."""
        layer, box = self.model.output_layer, self.box

        def forward(input_, weight=None, runtime_gather_output=None):
            box["hidden"], box["weight"] = input_, (layer.weight if weight is None else weight)
            return input_, None

        layer.forward = forward

    # -- batches -----------------------------------------------------------------------------------
    def micro_batches(self, samples: list[Sample]) -> list[list[int]]:
        """Consecutive sample indices whose (padded, for sbhd) token count stays within ``micro_tokens``."""
        out: list[list[int]] = []
        cur: list[int] = []
        longest = 0
        for i, s in enumerate(samples):
            n = len(s.prompt) + len(s.response) - 1
            size = (max(longest, n) * (len(cur) + 1)) if not self.r_attention else (
                sum(len(samples[j].prompt) + len(samples[j].response) - 1 for j in cur) + n)
            if cur and size > self.micro_tokens:
                out.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            out.append(cur)
        return out

    def _logprobs(self, samples: list[Sample], routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """fp32 log-probs of every response token of ``samples`` (one forward, in sample order); an MoE model's
        per-sample expert ids appended to ``routing``."""
        dev = self.device
        seqs = [s.prompt + s.response for s in samples]
        lens = [len(q) - 1 for q in seqs]
        if self.r_attention and sum(lens) % self.pad_tokens_to:  # one padding sequence, outside the rows
            pad = self.pad_tokens_to - sum(lens) % self.pad_tokens_to
            seqs, lens = [*seqs, [0] * (pad + 1)], [*lens, pad]
        if self.r_attention:
            from megatron.core.packed_seq_params import PackedSeqParams

            ids = torch.tensor([t for q in seqs for t in q[:-1]], device=dev)[None]
            pos = torch.cat([torch.arange(n, device=dev) for n in lens])[None]
            cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
            psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                                  max_seqlen_kv=max(lens))
            starts = cu[:-1].tolist()[:len(samples)]  # the padding sequence (if any) is no sample
            out = self.model(ids, pos, None, packed_seq_params=psp)
        else:
            s_max = max(lens)
            ids = torch.zeros((len(seqs), s_max), dtype=torch.long, device=dev)
            for i, q in enumerate(seqs):
                ids[i, : lens[i]] = torch.tensor(q[:-1], device=dev)
            pos = torch.arange(s_max, device=dev)[None].expand(len(seqs), s_max)
            mask = torch.triu(torch.ones(s_max, s_max, dtype=torch.bool, device=dev), diagonal=1)[None, None]
            starts = [i * s_max for i in range(len(seqs))]
            out = self.model(ids, pos, mask.expand(len(seqs), 1, s_max, s_max))
        if self.moe:
            got = (self._sample_routing(lens, starts, 1) if self.r_attention
                   else self._sample_routing(lens, [0] * len(seqs), len(seqs)))
            if routing is not None:
                routing += got
        rows = torch.cat([torch.arange(st + len(s.prompt) - 1, st + len(s.prompt) - 1 + len(s.response), device=dev)
                          for st, s in zip(starts, samples, strict=True)])
        target = torch.tensor([t for s in samples for t in s.response], device=dev)
        if self.r_logp:
            from rlk_megatron_provider import logp

            h = self.box["hidden"]  # [s, b, H] (THD: [T, 1, H])
            h = h.transpose(0, 1).reshape(-1, h.shape[-1])[rows]
            kept = None
            if self.processed:
                sp = self.sampling
                kept = logp.kept_sets(h, self.box["weight"], self.temperature, sp.top_k, sp.top_p, sp.min_p,
                                      self.group)
                self.kept_sizes.append(kept.size.cpu())
                kept = (kept.value, kept.token_id)
            return logp.vocab_parallel_logprobs(h, self.box["weight"], target, self.temperature, self.group, kept=kept)
        logits = out.reshape(-1, out.shape[-1])[rows]  # GPTModel returns [b, s, V/tp]
        if self.tp > 1:
            from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

            logits = gather_from_tensor_model_parallel_region(logits)
        z = logits.float() / self.temperature
        if self.processed:  # the native filter (vLLM's rules in torch) on this side's logits
            from rlk_repro.engine.sampling import native_processed

            with torch.no_grad():
                keep = native_processed(logits.detach(), [self.sampling] * logits.shape[0]) != float("-inf")
            self.kept_sizes.append(keep.sum(-1).cpu())
            z = z.masked_fill(~keep, float("-inf"))
        return torch.log_softmax(z, dim=-1).gather(-1, target[:, None])[:, 0]

    # -- the step ----------------------------------------------------------------------------------
    def step(self, samples: list[Sample]) -> MegatronStep:
        """Recompute the log-probs (the compared numbers), then one GRPO update over all samples."""
        t0 = time.perf_counter()
        total = sum(len(s.response) for s in samples)
        for p in self.params.values():
            p.grad = None
        per_sample: list[torch.Tensor] = []
        routing: list[torch.Tensor] | None = [] if self.moe else None
        loss_sum = 0.0
        self.kept_sizes = []
        for idx in self.micro_batches(samples):
            mb = [samples[i] for i in idx]
            lp = self._logprobs(mb, routing)
            adv = torch.tensor([s.advantage for s in mb for _ in s.response], device=self.device,
                               dtype=torch.float32)
            loss = -grpo_surrogate(lp, adv, self.clip_eps).sum() / total
            loss.backward()
            loss_sum += float(loss.detach())
            per_sample += list(lp.detach().float().cpu().split([len(s.response) for s in mb]))
        grads = [p.grad for p in self.params.values() if p.grad is not None]
        grad_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))) if grads else 0.0
        self.optim.step()
        self.optim.zero_grad()
        from rlk_megatron_provider import invalidate_weight_caches

        invalidate_weight_caches()  # the weights were written in place: drop the cached [q; k; v] operands
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        tokens = sum(len(s.prompt) + len(s.response) - 1 for s in samples)
        return MegatronStep(per_sample, loss_sum, grad_norm, tokens, time.perf_counter() - t0, routing)

    # -- round state (rlk_repro.resume) --------------------------------------------------------------
    def round_state(self) -> dict:
        """What the next step starts from on this (TP 1) trainer, copied to the CPU: the fp32 masters (Megatron
        names) and the optimizer's state (AdamW's moments and step count). The bf16 parameters are the masters'
        cast (:meth:`MasterOptimizer.step`), so they are not saved."""
        if self.tp != 1:
            raise RlkConfigError(f"the frameworks engine saves round state at TP 1, not {self.tp}")
        return {"master": {n: m.detach().to("cpu", copy=True) for n, m in self.master.items()},
                "optimizer": _snapshot(self.optim.opt.state_dict())}

    def load_round_state(self, state: dict) -> None:
        """Continue from :meth:`round_state`'s ``state``: the masters copied in, the parameters set to their cast (as
        a step leaves them), the optimizer's state loaded; a state of another model exits 2 naming the difference."""
        master = state.get("master")
        if not isinstance(master, dict) or set(master) != set(self.master):
            got, mine = (set(master) if isinstance(master, dict) else set()), set(self.master)
            raise RlkConfigError(f"the round state's masters are not this model's (missing {sorted(mine - got)[:3]}, "
                                 f"unexpected {sorted(got - mine)[:3]})")
        bad = [n for n, m in self.master.items() if master[n].shape != m.shape or master[n].dtype != m.dtype]
        if bad:
            raise RlkConfigError(f"the round state's master {bad[0]} is {master[bad[0]].dtype} "
                                 f"{tuple(master[bad[0]].shape)}, the model's {tuple(self.master[bad[0]].shape)} fp32")
        with torch.no_grad():
            for n, m in self.master.items():
                m.copy_(master[n])
            for n, p in self.params.items():
                p.copy_(self.master[n])
        self.optim.opt.load_state_dict(state["optimizer"])
        from rlk_megatron_provider import invalidate_weight_caches

        invalidate_weight_caches()  # the weights changed in place

    def state_shards(self) -> list[dict[str, torch.Tensor]]:
        """This model's parameters from every TP rank (all-gathered), in rank order."""
        local = {n: p.detach() for n, p in self.params.items()}
        if self.tp == 1:
            return [local]
        import torch.distributed as dist

        shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp)]
        for n, t in local.items():
            parts = [torch.empty_like(t) for _ in range(self.tp)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            for r in range(self.tp):
                shards[r][n] = parts[r]
        return shards

    def hf_weights(self):
        """The current weights as ``(Hugging Face name, full tensor)`` pairs (what vLLM loads)."""
        from rlk_megatron_provider.weights import hf_from_megatron

        return hf_from_megatron(self.cfg, self.state_shards(), experts=self.experts)
