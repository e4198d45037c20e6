"""The Qwen3-shaped test model on both sides: rlk-repro's local trainer and megatron-core's GPTModel.

Shared by the tests and the GPU benchmark (``benchmarks/frameworks/megatron_gpu.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import types
import warnings

import torch
import torch.nn.functional as F

from rlk_repro.model.config import Qwen3Config
from rlk_repro.model.weights import random_weights

TEMPERATURE = 0.7


def config(tied: bool = False, **kw) -> Qwen3Config:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=None, eos_token_id=1)
    base.update(kw)
    return Qwen3Config(**base)


def weights(cfg: Qwen3Config, seed: int = 3):
    return random_weights(cfg, seed)


def sequences(lengths: list[int], vocab: int, seed: int = 11) -> list[list[int]]:
    """Token sequences of ``length + 1`` tokens (inputs are ``seq[:-1]``, targets ``seq[1:]``)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n + 1,), generator=g).tolist() for n in lengths]


def local_logprobs(cfg: Qwen3Config, w, seqs, plan_name: str = "consistency") -> torch.Tensor:
    """rlk-repro's trainer forward: log-probs of every packed position (fp32)."""
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model.ops import Ops

    plan = RoutePlan.preset(plan_name)
    ops = Ops(plan, "train", ReadbackRecorder("local", "train", plan, mode="strict"))
    tr = Trainer(cfg, w, ops, device=torch.device("cpu"), dtype=torch.float32, temperature=TEMPERATURE)
    return tr.forward_logprobs(seqs).detach(), tr


def tp_reference_logprobs(cfg: Qwen3Config, w, seqs, tp: int) -> torch.Tensor:
    """The single-process reference of TP ``tp``: the local trainer with each row-parallel linear
    (attention output projection, MLP down projection) computed as Megatron's ranks compute it — one rlk
    GEMM per rank on its contiguous K slice (rank r's heads / intermediate columns) — and the partial sums
    reduced by ``rlk_collectives.reduce_reference`` (the single-process specification of the rlk
    all-reduce). Every other op is per output element or per token, so TP does not change it."""
    from rlk_collectives import reduce_reference
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model.ops import Ops

    row_parallel = {"attention": (cfg.hidden_size, cfg.q_size), "ffn": (cfg.hidden_size, cfg.intermediate_size)}
    others = {(cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), (2 * cfg.intermediate_size, cfg.hidden_size)}
    if others & set(row_parallel.values()):
        raise ValueError("this config's column- and row-parallel weights have one shape; the reference cannot "
                         "tell them apart")

    class TPOps(Ops):
        def linear(self, module, x, weight):
            if tuple(weight.shape) != row_parallel.get(module):
                return super().linear(module, x, weight)
            k = weight.shape[1] // tp
            return reduce_reference([super(TPOps, self).linear(module, x[..., r * k:(r + 1) * k].contiguous(),
                                                                weight[:, r * k:(r + 1) * k].contiguous())
                                     for r in range(tp)])

    plan = RoutePlan.preset("consistency")
    ops = TPOps(plan, "train", ReadbackRecorder("local", "train", plan, mode="strict"))
    tr = Trainer(cfg, w, ops, device=torch.device("cpu"), dtype=torch.float32, temperature=TEMPERATURE)
    with torch.no_grad():
        return tr.forward_logprobs(seqs)


