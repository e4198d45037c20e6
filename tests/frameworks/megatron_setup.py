"""Megatron-core with the rlk provider on one process or a torchrun world, shared by the bitwise worker
(``tests/frameworks/megatron_worker.py``) and the step-time benchmark (``benchmarks/frameworks/megatron_gpu.py``):
the Qwen3 shapes, their random weights in rlk-repro's layout, ``GPTModel`` / ``HybridModel`` on the provider's spec or
on Megatron's stock local spec, weights through the provider's converter, packed THD batches, the GRPO loss,
rlk-repro's local trainer (the reference), and a report that records each stage and check.

``HYBRID`` (set by ``--hybrid``): megatron-core 0.19's ``HybridModel`` (pattern ``"*-"`` per Qwen3 layer) instead of
``GPTModel``. Nothing here runs at import; megatron-core and torch are imported inside the functions.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import warnings

# _cpu: the CPU recipes (test support)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "megatron"))

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
NAME = "megatron"  # the log prefix: the script's name


def log(msg: str) -> None:
    print(f"[{NAME} {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


# -- report ----------------------------------------------------------------------------------------------
class Report:
    def __init__(self, out: str, meta: dict, name: str) -> None:
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

    def markdown(self, extra: list[str] = ()) -> str:
        m = self.data["meta"]
        lines = [f"# {self.name}: rlk-megatron-provider ({m.get('model', 'GPTModel')}) on {m.get('gpu', m['device'])}",
                 "", f"megatron-core {m.get('megatron_core')}, torch {m.get('torch')}, commit "
                 f"{m.get('commit')}, {m['elapsed_s']} s"]
        if self.data["checks"]:
            lines += ["", "| check | result | numbers |", "| --- | --- | --- |"]
        for c in self.data["checks"]:
            nums = {k: v for k, v in c.items() if k not in ("name", "pass", "bitwise")}
            tag = "PASS" if c["pass"] else ("FAIL" if c["bitwise"] else "differs (info)")
            lines.append(f"| {c['name']} | {tag} | {json.dumps(nums, default=str)[:300]} |")
        lines += ["", "| stage | status | s |", "| --- | --- | --- |"]
        for n, s in self.data["stages"].items():
            why = ": " + s.get("error", s.get("reason", ""))[:200] if s["status"] != "ok" else ""
            lines.append(f"| {n} | {s['status']}{why} | {s.get('seconds', '')} |")
        lines += extra
        return "\n".join(lines) + "\n"

    def finish(self, rank: int = 0, extra: list[str] = ()) -> int:
        """Write the JSON and the markdown, print the markdown on rank 0, leave the process group; 1 if a bitwise
        check failed or a required stage did not finish."""
        self.write()
        md = self.markdown(extra)
        with open(os.path.join(self.out, f"{self.name}.md"), "w") as f:
            f.write(md)
        if rank == 0:
            print(md, flush=True)
        failed = self.failed()
        ok = "every stage ran" + (", every bitwise check passed" if self.data["checks"] else "")
        log(f"done: {'FAILED: ' + ', '.join(failed) if failed else ok}")
        with contextlib.suppress(Exception):
            import torch.distributed as dist
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
        return 1 if failed else 0


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
        from _cpu import cpu_recipe

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


def use_hybrid() -> str | None:
    """Switch this process to ``HybridModel``; the reason it cannot (megatron-core without it), else None."""
    global HYBRID
    from rlk_megatron_provider import _compat

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    if not hybrid_available():
        return (f"--hybrid needs HybridModel (megatron.core.models.hybrid, megatron-core >= 0.19); this is "
                f"megatron-core {_compat.version()}")
    HYBRID = True
    return None


def setup_process(args) -> tuple:
    """The route variables (every module R/R, strict), the readback folder, the device and dtype (fp32 on the CPU)."""
    import torch

    os.environ.update(R_ENV)
    os.environ.setdefault("RL_KERNEL_READBACK_DIR", os.path.join(args.out, "readbacks"))
    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
    dev = torch.device(args.device)
    if args.device == "cpu":
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    return dev, torch.float32 if args.device == "cpu" else torch.bfloat16


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
            from _cpu import hybrid_final_norm_without_te

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


def _groups():
    """This rank's tensor- and context-parallel groups."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group(), parallel_state.get_context_parallel_group()


def varlen_lengths(n: int, total: int, seed: int) -> list[int]:
    """``n`` lengths summing to ``total`` (between ~total/2n and ~3total/2n), deterministic."""
    import torch

    g = torch.Generator().manual_seed(seed)
    raw = torch.rand(n, generator=g) + 0.5
    lens = (raw / raw.sum() * total).floor().long()
    lens[-1] += total - int(lens.sum())
    return [int(x) for x in lens]


