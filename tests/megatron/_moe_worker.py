"""Worker of ``test_moe_layer.py``: a real megatron-core Qwen3-MoE ``GPTModel`` on CPU (gloo), one process per
(TP, EP) rank.

``python _moe_worker.py SPEC_JSON OUT_PATH``: spawns ``tp * ep`` ranks; each applies the CPU recipe (``_cpu.py``),
initialises Megatron's parallel state at TP ``tp`` (default 1) and EP ``ep``, builds the model from the local MoE
layer spec through the provider (the plan in SPEC's env), loads the converted weights (its local experts,
``GroupedMLP`` layout, whole on every TP rank), runs its data-parallel rank's packed sequences (``lengths[dp_rank]``)
forward, the rlk log-probs from the hidden states, and one backward of their sum (then again for each of SPEC's
``variants``: overrides of the model — ``model`` — of the batch or of the dispatcher); rank 0 writes every rank's
log-probs, gradients and expert choices (``torch.save``) to OUT_PATH."""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TEMPERATURE = 0.7


def model_config(spec: dict):
    from rlk_repro.model.config import PRESETS

    return PRESETS["qwen3-moe-tiny"].with_overrides(max_position_embeddings=64, **spec.get("model", {}))


def run(rank: int, spec: dict, port: int, out: str) -> None:
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    os.environ.update(spec["env"])
    torch.set_num_threads(1)
    from _cpu import cpu_recipe

    cpu_recipe()
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    ep, tp = spec["ep"], spec.get("tp", 1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ep * tp)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        torch.manual_seed(0)
        mine = one_rank(spec, rank)
        if spec.get("aux_too"):  # the same model with the aux / z losses on, in the same processes
            mine["aux"] = one_rank({**spec, "aux": 0.5, "z": 0.5}, rank)
        # other models / dispatchers in the same processes (a process start costs more than a run)
        mine["variants"] = {name: one_rank({**spec, **v}, rank) for name, v in spec.get("variants", {}).items()}
        every = [None] * (ep * tp)
        dist.all_gather_object(every, mine)
        if rank == 0:
            torch.save(every, out)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def one_rank(spec: dict, rank: int) -> dict:
    import _model
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import PackedSeqParams

    import rlk_megatron_provider as prov
    from rlk_megatron_provider import _state, logp
    from rlk_megatron_provider.weights import to_megatron
    from rlk_repro.model.weights import random_weights

    cfg, ep, tp = model_config(spec), spec["ep"], spec.get("tp", 1)
    tp_rank, ep_rank = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_expert_model_parallel_rank()
    dp_rank = parallel_state.get_data_parallel_rank()  # whose sequences (the TP ranks of one DP rank share them)
    stock = spec.get("stock_router_without_te", False)
    if stock:  # test-only: megatron-core 0.16.1's router GEMM names te_general_gemm, undefined without TE
        from megatron.core.transformer.moe import moe_utils

        moe_utils.te_general_gemm = None
    w = random_weights(cfg, 3)
    tcfg = _model.transformer_config(
        cfg, tp, 1, num_moe_experts=cfg.num_experts, moe_router_topk=cfg.num_experts_per_tok,
        moe_ffn_hidden_size=cfg.moe_intermediate_size, moe_router_pre_softmax=not cfg.norm_topk_prob,
        moe_token_dispatcher_type=spec.get("dispatcher", "allgather"), expert_model_parallel_size=ep,
        expert_tensor_parallel_size=1,
        moe_aux_loss_coeff=spec.get("aux", 0.0), moe_z_loss_coeff=spec.get("z") or None)
    base = get_gpt_layer_local_spec(num_experts=cfg.num_experts, moe_grouped_gemm=False, qk_layernorm=True,
                                    normalization="RMSNorm")
    model = GPTModel(tcfg, transformer_layer_spec=prov.block_spec(tcfg, rope_theta=cfg.rope_theta, base=base),
                     vocab_size=cfg.vocab_size, max_sequence_length=cfg.max_position_embeddings,
                     position_embedding_type="rope", rotary_base=int(cfg.rope_theta), pre_process=True,
                     post_process=True, parallel_output=True)
    counts = prov.prepare_model(model)
    sd = to_megatron(cfg, w, tp, tp_rank, ep=ep, ep_rank=ep_rank, experts="sequential" if stock else "grouped")
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    assert not missing and not unexpected, (missing, unexpected)
    captured = {}

    def grab(mod, args, kwargs, output):
        captured["hidden"], captured["weight"] = args[0], mod.weight

    model.output_layer.register_forward_hook(grab, with_kwargs=True)
    # one global batch (the same sequences at every EP size), this rank's part of it
    flat = [n for part in spec["lengths"] for n in part]
    start = sum(len(part) for part in spec["lengths"][:dp_rank])
    seqs = _model.sequences(flat, cfg.vocab_size, seed=11)[start:start + len(spec["lengths"][dp_rank])]
    ids = torch.tensor([t for s in seqs for t in s[:-1]])
    target = torch.tensor([t for s in seqs for t in s[1:]])
    lens = [len(s) - 1 for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                          max_seqlen_kv=max(lens))
    model(ids[None], torch.zeros_like(ids)[None], None, packed_seq_params=psp)
    hidden = captured["hidden"].transpose(0, 1).reshape(-1, cfg.hidden_size)
    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    lp = logp.vocab_parallel_logprobs(hidden, captured["weight"], target, TEMPERATURE, group)
    lp.sum().backward()
    layers = model.decoder.layers
    return {"counts": counts, "logp": lp.detach(), "seqs": seqs,
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "ids": [getattr(layer.mlp, "last_ids", None) for layer in layers],
            "local_experts": list(layers[0].mlp.local_expert_indices),
            "classes": [type(m).__name__ for m in (layers[0].mlp, layers[0].mlp.router, layers[0].mlp.experts)],
            "readback": _state.get().recorder.to_dict()}


def main() -> None:
    spec = json.loads(sys.argv[1])
    mp.set_forkserver_preload(["torch", "megatron.core", "megatron.core.models.gpt"])
    mp.start_processes(run, args=(spec, int(spec["port"]), sys.argv[2]), nprocs=spec["ep"] * spec.get("tp", 1),
                       start_method="forkserver")


if __name__ == "__main__":
    main()