def transformer_config(cfg: Qwen3Config, tp: int, cp: int, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
              num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
              kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm",
              layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False, qk_layernorm=True, use_cpu_initialization=True, params_dtype=torch.float32,
              hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp, context_parallel_size=cp,
              bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
              gradient_accumulation_fusion=False, persist_layer_norm=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


def slime_args(cfg: Qwen3Config, **overrides):
    """The Megatron/slime launch arguments slime's model builder reads, for this model."""
    kw = dict(padded_vocab_size=cfg.vocab_size, max_position_embeddings=cfg.max_position_embeddings,
              rotary_base=int(cfg.rope_theta), untie_embeddings_and_output_weights=not cfg.tie_word_embeddings,
              position_embedding_type="rope", rotary_percent=1.0, use_rope_scaling=False,
              fp16_lm_cross_entropy=False, transformer_impl="local", qk_layernorm=True, num_experts=None,
              moe_grouped_gemm=False, multi_latent_attention=False, moe_use_legacy_grouped_gemm=False,
              mtp_num_layers=None, fp8_param_gather=False)
    kw.update(overrides)
    return types.SimpleNamespace(**kw)


def build_megatron(cfg: Qwen3Config, tp: int, cp: int, via: str = "block_spec", **overrides):
    """The GPTModel with the provider's spec for the plan in the environment, weights not yet loaded
    (``via="slime_spec"``: built as slime's ``--spec rlk_megatron_provider slime_spec`` builds it;
    ``via="hybrid"``: megatron-core 0.19's HybridModel, pattern ``"*-"`` per Qwen3 layer, on the provider's
    :func:`~rlk_megatron_provider.hybrid_stack_spec`)."""
    from megatron.core.models.gpt import GPTModel

    import rlk_megatron_provider as prov

    if via == "hybrid":
        return _build_hybrid(cfg, tp, cp, **overrides)
    tcfg = transformer_config(cfg, tp, cp, **overrides)
    if via == "slime_spec":
        from rlk_megatron_provider import spec as spec_mod

        provider = prov.slime_spec(slime_args(cfg), tcfg, None)
        model = provider(pre_process=True, post_process=True, vp_stage=None)
        return model, spec_mod.verify_model(model)
    spec = prov.block_spec(tcfg, rope_theta=cfg.rope_theta)
    model = GPTModel(tcfg, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                     max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                     rotary_base=int(cfg.rope_theta), share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                     pre_process=True, post_process=True, parallel_output=True)
    counts = prov.prepare_model(model)
    return model, counts


def _build_hybrid(cfg: Qwen3Config, tp: int, cp: int, **overrides):
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    import rlk_megatron_provider as prov

    pattern = "*-" * cfg.num_hidden_layers  # a dense GPT block is two hybrid layers (attention, MLP)
    tcfg = transformer_config(cfg, tp, cp, num_layers=len(pattern), **overrides)
    stack = prov.hybrid_stack_spec(tcfg, rope_theta=cfg.rope_theta)
    model = HybridModel(tcfg, hybrid_stack_spec=stack, vocab_size=cfg.vocab_size,
                        max_sequence_length=cfg.max_position_embeddings, hybrid_layer_pattern=pattern,
                        position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
                        share_embeddings_and_output_weights=cfg.tie_word_embeddings, pre_process=True,
                        post_process=True, parallel_output=True)
    return model, prov.prepare_model(model)


def gpt_to_hybrid_keys(sd: dict) -> dict:
    """GPTModel state-dict keys -> the ``"*-"``-pattern HybridModel's (the migration guide's pairing: GPT
    layer i's attention -> hybrid layer 2i, its MLP -> 2i+1; ``final_layernorm`` -> ``final_norm``)."""
    out = {}
    for k, v in sd.items():
        parts = k.split(".")
        if k.startswith("decoder.layers."):
            i, rest = int(parts[2]), parts[3:]
            j = 2 * i + (0 if rest[0] in ("input_layernorm", "self_attention") else 1)
            k = ".".join(["decoder", "layers", str(j), *rest])
        elif k.startswith("decoder.final_layernorm."):
            k = k.replace("decoder.final_layernorm.", "decoder.final_norm.")
        out[k] = v
    return out


def load(model, cfg, w, tp: int, rank: int) -> None:
    from rlk_megatron_provider.weights import to_megatron

    sd = to_megatron(cfg, w, tp, rank)
    if getattr(model.decoder, "layer_type_list", None) is not None:  # HybridModel
        sd = gpt_to_hybrid_keys(sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise AssertionError(f"state dict mismatch: missing {missing}, unexpected {unexpected}")


def run_megatron(spec: dict) -> dict:
    """One rank's part of a worker run (see ``_worker.py``); returns what rank 0 saves."""
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams

    import rlk_collectives
    from rlk_megatron_provider import _state, logp

    tp, cp = spec["tp"], spec["cp"]
    cfg = config(spec["tied"], **spec.get("model", {}))
    w = weights(cfg)
    seqs = sequences(spec["lengths"], cfg.vocab_size)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    cp_group = parallel_state.get_context_parallel_group()
    tp_rank, cp_rank = tp_group.rank(), cp_group.rank()
    sp = bool(spec.get("sequence_parallel")) and tp > 1
    model, counts = build_megatron(cfg, tp, cp, via=spec.get("via", "block_spec"),
                                   **({"sequence_parallel": True} if sp else {}))
    load(model, cfg, w, tp, tp_rank)
    captured = {}

    def grab(mod, args, kwargs, output):
        captured["hidden"] = args[0]
        captured["weight"] = kwargs.get("weight") if kwargs.get("weight") is not None else mod.weight

    model.output_layer.register_forward_hook(grab, with_kwargs=True)
    ids = torch.tensor([t for s in seqs for t in s[:-1]])
    target = torch.tensor([t for s in seqs for t in s[1:]])
    lens = [len(s) - 1 for s in seqs]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    if spec["layout"] == "thd":
        layout = rlk_collectives.ZigzagLayout.build(cu, cp)
        ids_l, tgt_l = (layout.shard(x, cp_rank) if cp > 1 else x for x in (ids, target))
        cu_t = torch.tensor(cu, dtype=torch.int32)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t, max_seqlen_q=max(lens),
                              max_seqlen_kv=max(lens), cp_group=cp_group if cp > 1 else None)
        pos = torch.zeros_like(ids_l)[None]  # unused by the rlk attention (RoPE positions come from cu_seqlens)

        def forward():
            return model(ids_l[None], pos, None, packed_seq_params=psp)
    else:  # sbhd: equal lengths, a batch of rows
        b, s = len(seqs), lens[0]
        ids_l, tgt_l = ids, target
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)[None, None].expand(b, 1, s, s)

        def forward():
            return model(ids.reshape(b, s), torch.arange(s)[None].expand(b, s), mask)
    if spec.get("repeat"):  # a first forward in the same processes: the second must give the same bits
        with torch.no_grad():
            forward()
        first = captured["hidden"].transpose(0, 1).reshape(-1, cfg.hidden_size).clone()
    logits = forward()
    hidden = captured["hidden"]
    if sp:  # the final norm's rows are the rank's tokens: all-gathered (exact) for the replicated log-probs
        hidden = _GatherTokens.apply(hidden, tp_group)
    hidden = hidden.transpose(0, 1).reshape(-1, cfg.hidden_size)  # [b*s, H] row-major like ids
    out = {"counts": counts}
    if _state.get().rlk("logp"):
        lp = logp.vocab_parallel_logprobs(hidden, captured["weight"], tgt_l, TEMPERATURE, tp_group)
        with torch.no_grad():
            lp_nograd = logp.vocab_parallel_logprobs(hidden, captured["weight"], tgt_l, TEMPERATURE, tp_group)
            lp_logits = logp.vocab_parallel_logprobs_from_logits(
                logits.reshape(-1, logits.shape[-1]) / TEMPERATURE, tgt_l, 1.0, tp_group)
        from rlk_core.ops import linear_logprobs

        vocab = torch.cat(_all_gather_list(captured["weight"].detach(), tp_group))
        out["logp_gathered_vocab"] = _gather_cp(linear_logprobs(hidden.detach(), vocab, tgt_l, TEMPERATURE)[0],
                                                cu, cp, cp_group)
        out["logp_nograd"], out["logp_logits"] = (_gather_cp(x, cu, cp, cp_group) for x in (lp_nograd, lp_logits))
        with torch.no_grad():  # VIME's provider ABI: hidden states + this rank's vocab shard and partition
            v_local = captured["weight"].shape[0]
            req = types.SimpleNamespace(
                targets=tgt_l, tp_group=tp_group if tp > 1 else None, token_layout="zigzag" if cp > 1 else "single",
                temperature=TEMPERATURE, context=types.SimpleNamespace(
                    hidden=hidden, projection=captured["weight"], local_logits=None,
                    vocab_partition=(tp_rank * v_local, (tp_rank + 1) * v_local)))
            out["logp_vime"] = _gather_cp(logp.linear_logp(req).logp, cu, cp, cp_group)
            # processed log-probs (rlk.logp.processed.v1): this side's kept sets (rank's logits gathered), then the
            # partials with the threshold; the reference: the processed op on the gathered vocabulary
            from rlk_core.ops import kept_set, linear
            from rlk_core.ops.kept_set import kept_mask

            kept = logp.kept_sets(hidden, captured["weight"], TEMPERATURE, 8, 0.9, 0.0, tp_group, rows_per_chunk=5)
            full_kept = kept_set(linear(hidden.detach(), vocab), TEMPERATURE, 8, 0.9)
            out["kept_equal_here"] = bool(torch.equal(kept.value, full_kept.value)
                                          and torch.equal(kept.token_id, full_kept.token_id))
            pair = (kept.value, kept.token_id)
            # targets in the kept sets (a row's first token in the order: the lowest id of its largest logit) but
            # the sampled ones' every other row, whose log-prob is -inf where they fall outside
            tgt_p = linear(hidden.detach(), vocab).argmax(-1)
            tgt_p[1::2] = tgt_l[1::2]
            req.targets = tgt_p
            out["logp_processed"] = _gather_cp(logp.vocab_parallel_logprobs(
                hidden, captured["weight"], tgt_p, TEMPERATURE, tp_group, kept=pair), cu, cp, cp_group)
            out["logp_processed_gathered_vocab"] = _gather_cp(linear_logprobs(
                hidden.detach(), vocab, tgt_p, TEMPERATURE, kept=pair)[0], cu, cp, cp_group)
            out["logp_unfiltered_same_targets"] = _gather_cp(logp.vocab_parallel_logprobs(
                hidden, captured["weight"], tgt_p, TEMPERATURE, tp_group), cu, cp, cp_group)
            local_logits = linear(hidden.detach(), captured["weight"].detach())
            mask = kept_mask(local_logits, TEMPERATURE, pair, tp_rank * v_local)
            req.log_prob_keep_mask = mask  # VIME's top-p replay: the mask form, this rank's columns
            out["logp_vime_keep_mask"] = _gather_cp(logp.linear_logp(req).logp, cu, cp, cp_group)
            req.log_prob_keep_mask, req.metadata = None, {"rlk_kept": pair}
            out["logp_vime_kept"] = _gather_cp(logp.linear_logp(req).logp, cu, cp, cp_group)
            # entropy (rlk.entropy.v1) through VIME's provider: threshold form, mask form, unfiltered; the
            # reference: the op on the gathered vocabulary's logits
            from rlk_core.ops import entropy

            full_logits = linear(hidden.detach(), vocab)
            req.with_entropy = True
            out["entropy_vime_kept"] = _gather_cp(logp.linear_logp(req).entropy, cu, cp, cp_group)
            req.metadata, req.log_prob_keep_mask = None, mask
            out["entropy_vime_keep_mask"] = _gather_cp(logp.linear_logp(req).entropy, cu, cp, cp_group)
            req.log_prob_keep_mask = None
            out["entropy_vime"] = _gather_cp(logp.linear_logp(req).entropy, cu, cp, cp_group)
            req.with_entropy = False
            out["entropy_processed_gathered_vocab"] = _gather_cp(
                entropy(full_logits, TEMPERATURE, kept=pair)[0], cu, cp, cp_group)
            out["entropy_gathered_vocab"] = _gather_cp(entropy(full_logits, TEMPERATURE)[0], cu, cp, cp_group)
        if spec.get("repeat"):
            with torch.no_grad():
                lp_first = logp.vocab_parallel_logprobs(first, captured["weight"], tgt_l, TEMPERATURE, tp_group)
            out["logp_repeat"] = _gather_cp(lp_first, cu, cp, cp_group)
            out["repeat_equal_here"] = torch.equal(lp_first, lp_nograd)
    else:  # production: Megatron's own logits and torch.log_softmax on the gathered vocabulary
        full = torch.cat(_all_gather_list(logits.reshape(-1, logits.shape[-1]).detach(), tp_group), dim=-1)
        lp = torch.log_softmax(full.float() / TEMPERATURE, -1).gather(-1, tgt_l[:, None])[:, 0]
    out["logp"] = _gather_cp(lp.detach(), cu, cp, cp_group)
    if spec.get("backward"):
        lp.sum().backward()
        if spec.get("finalize") and tp > 1:  # Megatron's TP sum of the q/k-norm (and SP norm) grads, as training does
            _finalize_tp_grads(model, tp_group)
        out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if spec.get("all_grads"):  # every TP rank's grads (CP rank 0's), in TP rank order
            import torch.distributed as dist

            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, (cp_rank, tp_rank, out["grads"]))
            out["tp_grads"] = [g for _, _, g in sorted(e for e in every if e[0] == 0)]
    out["readback"] = _state.get().recorder.to_dict()
    if spec.get("all_readbacks"):  # every rank's readback, by global rank, with its (TP, CP) coordinates
        import torch.distributed as dist

        mine = {"tp_rank": tp_rank, "cp_rank": cp_rank, "readback": out["readback"],
                "repeat_equal": out.get("repeat_equal_here")}
        out["readbacks"] = [None] * dist.get_world_size()
        dist.all_gather_object(out["readbacks"], mine)
    return out


