#!/usr/bin/env python3
"""rlk-megatron-provider inside real megatron-core on one GPU: bitwise checks + step-time benchmark.

One command, one process, a torch.distributed world of 1 (NCCL on the GPU, gloo with ``--device cpu``):

1. ``lockstep``: a Qwen3-0.6B-shaped ``GPTModel`` built with the rlk layer spec (every module R, strict)
   and rlk-repro's local trainer start from the same weights (the provider's converter) and train in
   lockstep on a packed THD batch with the same GRPO loss, AdamW and lr. Every step: the per-token
   log-probs (fp32) of both sides must be ``torch.equal``; the Megatron gradients of the same step run
   twice from the same state must be identical; the local trainer, rebuilt on Megatron's current weights,
   must give the same log-probs (forward equality on trained weights, independent of gradient agreement);
   the gradients of both sides are compared per tensor (reported; a known gap, docs/megatron.md).
2. ``negative_control``: the stock local spec (all P) on the same weights differs from the local trainer.
3. ``timing_<shape>``: a training step (forward + backward + AdamW) of the rlk model vs the stock model,
   16 x 256 tokens (4096 packed; THD for rlk, sbhd for the stock spec, whose local attention refuses THD),
   CUDA events, median after warm-up; then, per model, one step under torch's sync debug mode (the host
   syncs, each with the Python line that made it; on the batch in new tensors, as a training loop's next
   batch) and two under ``torch.profiler`` (kernels launched and
   their device time, CUDA synchronize calls, copies per step: :func:`device_profile`); the 1.7B shape if
   the time budget allows. On the CPU the host syncs are ``rlk_megatron_provider.opcount.SyncCounter``'s
   model of the GPU run.
4. ``logp_memory``: the rlk logp module's peak memory (hidden states + LM head -> log-probs, forward and
   backward) vs the P path's materialised logits + log_softmax.

Writes ``megatron_gpu.json`` (rewritten after every stage) and ``megatron_gpu.md`` to ``--out``; exits 1
if a bitwise check failed or a stage holding one did not finish. ``--device cpu --tiny`` runs the whole
flow on a 2-layer model on CPU (fp32, gloo) in seconds. ``--hybrid`` (megatron-core >= 0.19) runs stages 1-4
on ``HybridModel`` (pattern ``"*-"`` per Qwen3 layer) instead of ``GPTModel``, the stock side on Megatron's local
layers as a HybridStack (``spec.local_hybrid_stack_spec``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import warnings

R_ENV = {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
         "RL_KERNEL_MODE": "strict"}
SHAPES = {
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "qwen3-1.7b": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128),
    "tiny": dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
TEMPERATURE = 0.7
LR = 3e-4
CLIP = 0.2
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[megatron_gpu {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# -- report ----------------------------------------------------------------------------------------------
class Report:
    def __init__(self, out: str, meta: dict, name: str = "megatron_gpu") -> None:
        self.out, self.name, self.data = out, name, {"meta": meta, "stages": {}, "checks": []}
        os.makedirs(out, exist_ok=True)

    def check(self, name: str, passed: bool, bitwise: bool = True, **numbers) -> bool:
        self.data["checks"].append({"name": name, "pass": bool(passed), "bitwise": bitwise, **numbers})
        log(f"check {name}: {'PASS' if passed else 'FAIL'} {numbers if numbers else ''}")
        return passed

    @contextlib.contextmanager
    def stage(self, name: str, required: bool = True):
        log(f"stage {name} ...")
        rec = self.data["stages"][name] = {"status": "running", "required": required}
        t = time.monotonic()
        try:
            yield rec
            rec["status"] = "ok"
        except Exception as exc:  # one stage failing must let the others report
            rec["status"] = "error"
            rec["error"] = f"{type(exc).__name__}: {exc}"[:4000]
            rec["traceback"] = traceback.format_exc()[-6000:]
            log(f"stage {name} FAILED: {rec['error'][:600]}")
        finally:
            rec["seconds"] = round(time.monotonic() - t, 2)
            self.write()
            _free()

    def skip(self, name: str, why: str) -> None:
        self.data["stages"][name] = {"status": "skipped", "reason": why, "required": False}
        log(f"stage {name} skipped: {why}")

    def failed(self) -> list[str]:
        bad = [c["name"] for c in self.data["checks"] if c["bitwise"] and not c["pass"]]
        bad += [f"stage {n}: {s['status']}" for n, s in self.data["stages"].items()
                if s.get("required") and s["status"] != "ok"]
        return bad

    def write(self) -> None:
        self.data["meta"]["elapsed_s"] = round(time.monotonic() - T0, 1)
        self.data["failed"] = self.failed()
        path = os.path.join(self.out, f"{self.name}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(self.data, f, indent=1, default=str)
        os.replace(path + ".tmp", path)

    def markdown(self) -> str:
        m = self.data["meta"]
        lines = [f"# rlk-megatron-provider ({m.get('model', 'GPTModel')}) on {m.get('gpu', m['device'])}",
                 "", f"megatron-core {m.get('megatron_core')}, torch {m.get('torch')}, commit "
                 f"{m.get('commit')}, {m['elapsed_s']} s", "", "| check | result | numbers |", "| --- | --- | --- |"]
        for c in self.data["checks"]:
            nums = {k: v for k, v in c.items() if k not in ("name", "pass", "bitwise")}
            tag = "PASS" if c["pass"] else ("FAIL" if c["bitwise"] else "differs (info)")
            lines.append(f"| {c['name']} | {tag} | {json.dumps(nums, default=str)[:300]} |")
        lines += ["", "| stage | status | s |", "| --- | --- | --- |"]
        for n, s in self.data["stages"].items():
            why = ": " + s.get("error", s.get("reason", ""))[:200] if s["status"] != "ok" else ""
            lines.append(f"| {n} | {s['status']}{why} | {s.get('seconds', '')} |")
        t = self.data.get("timing", {})
        if t:
            lines += ["",
                      "| shape | rlk step ms (median) | stock step ms | rlk / stock speed | rlk peak GiB "
                      "| stock peak GiB |",
                      "| --- | --- | --- | --- | --- | --- |"]
            for shape, v in t.items():
                r, p = v.get("rlk", {}), v.get("stock", {})
                lines.append(f"| {shape} | {r.get('median_ms')} | {p.get('median_ms')} | {v.get('speed_ratio')} | "
                             f"{r.get('peak_gib')} | {p.get('peak_gib')} |")
            lines += ["", "| shape | model | wall ms | kernel ms | kernels | launch calls | host syncs | "
                          "cudaStreamSynchronize | DtoH copies | HtoD copies |",
                      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
            for shape, v in t.items():
                for name in ("rlk", "stock"):
                    r = v.get(name, {})
                    pr = r.get("profile", {})
                    lines.append(f"| {shape} | {name} | {r.get('median_wall_ms')} | {pr.get('kernel_ms_per_step')} | "
                                 f"{pr.get('kernels_per_step')} | {pr.get('launch_calls_per_step')} | "
                                 f"{r.get('host_syncs', {}).get('per_step')} | "
                                 f"{pr.get('cuda_stream_synchronize_per_step')} | {pr.get('memcpy_dtoh_per_step')} | "
                                 f"{pr.get('memcpy_htod_per_step')} |")
        mem = self.data.get("logp_memory")
        if mem:
            lines += ["", f"logp module peak (fwd+bwd, T={mem['tokens']}, V={mem['vocab']}): rlk "
                      f"{mem['rlk_extra_mib']} MiB over inputs+grads vs P logits path {mem['p_extra_mib']} MiB "
                      f"(T x 256 x 4 B = {mem['t_x_256_fp32_mib']} MiB)"]
        return "\n".join(lines) + "\n"


def _free() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


# -- environment -----------------------------------------------------------------------------------------
def init_world(device: str, tp: int = 1, cp: int = 1) -> None:
    """A world of 1 (this process), or torchrun's world (``WORLD_SIZE`` = tp x cp) with ``--tp`` / ``--cp``."""
    import datetime

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    port = int(os.environ.get("RLK_BENCH_PORT", 29000 + os.getpid() % 1000))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != tp * cp:
        raise RuntimeError(f"WORLD_SIZE={world} but --tp {tp} x --cp {cp} = {tp * cp}: run under torchrun "
                           f"--nproc-per-node {tp * cp}")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl"
    else:
        from rlk_megatron_provider.testing import cpu_recipe

        cpu_recipe()
        backend = "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("RLK_BENCH_COLLECTIVE_TIMEOUT_S", "600")))
    if world > 1:  # torchrun's rendezvous variables; a rank stuck in a collective errors after the timeout
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                                timeout=timeout)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                             context_parallel_size=cp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    torch.manual_seed(0)


