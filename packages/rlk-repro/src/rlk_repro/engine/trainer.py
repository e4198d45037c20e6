"""The trainer (Megatron stand-in): packed varlen forward to token log-probs, GRPO loss, optimizer step.

Sequences (prompt + response) are packed into one token stream with ``cu_seqlens``; the forward runs
the train-side attention core over the packed stream and the train-side log-prob op (fused
``linear_logprobs`` for R; ``F.linear`` + ``log_softmax`` for P) on every position. The log-probs of the
response tokens, taken from this forward *before* the update, are what the run compares with the
rollout engine's. Master weights are fp32; the forward runs in the compute dtype (a cast of the master
weights, the same cast the weight sync sends to the rollout engine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from rlk_core.errors import RlkConfigError
from rlk_repro.engine.sampling import SamplingParams, filtered
from rlk_repro.model import qwen3
from rlk_repro.model.config import Qwen3Config
from rlk_repro.model.ops import Ops
from rlk_repro.model.weights import Weights


@dataclass
class Sample:
    prompt: list[int]
    response: list[int]
    rollout_logprobs: list[float]
    advantage: float


@dataclass
class TrainResult:
    train_logprobs: list[torch.Tensor]  # per sample, [len(response)] fp32, from the forward before the update
    loss: float
    grad_norm: float
    tokens: int
    seconds: float
    # MoE: per sample, the [len(prompt) + len(response) - 1, layers, k] expert ids of the forward before the update
    routing: list[torch.Tensor] | None = None


def make_optimizer(params: list[torch.Tensor], optimizer: str, lr: float, foreach: bool = False
                   ) -> torch.optim.Optimizer:
    """The fp32-master optimizer of both trainers (this one and the frameworks engine's Megatron one): AdamW
    without weight decay, or SGD, over ``params`` in the order given (sorted names)."""
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=foreach)
    if optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=foreach)
    raise RlkConfigError(f"optimizer {optimizer!r} is not one of adamw, sgd")


class Trainer:
    def __init__(self, cfg: Qwen3Config, weights: Weights, ops: Ops, *, device: torch.device, dtype: torch.dtype,
                 temperature: float, optimizer: str = "adamw", lr: float = 1e-3, clip_eps: float = 0.2,
                 update: bool = True, sampling: SamplingParams | None = None, logprobs: str = "processed") -> None:
        if ops.side != "train":
            raise RlkConfigError(f"the trainer needs train-side ops, got {ops.side!r}")
        self.cfg, self.ops, self.device, self.dtype = cfg, ops, device, dtype
        self.temperature, self.clip_eps = temperature, clip_eps
        self.update = update  # False: a static-weights run (the loss and gradients are computed, never applied)
        # the rollout's filters: with processed log-probs the trainer finds each position's kept set from its own
        # logits (the same op as the rollout engine under R) and computes the log-prob over it
        self.sampling = sampling if sampling is not None else SamplingParams(temperature)
        self.processed = logprobs == "processed" and filtered(self.sampling)
        self.kept_sizes: torch.Tensor | None = None  # of the last forward_logprobs, per row (processed only)
        self.master = {k: v.detach().to(device=device, dtype=torch.float32).clone().requires_grad_(True)
                       for k, v in weights.items()}
        self.opt = make_optimizer([self.master[k] for k in sorted(self.master)], optimizer, lr)

    def export_weights(self) -> Weights:
        """The weights the rollout engine receives: the master weights cast to the compute dtype."""
        return {k: v.detach().to(self.dtype) for k, v in self.master.items()}

    def forward_logprobs(self, seqs: list[list[int]], rows: torch.Tensor | None = None,
                         routing: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Log-prob of ``seq[t+1]`` at positions ``t`` of the packed sequences, fp32.

        ``rows`` selects packed positions (default: all ``sum(len - 1)``); the LM head and log-softmax run
        only on those rows (the response positions), as RL trainers do. ``routing`` (an MoE model): each layer's
        ``[sum(len - 1), k]`` expert ids are appended to it.
        """
        target = torch.tensor([t for s in seqs for t in s[1:]], device=self.device, dtype=torch.long)
        hn, w = self.hidden([s[:-1] for s in seqs], routing)
        if rows is not None:
            hn, target = hn[rows], target[rows]
        weight = qwen3.lm_head_weight(w)
        kept = self.kept_sets(hn, weight) if self.processed else None
        return self.ops.linear_logprobs(hn, weight, target, self.temperature, kept)

    def hidden(self, inputs: list[list[int]], routing: list[torch.Tensor] | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The final-norm hidden states ``[sum(len), H]`` of the packed token sequences ``inputs`` (each causal on
        its own) and the compute-dtype weights they were computed with (the LM head among them)."""
        cfg, ops, dev = self.cfg, self.ops, self.device
        lens = [len(s) for s in inputs]
        ids = torch.tensor([t for s in inputs for t in s], device=dev, dtype=torch.long)
        pos = torch.cat([torch.arange(n, device=dev) for n in lens])
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
        w = {k: v.to(self.dtype) for k, v in self.master.items()}
        scale = cfg.head_dim**-0.5
        h = qwen3.embed(w, ids)
        for layer in range(cfg.num_hidden_layers):
            q, k, v = qwen3.attention_qkv(ops, cfg, w, layer, h, pos)
            o = ops.attention_varlen(q, k, v, cu, lens, scale)
            h = h + qwen3.attention_out(ops, w, layer, o)
            h = h + qwen3.ffn(ops, cfg, w, layer, h, routing)
        return qwen3.final_norm(ops, cfg, w, h), w

    def kept_sets(self, hn: torch.Tensor, weight: torch.Tensor, rows_per_chunk: int = 1024):
        """Each row's kept set from this side's own logits (no gradient), in row chunks: rlk's threshold under R
        (``value``, ``token_id``), the native filter's mask under P."""
        parts = []
        with torch.no_grad():
            for i in range(0, hn.shape[0], rows_per_chunk):
                logits = self.ops.linear("logp", hn[i:i + rows_per_chunk].detach(), weight.detach())
                parts.append(self.ops.kept_set(logits, [self.sampling] * logits.shape[0])[1])
        if not parts:
            self.kept_sizes = torch.zeros(0, dtype=torch.int64)
            return None
        if isinstance(parts[0], torch.Tensor):  # P: masks
            mask = torch.cat(parts)
            self.kept_sizes = mask.sum(-1).cpu()
            return mask
        value, token_id = torch.cat([k.value for k in parts]), torch.cat([k.token_id for k in parts])
        self.kept_sizes = torch.cat([k.size for k in parts]).cpu()
        return value, token_id

    def step(self, samples: list[Sample]) -> TrainResult:
        """Recompute log-probs, then one GRPO (PPO-clip, token-mean) update."""
        t0 = time.perf_counter()
        seqs = [s.prompt + s.response for s in samples]
        rows, adv, start = [], [], 0
        for s in samples:
            n = len(s.prompt) + len(s.response) - 1
            rows.append(torch.arange(start + len(s.prompt) - 1, start + n, device=self.device))
            adv += [s.advantage] * len(s.response)
            start += n
        routing: list[torch.Tensor] | None = [] if self.cfg.is_moe else None
        logp = self.forward_logprobs(seqs, torch.cat(rows), routing)
        old = logp.detach()
        a = torch.tensor(adv, device=self.device, dtype=torch.float32)
        loss = -grpo_surrogate(logp, a, self.clip_eps).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grads = [p.grad for p in self.master.values() if p.grad is not None]
        grad_norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))) if grads else 0.0
        if self.update:
            self.opt.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        per_sample = list(old.split([len(s.response) for s in samples]))
        chosen = None
        if routing is not None:
            lens = [len(s.prompt) + len(s.response) - 1 for s in samples]
            chosen = list(torch.stack(routing, dim=1).split(lens))
        return TrainResult(per_sample, float(loss.detach()), grad_norm, start,
                           time.perf_counter() - t0, chosen)


def grpo_surrogate(lp: torch.Tensor, adv: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """PPO-clip surrogate per token at the recompute point (ratio 1, its gradient flows). A token whose log-prob is
    not finite — sampled outside this side's kept set, which only a P side's filter can disagree on — takes no
    part (ratio 1 without a gradient, surrogate 0): it would turn the loss and the weights into NaN."""
    ok = torch.isfinite(lp)
    safe = torch.where(ok, lp, torch.zeros_like(lp))
    ratio = torch.exp(safe - safe.detach())
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return torch.where(ok, surrogate, torch.zeros_like(surrogate))


def group_advantages(rewards: list[float], group_size: int) -> list[float]:
    """GRPO: ``(r - mean_group) / (std_group + 1e-6)`` over consecutive groups of ``group_size``."""
    out = []
    for g in range(0, len(rewards), group_size):
        r = torch.tensor(rewards[g : g + group_size], dtype=torch.float64)
        std = r.std(unbiased=False) if len(r) > 1 else torch.tensor(0.0, dtype=torch.float64)
        out += ((r - r.mean()) / (std + 1e-6)).tolist()
    return out