class _GatherTokens(torch.autograd.Function):
    """Sequence parallelism's rows all-gathered over the TP ranks (dim 0, exact); backward: this rank's rows (every
    rank computes the same log-probs from the gathered rows)."""

    @staticmethod
    def forward(ctx, x, group):
        import rlk_collectives

        ctx.rank, ctx.rows = group.rank(), x.shape[0]
        return rlk_collectives.all_gather(x.detach(), group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return grad.narrow(0, ctx.rank * ctx.rows, ctx.rows).contiguous(), None


def _finalize_tp_grads(model, tp_group) -> None:
    """megatron-core's own TP all-reduce of the gradients of parameters that are not TP-split but see only the
    rank's part of the data (q/k layernorms over the rank's heads; norms under sequence parallelism):
    ``finalize_model_grads``' ``_allreduce_non_tensor_model_parallel_grads`` (it reads ``param.grad`` where no
    ``main_grad`` exists, and the chunk's ``ddp_config``)."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads

    model.ddp_config = DistributedDataParallelConfig()
    _allreduce_non_tensor_model_parallel_grads([model], model.config, tp_group)


def _all_gather_list(x, group):
    import torch.distributed as dist

    if group.size() == 1:
        return [x]
    parts = [torch.empty_like(x) for _ in range(group.size())]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _gather_cp(x, cu, cp, group):
    """Global packed order from zigzag CP shards (exact data movement)."""
    if cp == 1:
        return x
    import rlk_collectives

    layout = rlk_collectives.ZigzagLayout.build(cu, cp)
    return rlk_collectives.cp_all_gather(x.contiguous(), layout, group)


# -- single-process workers (one gloo rank, TP 1) ----------------------------------------------------------
@contextlib.contextmanager
def single_rank(port: int):
    """The CPU recipe, a gloo world of one rank and Megatron's model-parallel state at TP 1, torn down after."""
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    torch.set_num_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _cpu import cpu_recipe

    cpu_recipe()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def run_worker(script: str, base_port: int, env: dict[str, str], timeout: float = 120) -> dict:
    """Run ``script PORT`` (a file beside this one) in a fresh process with ``env`` added; its last stdout
    line, parsed as JSON."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    proc = subprocess.run([sys.executable, path, str(base_port + os.getpid() % 250)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