def meta(args) -> dict:
    import torch

    out = {"device": args.device, "python": platform.python_version(), "torch": torch.__version__,
           "commit": os.environ.get("RLK_COMMIT", "unknown"), "argv": sys.argv, "temperature": TEMPERATURE,
           "lr": LR, "tiny": args.tiny, "model": "HybridModel" if args.hybrid else "GPTModel"}
    try:
        from rlk_megatron_provider import _compat

        out["megatron_core"] = _compat.version()
        out["megatron_supported"] = _compat.supported()
        out["mlp_slot_is_builder"] = _compat.MLP_IS_BUILDER
    except Exception as exc:
        out["megatron_core"] = f"import failed: {exc}"
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:
        out["triton"] = None
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
        out["cuda"] = torch.version.cuda
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
        except Exception as exc:
            out["driver"] = f"unknown ({exc})"
    return out


# -- models ----------------------------------------------------------------------------------------------
def qwen_cfg(shape: str):
    from rlk_repro.model.config import Qwen3Config

    return Qwen3Config(**SHAPES[shape], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
                       tie_word_embeddings=True, bos_token_id=None, eos_token_id=1)


def make_weights(cfg, dev, seed: int = 3) -> dict:
    """Random weights in rlk-repro's layout, fp32, on ``dev`` (the distribution of
    ``rlk_repro.model.weights.random_weights``, drawn on the device: fast for the large shapes)."""
    import torch

    from rlk_repro.model.weights import expected_shapes, random_weights

    if dev.type == "cpu":
        return random_weights(cfg, seed)
    g = torch.Generator(device=dev).manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape, device=dev)
        else:
            std = 0.5 / cfg.hidden_size**0.5 if name == "lm_head" else 0.02
            out[name] = torch.randn(shape, generator=g, device=dev) * std
    return out


def transformer_config(cfg, dev, dtype, tp: int = 1, cp: int = 1, **overrides):
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size,
              num_attention_heads=cfg.num_attention_heads, num_query_groups=cfg.num_key_value_heads,
              kv_channels=cfg.head_dim, ffn_hidden_size=cfg.intermediate_size, normalization="RMSNorm",
              layernorm_epsilon=cfg.rms_norm_eps, gated_linear_unit=True, activation_func=F.silu,
              add_bias_linear=False, qk_layernorm=True, hidden_dropout=0.0, attention_dropout=0.0,
              tensor_model_parallel_size=tp, context_parallel_size=cp, params_dtype=dtype,
              bf16=dtype == torch.bfloat16, use_cpu_initialization=dev.type == "cpu", perform_initialization=False,
              bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
              masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False)
    kw.update(overrides)
    return TransformerConfig(**kw)


# ``--hybrid``: megatron-core 0.19's HybridModel (pattern ``"*-"`` per Qwen3 layer) instead of GPTModel
HYBRID = False


def hybrid_available() -> bool:
    """Whether this megatron-core has ``megatron.core.models.hybrid`` (0.19+)."""
    from rlk_megatron_provider import _compat

    return _compat.hybrid() is not None


def to_hybrid_keys(sd: dict) -> dict:
    """GPTModel state-dict keys -> the ``"*-"``-pattern HybridModel's: GPT layer i's attention half ->
    hybrid layer 2i, its MLP half -> 2i+1; ``decoder.final_layernorm`` -> ``decoder.final_norm``."""
    out = {}
    for k, v in sd.items():
        if k.startswith("decoder.layers."):
            parts = k.split(".")
            i, rest = int(parts[2]), parts[3:]
            j = 2 * i + (0 if rest[0] in ("input_layernorm", "self_attention") else 1)
            k = ".".join(["decoder", "layers", str(j), *rest])
        elif k.startswith("decoder.final_layernorm."):
            k = "decoder.final_norm." + k[len("decoder.final_layernorm."):]
        out[k] = v
    return out


def to_gpt_keys(sd: dict) -> dict:
    """The inverse of :func:`to_hybrid_keys` (identity without ``--hybrid``): the provider's converter
    (``from_megatron``) reads GPTModel names."""
    if not HYBRID:
        return sd
    out = {}
    for k, v in sd.items():
        if k.startswith("decoder.layers."):
            parts = k.split(".")
            k = ".".join(["decoder", "layers", str(int(parts[2]) // 2), *parts[3:]])
        elif k.startswith("decoder.final_norm."):
            k = "decoder.final_layernorm." + k[len("decoder.final_norm."):]
        out[k] = v
    return out


def build_hybrid(cfg, dev, dtype, rlk: bool, tp: int = 1, cp: int = 1):
    """``HybridModel`` (pattern ``"*-" * L``, ``num_layers = 2 L``) on the provider's ``hybrid_stack_spec``,
    or (stock) on the provider's ``spec.local_hybrid_stack_spec()``: Megatron's local (no TE) layers
    arranged as a HybridStack. The stock ``HybridStack`` builds its final norm as ``TENorm``; without
    Transformer Engine that norm is pointed at Megatron's local torch norm (the provider's test stand-in,
    ``testing.hybrid_final_norm_without_te``); the rlk stack builds its own norm and needs none."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    import rlk_megatron_provider as prov
    from rlk_megatron_provider import spec as spec_mod

    pattern = "*-" * cfg.num_hidden_layers
    tc = transformer_config(cfg, dev, dtype, tp, cp, num_layers=len(pattern))
    if rlk:
        stack = prov.hybrid_stack_spec(tc, rope_theta=cfg.rope_theta)
    else:
        if not _have_te():
            from rlk_megatron_provider.testing import hybrid_final_norm_without_te

            hybrid_final_norm_without_te()
        stack = spec_mod.local_hybrid_stack_spec()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = HybridModel(tc, hybrid_stack_spec=stack, vocab_size=cfg.vocab_size,
                            max_sequence_length=cfg.max_position_embeddings, hybrid_layer_pattern=pattern,
                            position_embedding_type="rope", rotary_base=int(cfg.rope_theta),
                            share_embeddings_and_output_weights=cfg.tie_word_embeddings, pre_process=True,
                            post_process=True, parallel_output=True)
    counts = prov.prepare_model(model) if rlk else None
    model = model.to(device=dev, dtype=dtype)
    return model, counts


def _have_te() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


def build(cfg, dev, dtype, rlk: bool, tp: int = 1, cp: int = 1):
    """``GPTModel`` with the rlk layer spec (plan from RL_KERNEL_*) or Megatron's stock local spec
    (``HybridModel`` with ``--hybrid``, :func:`build_hybrid`)."""
    if HYBRID:
        return build_hybrid(cfg, dev, dtype, rlk, tp, cp)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import rlk_megatron_provider as prov

    tc = transformer_config(cfg, dev, dtype, tp, cp)
    spec = (prov.block_spec(tc, rope_theta=cfg.rope_theta) if rlk
            else get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(tc, transformer_layer_spec=spec, vocab_size=cfg.vocab_size,
                         max_sequence_length=cfg.max_position_embeddings, position_embedding_type="rope",
                         rotary_base=int(cfg.rope_theta), share_embeddings_and_output_weights=cfg.tie_word_embeddings,
                         pre_process=True, post_process=True, parallel_output=True)
    counts = prov.prepare_model(model) if rlk else None
    model = model.to(device=dev, dtype=dtype)  # what Float16Module does (RlkRMSNorm's fp32 weight included)
    return model, counts


def load(model, cfg, w, tp: int = 1, rank: int = 0) -> dict:
    """Load rlk-repro-layout fp32 weights (TP shard ``rank`` of ``tp``) through the provider's converter;
    returns the fp32 masters by parameter name."""
    from rlk_megatron_provider.weights import to_megatron

    sd = to_megatron(cfg, w, tp, rank)
    if HYBRID:
        sd = to_hybrid_keys(sd)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise AssertionError(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    names = [n for n, _ in model.named_parameters()]
    if set(names) - set(sd):
        raise AssertionError(f"parameters without a converted weight: {sorted(set(names) - set(sd))[:8]}")
    return {n: sd[n] for n in names}


def hidden_head(model) -> dict:
    """Make ``output_layer`` hand back its input (the final-normed hidden states) instead of logits, and
    keep the LM-head weight it was given: the rlk logp module then runs from hidden states, never from
    [T, V] logits (VIME's provider path)."""
    layer, box = model.output_layer, {}

    def forward(input_, weight=None, runtime_gather_output=None):
        box["hidden"], box["weight"] = input_, (layer.weight if weight is None else weight)
        return input_, None

    layer.forward = forward
    return box


# -- batches ---------------------------------------------------------------------------------------------
class Batch:
    """Sequences (prompt + response), GRPO advantages, and the packed / padded-free tensors for both layouts."""

    def __init__(self, cfg, lengths: list[int], prompt: int, dev, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.seqs = [torch.randint(0, cfg.vocab_size, (n + 1,), generator=g).tolist() for n in lengths]
        self.prompt = prompt
        self.adv_per_seq = (torch.rand(len(lengths), generator=g) * 2 - 1).tolist()
        lens = [len(s) - 1 for s in self.seqs]
        self.lens, self.T = lens, sum(lens)
        self.ids = torch.tensor([t for s in self.seqs for t in s[:-1]], device=dev)
        self.target = torch.tensor([t for s in self.seqs for t in s[1:]], device=dev)
        self.pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
        self.cu = torch.tensor(cu, dtype=torch.int32, device=dev)
        rows, adv = [], []
        for i, n in enumerate(lens):
            rows.append(torch.arange(cu[i] + prompt - 1, cu[i] + n, device=dev))
            adv += [self.adv_per_seq[i]] * (n - prompt + 1)
        self.rows = torch.cat(rows)
        self.adv = torch.tensor(adv, device=dev, dtype=torch.float32)

    def samples(self):
        from rlk_repro.engine.trainer import Sample

        return [Sample(s[:self.prompt], s[self.prompt:], [], a) for s, a in zip(self.seqs, self.adv_per_seq)]

    def psp(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        m = max(self.lens)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=self.cu, cu_seqlens_kv=self.cu, max_seqlen_q=m,
                               max_seqlen_kv=m)


def grpo_loss(lp, adv):
    """The local trainer's loss (PPO-clip, token mean; ratio 1 at the behaviour policy)."""
    import torch

    ratio = torch.exp(lp - lp.detach())
    return -torch.minimum(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv).mean()


def rlk_logp(model, box, b: Batch, tp_group=None):
    """rlk model on the packed THD batch -> fp32 log-probs of the response rows (logp module: hidden
    states + LM head, ``rlk_megatron_provider.logp.vocab_parallel_logprobs``)."""
    from rlk_megatron_provider import logp

    model(b.ids[None], b.pos[None], None, packed_seq_params=b.psp())
    h = box["hidden"].reshape(-1, box["hidden"].shape[-1])  # THD: [T, 1, H]
    return logp.vocab_parallel_logprobs(h[b.rows], box["weight"], b.target[b.rows], TEMPERATURE, tp_group)


def stock_logp(model, b: Batch, tp_group=None):
    """Stock model (local spec: sbhd only) on equal-length rows -> fp32 log-probs from materialised
    logits (``log_softmax`` in fp32, the P path)."""
    import torch

    n, s = len(b.lens), b.lens[0]
    assert all(x == s for x in b.lens), "the stock local spec needs equal lengths (sbhd)"
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=b.ids.device), diagonal=1)[None, None]
    logits = model(b.ids.reshape(n, s), b.pos.reshape(n, s), mask.expand(n, 1, s, s))  # [b, s, V]
    flat = logits.reshape(-1, logits.shape[-1])[b.rows]
    if tp_group is not None and tp_group.size() > 1:  # vocab shards: Megatron's vocab-parallel loss
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return -vocab_parallel_cross_entropy(flat.float() / TEMPERATURE, b.target[b.rows])
    return torch.log_softmax(flat.float() / TEMPERATURE, -1).gather(-1, b.target[b.rows][:, None])[:, 0]


def local_trainer(cfg, w, dev, dtype):
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model.ops import Ops

    plan = RoutePlan.preset("consistency")
    ops = Ops(plan, "train", ReadbackRecorder("local", "train", plan, mode="strict"))
    return Trainer(cfg, w, ops, device=dev, dtype=dtype, temperature=TEMPERATURE, optimizer="adamw", lr=LR,
                   clip_eps=CLIP)


def grads_of(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def diff_names(a: dict, b: dict) -> list[str]:
    import torch

    return [k for k in a if k not in b or not torch.equal(a[k], b[k])]


def max_abs(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


# -- stages ----------------------------------------------------------------------------------------------
def stage_lockstep(rep: Report, rec: dict, cfg, dev, dtype, steps: int, lengths: list[int], prompt: int) -> None:
    import torch

    from rlk_megatron_provider import _state
    from rlk_megatron_provider.weights import from_megatron

    w = make_weights(cfg, dev)
    model, counts = build(cfg, dev, dtype, rlk=True)
    masters = load(model, cfg, w)
    rec["rlk_layer_counts"] = counts
    rec["model_class"] = type(model).__name__
    rec["layer_pattern"] = getattr(model, "hybrid_layer_pattern", None)
    box = hidden_head(model)
    from rlk_repro.engine.frameworks_megatron import MasterOptimizer

    opt = MasterOptimizer(model, masters, lr=LR, foreach=False)
    tr = local_trainer(cfg, w, dev, dtype)
    b = Batch(cfg, lengths, prompt, dev, seed=11)
    rec.update(tokens=b.T, sequences=len(lengths), response_tokens=int(b.rows.numel()), steps=steps)
    log(f"lockstep: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {b.T} packed tokens, "
        f"{len(lengths)} sequences; rlk counts {counts}")
    per_step = rec["per_step"] = []
    all_ok = {"logp": True, "grad_det": True, "synced": True}
    for step in range(steps + 1):  # the last iteration only checks the forward after the final update
        s = {"step": step}
        per_step.append(s)
        t = time.monotonic()
        runs = []
        for _ in range(2 if step < steps else 1):
            opt.zero_grad()
            lp = rlk_logp(model, box, b)
            if step < steps:
                grpo_loss(lp, b.adv).backward()
            runs.append((lp.detach().clone(), grads_of(model)))
        lp_m, g_m = runs[-1]
        if dev.type == "cuda":
            torch.cuda.synchronize()
        s["megatron_s"] = round(time.monotonic() - t, 2)
        # run to run: the same step twice from the same state
        if step < steps:
            bad = diff_names(runs[0][1], runs[1][1])
            ok = torch.equal(runs[0][0], runs[1][0]) and not bad
            all_ok["grad_det"] &= rep.check(f"lockstep.step{step}.megatron_grads_run_to_run", ok,
                                            tensors=len(runs[0][1]), differing=bad[:10])
        # lockstep: the local trainer's own state (its own updates so far)
        t = time.monotonic()
        if step < steps:
            res = tr.step(b.samples())
            lp_l = torch.cat(res.train_logprobs)
        else:
            with torch.no_grad():
                lp_l = tr.forward_logprobs(b.seqs, b.rows)
        s["local_s"] = round(time.monotonic() - t, 2)
        eq = torch.equal(lp_m, lp_l)
        # After the first update the two sides hold different weights: Megatron keeps QKV rows grouped per KV
        # head, so dX of the QKV projection sums over its rows in another order than the local trainer's
        # [q; k; v] (the forward is row-wise and unaffected). Bitwise at step 0 (same weights); afterwards
        # informational — the contract's claim (same weights -> same log-probs) is the next check.
        all_ok["logp"] &= rep.check(f"lockstep.step{step}.logp_equal_local_trainer", eq, bitwise=step == 0,
                                    max_abs_diff=max_abs(lp_m, lp_l), tokens=int(lp_m.numel()),
                                    mean_logp=float(lp_m.mean()))
        # forward on Megatron's current weights (local trainer rebuilt from them): bitwise whatever the grads did
        cur = from_megatron(cfg, [to_gpt_keys({n: m.detach() for n, m in opt.master.items()})])
        fresh = local_trainer(cfg, cur, dev, dtype)
        with torch.no_grad():
            lp_f = fresh.forward_logprobs(b.seqs, b.rows)
        del fresh, cur
        eq = torch.equal(lp_m, lp_f)
        all_ok["synced"] &= rep.check(f"lockstep.step{step}.logp_equal_local_on_megatron_weights", eq,
                                      max_abs_diff=max_abs(lp_m, lp_f))
        if step < steps:
            got = from_megatron(cfg, [to_gpt_keys({n: g.float() for n, g in g_m.items()})])
            ref = {k: v.grad for k, v in tr.master.items() if v.grad is not None}
            differ = [k for k in ref if not torch.equal(got[k], ref[k])]
            rep.check(f"lockstep.step{step}.grads_equal_local_trainer", not differ, bitwise=False,
                      tensors=len(ref), differing=len(differ), first_differing=differ[:6],
                      max_abs_diff=max((max_abs(got[k], ref[k]) for k in differ), default=0.0),
                      note="informational: known gap, see docs/megatron.md")
            before = {n: p.detach().clone() for n, p in list(opt.params.items())[:4]}
            opt.step()
            s["params_changed_sample"] = {n: int((p.detach() != before[n]).sum()) for n, p in
                                          list(opt.params.items())[:4]}
            s["loss"] = float(grpo_loss(lp_m, b.adv))
        log(f"lockstep step {step}: {s}")
    rec["all"] = all_ok
    rec["readback"] = _state.get().recorder.to_dict()
    del model, opt, tr, box


def stage_negative(rep: Report, rec: dict, cfg, dev, dtype, n: int, s: int) -> None:
    import torch

    w = make_weights(cfg, dev)
    b = Batch(cfg, [s] * n, 1, dev, seed=13)
    tr = local_trainer(cfg, w, dev, dtype)
    with torch.no_grad():
        ref = tr.forward_logprobs(b.seqs, b.rows)
    del tr
    model, _ = build(cfg, dev, dtype, rlk=False)
    load(model, cfg, w)
    with torch.no_grad():
        lp_p = stock_logp(model, b)
    del model
    rlk_model, _ = build(cfg, dev, dtype, rlk=True)
    load(rlk_model, cfg, w)
    box = hidden_head(rlk_model)
    with torch.no_grad():
        lp_r = rlk_logp(rlk_model, box, b)
    rec["tokens"] = int(ref.numel())
    rep.check("negative_control.stock_spec_differs_from_local_trainer", not torch.equal(lp_p, ref),
              max_abs_diff=max_abs(lp_p, ref), tokens=int(ref.numel()),
              differing_tokens=int((lp_p != ref).sum()))
    rep.check("negative_control.rlk_spec_equals_local_trainer_same_batch", torch.equal(lp_r, ref),
              max_abs_diff=max_abs(lp_r, ref))


def time_steps(cfg, dev, dtype, rlk: bool, w, n: int, s: int, warmup: int, iters: int, tp: int = 1,
               profile_steps: int = 2) -> dict:
    import torch
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group() if tp > 1 else None
    model, _ = build(cfg, dev, dtype, rlk=rlk, tp=tp)
    masters = load(model, cfg, w, tp, group.rank() if group is not None else 0)
    from rlk_repro.engine.frameworks_megatron import MasterOptimizer

    opt = MasterOptimizer(model, masters, lr=LR, foreach=True)
    del masters
    b = Batch(cfg, [s] * n, 1, dev, seed=17)
    box = hidden_head(model) if rlk else None
    cuda = dev.type == "cuda"

    def step(batch=b):
        opt.zero_grad()
        lp = rlk_logp(model, box, batch, group) if rlk else stock_logp(model, batch, group)
        grpo_loss(lp, batch.adv).backward()
        opt.step()

    t = time.monotonic()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    warm_s = time.monotonic() - t
    dev_ms, wall_ms = [], []
    for _ in range(iters):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            e0.record()
            step()
            e1.record()
            torch.cuda.synchronize()
            wall_ms.append((time.perf_counter() - w0) * 1e3)
            dev_ms.append(e0.elapsed_time(e1))
        else:
            w0 = time.perf_counter()
            step()
            wall_ms.append((time.perf_counter() - w0) * 1e3)
    out = {"tokens": b.T, "layout": "thd packed" if rlk else "sbhd (local spec refuses THD)",
           "warmup_s": round(warm_s, 2), "wall_ms": [round(x, 2) for x in wall_ms],
           "median_wall_ms": round(statistics.median(wall_ms), 2)}
    if cuda:
        out.update(events_ms=[round(x, 2) for x in dev_ms], median_ms=round(statistics.median(dev_ms), 2),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    else:
        out["median_ms"] = out["median_wall_ms"]
    fresh = copy.copy(b)  # the same values in new tensors, as a training loop's next batch: built again
    fresh.cu = b.cu.clone()
    out["host_syncs"] = host_syncs(lambda: step(fresh), cuda,
                                   [st["step"] for st in opt.opt.state.values() if "step" in st])
    if cuda and profile_steps:
        out["profile"] = device_profile(step, profile_steps)
    return out  # the model, optimizer and batch go with this frame


SYNC_WARNING = "called a synchronizing CUDA operation"
LAUNCH_APIS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def host_syncs(step, cuda: bool, host_tensors=()) -> dict:
    """The host syncs of one ``step()``: on CUDA, torch's sync debug mode (``warn``: one warning per
    synchronizing call — copies to and from the host, ``.item()``, ``nonzero`` ...; torch's list is not
    exhaustive, the profiler's synchronize counts are the cross-check), each charged to the Python line that
    made it; on the CPU, ``rlk_megatron_provider.opcount.SyncCounter``'s model of the GPU run (``host_tensors``:
    made before the step and on the host on the GPU too — the AdamW step counters)."""
    import collections

    import torch

    if not cuda:
        from rlk_megatron_provider.opcount import SyncCounter

        with SyncCounter().declare_host(*host_tensors) as c:
            step()
        gpu = c.gpu_path()
        return {"per_step": len(gpu), "method": "opcount.SyncCounter (CPU model of the GPU run)",
                "sites": dict(list(c.by_site(gpu).items())[:12]),
                "cpu_reference_only": len(c.syncs) - len(gpu)}
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    hits = [w for w in caught if SYNC_WARNING in str(w.message)]
    sites = collections.Counter(f"{_short_path(w.filename)}:{w.lineno}" for w in hits)
    return {"per_step": len(hits), "method": "torch.cuda.set_sync_debug_mode('warn')",
            "sites": dict(sites.most_common(12))}


def _short_path(path: str) -> str:
    """A source path from its package on (``site-packages/`` and the checkout's ``packages/*/src/`` off)."""
    for mark in ("site-packages/", "/src/"):
        if mark in path:
            return path.split(mark)[-1]
    return os.path.basename(path)


def device_profile(step, steps: int = 2) -> dict:
    """``torch.profiler`` over ``steps`` steps, per step: the kernels that ran and their summed device time
    (copies, memsets and user annotations such as ``Optimizer.step`` apart), the host's launch calls, the
    CUDA runtime's synchronising calls and the copies each way; the top kernels and host ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()  # one cudaDeviceSynchronize of its own, taken off below
    events = prof.key_averages()
    on_device = [e for e in events if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)]
    copies = [e for e in on_device if e.key.startswith(("Memcpy", "Memset"))]
    kernels = [e for e in on_device if not e.key.startswith(("Memcpy", "Memset"))]
    host = {e.key: e.count for e in events if e.device_type.name == "CPU"}

    def per(n) -> float:
        return round(n / steps, 1)

    return {
        "steps": steps,
        "kernels_per_step": per(sum(e.count for e in kernels)),
        "kernel_ms_per_step": round(sum(e.self_device_time_total for e in kernels) / steps / 1e3, 2),
        "launch_calls_per_step": per(sum(host.get(k, 0) for k in LAUNCH_APIS)),
        "cuda_stream_synchronize_per_step": per(host.get("cudaStreamSynchronize", 0)),
        "cuda_event_synchronize_per_step": per(host.get("cudaEventSynchronize", 0)),
        "cuda_device_synchronize_per_step": per(max(host.get("cudaDeviceSynchronize", 0) - 1, 0)),
        "memcpy_dtoh_per_step": per(sum(e.count for e in copies if "DtoH" in e.key)),
        "memcpy_htod_per_step": per(sum(e.count for e in copies if "HtoD" in e.key)),
        "top_kernels": [{"name": e.key[:100], "ms_per_step": round(e.self_device_time_total / 1e3 / steps, 3),
                         "calls_per_step": per(e.count)}
                        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]],
        "top_host_ops": [{"name": e.key[:100], "self_cpu_ms_per_step": round(e.self_cpu_time_total / 1e3 / steps, 3),
                          "calls_per_step": per(e.count)}
                         for e in sorted((e for e in events if e.device_type.name == "CPU"),
                                         key=lambda e: -e.self_cpu_time_total)[:8]],
    }


def stage_timing(rep: Report, rec: dict, shape: str, cfg, dev, dtype, n: int, s: int, warmup: int, iters: int,
                 tp: int = 1):
    w = make_weights(cfg, dev, seed=5)
    res = rep.data.setdefault("timing", {})[shape] = {}
    for name, rlk in (("rlk", True), ("stock", False)):
        _free()
        log(f"timing {shape} {name} ...")
        res[name] = time_steps(cfg, dev, dtype, rlk, w, n, s, warmup, iters, tp)
        r = res[name]
        log(f"timing {shape} {name}: median {r['median_ms']} ms (wall {r['median_wall_ms']}), host syncs "
            f"{r['host_syncs']['per_step']} {r['host_syncs']['sites']}, profile "
            f"{ {k: v for k, v in r.get('profile', {}).items() if not k.startswith('top_')} }")
        rep.write()
    r, p = res["rlk"]["median_ms"], res["stock"]["median_ms"]
    res["speed_ratio"] = round(p / r, 3)  # >= 0.9 asked: rlk step time at most ~1.11x stock
    rec.update(res)
    rep.check(f"timing.{shape}.rlk_vs_stock_speed_ge_0.9", res["speed_ratio"] >= 0.9, bitwise=False,
              speed_ratio=res["speed_ratio"], rlk_ms=r, stock_ms=p)


def stage_logp_memory(rep: Report, rec: dict, cfg, dev, dtype, tokens: int) -> None:
    import torch

    from rlk_megatron_provider import logp

    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(7)
    H, V = cfg.hidden_size, cfg.vocab_size
    hidden = (torch.randn(tokens, H, generator=g, device=dev)).to(dtype).requires_grad_(True)
    weight = (torch.randn(V, H, generator=g, device=dev) * (0.5 / H**0.5)).to(dtype).requires_grad_(True)
    target = torch.randint(0, V, (tokens,), generator=g, device=dev)
    grads_bytes = hidden.numel() * hidden.element_size() + weight.numel() * weight.element_size()

    def measure(fn) -> tuple[int, object]:
        hidden.grad = weight.grad = None
        _free()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        lp = fn()
        lp.sum().backward()
        if cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - base, lp.detach()
        return 0, lp.detach()

    def p_path():
        logits = torch.nn.functional.linear(hidden, weight)
        return torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, target[:, None])[:, 0]

    r_peak, lp_r = measure(lambda: logp.vocab_parallel_logprobs(hidden, weight, target, TEMPERATURE, None))
    p_peak, lp_p = measure(p_path)
    mib = 2**20
    out = dict(tokens=tokens, vocab=V, hidden=H, dtype=str(dtype), grads_mib=round(grads_bytes / mib, 1),
               rlk_peak_mib=round(r_peak / mib, 1), p_peak_mib=round(p_peak / mib, 1),
               rlk_extra_mib=round((r_peak - grads_bytes) / mib, 1), p_extra_mib=round((p_peak - grads_bytes) / mib, 1),
               logits_bf16_mib=round(tokens * V * 2 / mib, 1), t_x_256_fp32_mib=round(tokens * 256 * 4 / mib, 2),
               rlk_vs_p_max_abs_diff=max_abs(lp_r, lp_p))
    rec.update(out)
    rep.data["logp_memory"] = out
    if cuda:
        rep.check("logp_memory.rlk_extra_below_materialised_logits", r_peak - grads_bytes < tokens * V * 2,
                  bitwise=False, rlk_extra_mib=out["rlk_extra_mib"], p_extra_mib=out["p_extra_mib"])


# -- TP 2 / CP 2 (torchrun --nproc-per-node 2) -------------------------------------------------------------
def _groups():
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()


def _gather_objects(obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def parallel_logp(model, box, b: Batch, tp_group, cp_group, cp: int):
    """Per-token fp32 log-probs of every packed token in global order, from a TP / CP model: each CP rank
    runs its zigzag shard (global ``cu_seqlens``), the logp module runs per rank on the local tokens with the
    vocab shards of its TP group, and the CP shards are gathered back (exact data movement; detached: the
    loss is taken per CP rank on its own tokens, see :func:`cp_local_loss`). Returns (global, local, layout)."""
    import rlk_collectives
    from rlk_megatron_provider import logp

    if cp > 1:
        layout = rlk_collectives.ZigzagLayout.build(b.cu.tolist(), cp, b.ids.device)
        ids, tgt = layout.shard(b.ids, cp_group.rank()), layout.shard(b.target, cp_group.rank())
    else:
        layout, ids, tgt = None, b.ids, b.target
    psp = b.psp()
    if cp > 1 and hasattr(psp, "cp_group"):  # as slime passes it (Megatron's rotary setup may read it)
        psp.cp_group = cp_group
    model(ids[None], ids[None] * 0, None, packed_seq_params=psp)  # positions: rlk RoPE reads cu_seqlens
    h = box["hidden"].reshape(-1, box["hidden"].shape[-1])
    lp = logp.vocab_parallel_logprobs(h, box["weight"], tgt, TEMPERATURE, tp_group)
    if cp == 1:
        return lp, lp, None
    return rlk_collectives.cp_all_gather(lp.detach(), layout, cp_group), lp, layout


def cp_local_loss(lp_local, b: Batch, layout, cp_group):
    """This CP rank's share of :func:`grpo_loss` (its response tokens' terms over the global count): the
    shares sum to the loss, so the CP sum of each rank's gradients is the gradient (Megatron's CP scheme)."""
    import torch

    adv = torch.zeros(b.T, device=lp_local.device)
    adv[b.rows] = b.adv
    mask = torch.zeros(b.T, device=lp_local.device)
    mask[b.rows] = 1.0
    adv_l, mask_l = layout.shard(adv, cp_group.rank()), layout.shard(mask, cp_group.rank())
    ratio = torch.exp(lp_local - lp_local.detach())
    terms = torch.minimum(ratio * adv_l, ratio.clamp(1 - CLIP, 1 + CLIP) * adv_l) * mask_l
    return -terms.sum() / b.rows.numel()


def stage_parallel(rep: Report, rec: dict, cfg, dev, dtype, tp: int, cp: int, lengths: list[int], prompt: int):
    """TP ``tp`` x CP ``cp`` on the same weights and batch as rlk-repro's local trainer (which the 1-GPU
    lockstep shows equal to Megatron at TP 1 / CP 1): the same step twice (run to run), log-probs vs the local
    trainer (bitwise required for CP; TP != TP 1 by contract in the row-parallel partial sums, reported),
    gradients (CP: summed over the CP group with the rlk all-reduce) vs the local trainer's, per tensor."""
    import torch
    import torch.distributed as dist

    import rlk_collectives
    from rlk_megatron_provider.weights import to_megatron

    tp_group, cp_group = _groups()
    w = make_weights(cfg, dev)
    model, counts = build(cfg, dev, dtype, rlk=True, tp=tp, cp=cp)
    load(model, cfg, w, tp, tp_group.rank())
    box = hidden_head(model)
    b = Batch(cfg, lengths, prompt, dev, seed=11)
    rec.update(tokens=b.T, sequences=len(lengths), rlk_layer_counts=counts, tp=tp, cp=cp)
    runs = []
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        lp, lp_local, layout = parallel_logp(model, box, b, tp_group, cp_group, cp)
        (grpo_loss(lp[b.rows], b.adv) if cp == 1 else cp_local_loss(lp_local, b, layout, cp_group)).backward()
        grads = grads_of(model)
        if cp > 1:
            grads = {n: rlk_collectives.all_reduce(g, cp_group) for n, g in grads.items()}
        runs.append((lp.detach().clone(), grads))
    (lp0, g0), (lp1, g1) = runs
    det = torch.equal(lp0, lp1) and not diff_names(g0, g1)
    tr = local_trainer(cfg, w, dev, dtype)
    res = tr.step(b.samples())
    lp_ref = torch.cat(res.train_logprobs)
    ref_grads = to_megatron(cfg, {k: v.grad for k, v in tr.master.items() if v.grad is not None}, tp, tp_group.rank())
    lp_rows = lp1[b.rows]
    got = {n: g.float() for n, g in g1.items()}
    equal_t = sorted(n for n in got if n in ref_grads and torch.equal(got[n], ref_grads[n].to(got[n].device)))
    mine = {"rank": dist.get_rank(), "tp_rank": tp_group.rank(),
            "cp_rank": cp_group.rank(), "run_to_run": det, "logp_equal_local": torch.equal(lp_rows, lp_ref),
            "logp_differing_tokens": int((lp_rows != lp_ref).sum()), "logp_max_abs_diff": max_abs(lp_rows, lp_ref),
            "grads_equal_local": equal_t, "grads_differing_local": sorted(set(got) - set(equal_t)),
            "grads_max_abs_diff": max((max_abs(got[n], ref_grads[n].to(got[n].device)) for n in got
                                       if n in ref_grads), default=0.0)}
    ranks = _gather_objects(mine)
    rec["ranks"] = ranks
    tag = f"tp{tp}_cp{cp}"
    rep.check(f"{tag}.run_to_run_logp_and_grads", all(r["run_to_run"] for r in ranks),
              ranks=[r["run_to_run"] for r in ranks])
    rep.check(f"{tag}.logp_equal_local_trainer", all(r["logp_equal_local"] for r in ranks), bitwise=tp == 1,
              tokens=int(lp_ref.numel()), differing_tokens=[r["logp_differing_tokens"] for r in ranks],
              max_abs_diff=max(r["logp_max_abs_diff"] for r in ranks),
              note=None if tp == 1 else "TP 2 != TP 1 by contract (row-parallel partial sums): informational")
    rep.check(f"{tag}.grads_equal_local_trainer", all(not r["grads_differing_local"] for r in ranks), bitwise=False,
              equal=[len(r["grads_equal_local"]) for r in ranks],
              differing=[r["grads_differing_local"][:12] for r in ranks],
              max_abs_diff=max(r["grads_max_abs_diff"] for r in ranks),
              note="informational: CP sums each rank's token partial sums; TP reduces K in shards")
    del model, tr, box


def stage_parallel_readbacks(rep: Report, rec: dict, tp: int, cp: int) -> None:
    """Every rank's readback (also flushed to RL_KERNEL_READBACK_DIR): rlk collectives ran on each, at
    world size 2, and nothing fell back."""
    import rlk_megatron_provider as prov
    from rlk_megatron_provider import _state

    prov.flush_readback()
    doc = _state.get().recorder.to_dict()
    want = ("all_reduce",) if tp > 1 else ("cp_all_gather_kv", "cp_all_gather")
    mine = {"rank": doc["rank"], "world_size": doc["world_size"], "hostname": doc["hostname"], "collectives": {},
            "fallback": any(m.get("fallback") for m in doc["modules"].values())}
    for module, m in doc["modules"].items():
        for op, r in m["ops"].items():
            if any(k in op for k in ("all_reduce", "all_gather", "reduce_scatter", "cp_")):
                mine["collectives"][f"{module}.{op}"] = {"backend_id": r["backend_id"], "calls": r["call_count"],
                                                        "provenance": r.get("provenance", {})}
    ranks = _gather_objects(mine)
    rec["ranks"] = ranks

    def ran(r) -> bool:
        hits = [v for k, v in r["collectives"].items() if any(w in k for w in want)]
        return bool(hits) and all(v["backend_id"].startswith("rlk.") and v["calls"] > 0 for v in hits)

    rep.check(f"tp{tp}_cp{cp}.readbacks_rlk_collectives_every_rank", all(ran(r) and not r["fallback"] for r in ranks),
              wanted=list(want), ranks=[sorted(r["collectives"]) for r in ranks])


def run_parallel(args, rep: Report, dev, dtype) -> None:
    tp, cp = args.tp, args.cp
    main_shape = "tiny" if args.tiny else "qwen3-0.6b"
    cfg = qwen_cfg(main_shape)
    unit = 4 * cp  # zigzag CP: every length a multiple of 2 x cp (and of 4, so CP 1 and CP 2 see one batch)
    total, nseq, prompt = (64, 4, 4) if args.tiny else (4096, 16, 32)
    lengths = [max(unit, n // unit * unit) for n in varlen_lengths(nseq, total, seed=1)]
    with rep.stage(f"tp{tp}_cp{cp}") as rec:
        stage_parallel(rep, rec, cfg, dev, dtype, tp, cp, lengths, prompt)
    with rep.stage(f"tp{tp}_cp{cp}_readbacks") as rec:
        stage_parallel_readbacks(rep, rec, tp, cp)
    if tp > 1:
        n, s = (4, 16) if args.tiny else (16, 256)
        warmup, iters = (1, 2) if args.tiny else (2, 5)
        with rep.stage(f"timing_{main_shape}_tp{tp}", required=False) as rec:
            stage_timing(rep, rec, f"{main_shape}_tp{tp}", cfg, dev, dtype, n, s, warmup, iters, tp)


# -- main ------------------------------------------------------------------------------------------------
def varlen_lengths(n: int, total: int, seed: int) -> list[int]:
    """``n`` lengths summing to ``total`` (between ~total/2n and ~3total/2n), deterministic."""
    import torch

    g = torch.Generator().manual_seed(seed)
    raw = torch.rand(n, generator=g) + 0.5
    lens = (raw / raw.sum() * total).floor().long()
    lens[-1] += total - int(lens.sum())
    return [int(x) for x in lens]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2-layer model, small batch (CPU smoke test)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=200.0,
                    help="optional stages (1.7B timing) start only if elapsed < budget - their estimate "
                         "(sitting.sh caps the whole megatron stage at 240 s)")
    ap.add_argument("--skip-1p7b", action="store_true")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallel size (> 1: under torchrun; the TP/CP stages)")
    ap.add_argument("--cp", type=int, default=1, help="context parallel size (> 1: under torchrun; the TP/CP stages)")
    ap.add_argument("--hybrid", action="store_true",
                    help="megatron-core 0.19's HybridModel (pattern '*-' per layer) instead of GPTModel")
    args = ap.parse_args()
    parallel = args.tp * args.cp > 1
    if args.hybrid:
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
        warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
        from rlk_megatron_provider import _compat

        if not hybrid_available():
            print(f"megatron_gpu: --hybrid needs HybridModel (megatron.core.models.hybrid, megatron-core >= 0.19); "
                  f"this is megatron-core {_compat.version()}", file=sys.stderr)
            return 2
        if parallel:
            print("megatron_gpu: --hybrid runs the 1-GPU stages only (not with --tp / --cp > 1)", file=sys.stderr)
            return 2
        global HYBRID
        HYBRID = True
    rank = int(os.environ.get("RANK", "0"))
    os.environ.update(R_ENV)
    os.environ.setdefault("RL_KERNEL_READBACK_DIR", os.path.join(args.out, "readbacks"))
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    import torch

    dev = torch.device(args.device)
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    rep = Report(args.out, meta(args), "megatron_gpu" if not parallel else
                 f"megatron_gpu_tp{args.tp}_cp{args.cp}" + (f".rank{rank}" if rank else ""))
    md_path = os.path.join(args.out, f"{rep.name}.md")
    log(f"meta: {json.dumps(rep.data['meta'], default=str)}")
    with rep.stage("init") as rec:
        init_world(args.device, args.tp, args.cp)
        import rlk_megatron_provider as prov

        st = prov.initialize_from_environment()
        rec["plan"] = st.plan.name
    if rep.data["stages"]["init"]["status"] != "ok":
        rep.write()
        open(md_path, "w").write(rep.markdown())
        return 1
    if parallel:
        run_parallel(args, rep, dev, dtype)
        return _finish(rep, md_path, rank)
    main_shape = "tiny" if args.tiny else "qwen3-0.6b"
    cfg = qwen_cfg(main_shape)
    if args.tiny:
        total, nseq, prompt, eq_n, eq_s = 64, 4, 3, 4, 16
    else:
        total, nseq, prompt, eq_n, eq_s = 4096, 16, 32, 16, 256
    lengths = varlen_lengths(nseq, total, seed=1)
    with rep.stage("lockstep") as rec:
        stage_lockstep(rep, rec, cfg, dev, dtype, args.steps, lengths, prompt)
    with rep.stage("negative_control") as rec:
        stage_negative(rep, rec, cfg, dev, dtype, eq_n, eq_s)
    with rep.stage("logp_memory", required=False) as rec:
        stage_logp_memory(rep, rec, cfg, dev, dtype, total)
    warmup, iters = (1, 2) if args.tiny else (2, 5)
    with rep.stage(f"timing_{main_shape}", required=False) as rec:
        stage_timing(rep, rec, main_shape, cfg, dev, dtype, eq_n, eq_s, warmup, iters)
    if args.tiny or args.skip_1p7b:
        rep.skip("timing_qwen3-1.7b", "--tiny" if args.tiny else "--skip-1p7b")
    else:
        small = rep.data["stages"][f"timing_{main_shape}"].get("seconds", 60.0)
        estimate = 2.5 * small + 15  # ~2.8x the FLOPs, new Triton shapes to compile
        left = args.budget_s - (time.monotonic() - T0)
        if left < estimate:
            rep.skip("timing_qwen3-1.7b", f"time budget: {left:.0f} s left, estimate {estimate:.0f} s")
        else:
            with rep.stage("timing_qwen3-1.7b", required=False) as rec:
                stage_timing(rep, rec, "qwen3-1.7b", qwen_cfg("qwen3-1.7b"), dev, dtype, eq_n, eq_s, warmup, iters)
    return _finish(rep, md_path, rank)


def _finish(rep: Report, md_path: str, rank: int) -> int:
    rep.write()
    md = rep.markdown()
    with open(md_path, "w") as f:
        f.write(md)
    if rank == 0:
        print(md, flush=True)
    failed = rep.failed()
    log(f"done: {'FAILED: ' + ', '.join(failed) if failed else 'all bitwise checks passed'}")
    try:
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    except Exception:
        pass
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
