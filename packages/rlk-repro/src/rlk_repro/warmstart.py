"""``rlk-repro warmstart``: a short supervised run (teacher-forced cross-entropy on prompt -> worked solution) that
warm-starts a model before GRPO (issue 37, "a model that learns").

The model is the local engine's: its trainer (:class:`~rlk_repro.engine.trainer.Trainer`, fp32 masters, the
compute dtype's forward over packed sequences) on the production (P/P) operators, AdamW without weight decay, a
linear warm-up then a cosine decay to a tenth of ``lr``, the gradient norm clipped at 1. Each step draws
``batch_size`` rows of the ``sft`` split (a fresh permutation every epoch, from ``seed``); a row is the prompt as
the run renders it (the chat template, ``add_generation_prompt``) followed by ``metadata.solution`` and the EOS token,
and the loss is the mean negative log-likelihood of the solution's tokens and the EOS.

Before and after (and every ``eval_every`` steps) on the ``heldout`` split: the teacher-forced loss, and greedy
decoding (``eval_max_new_tokens``, stopping at the tokenizer's stop tokens) graded by the deepscaler rule
(:func:`rlk_repro.deepscaler.reward`): the accuracy, and the share of responses the rule can read (a ``</think>``
then a ``\\boxed{}``). The result is a new model directory (the Hugging Face layout, the tokenizer files copied)
with ``rlk-checkpoint.json`` (kind ``warm start``) and ``warmstart.json`` (the curve and the evaluations).
"""

from __future__ import annotations

import math
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from rlk_core.errors import RlkConfigError

RECORD = "warmstart.json"
RECORD_SCHEMA = "rlk.warmstart.v1"


@dataclass
class WarmStartConfig:
    steps: int = 300
    batch_size: int = 64
    lr: float = 5e-4
    warmup: int = 30
    seed: int = 1234
    device: str = "cpu"
    dtype: str = "float32"
    eval_rows: int = 256
    eval_max_new_tokens: int = 48
    eval_every: int = 0  # 0: before and after only
    eval_batch: int = 256
    log_every: int = 25

    def validate(self) -> None:
        for name in ("steps", "batch_size", "eval_rows", "eval_max_new_tokens", "eval_batch", "log_every"):
            if getattr(self, name) < 1:
                raise RlkConfigError(f"warmstart {name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or self.warmup < 0 or self.eval_every < 0:
            raise RlkConfigError(f"warmstart needs lr > 0, warmup >= 0 and eval-every >= 0 (got {self.lr}, "
                                 f"{self.warmup}, {self.eval_every})")


def lr_at(step: int, cfg: WarmStartConfig) -> float:
    """Linear warm-up over ``cfg.warmup`` steps, then cosine from ``lr`` to ``lr / 10`` at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup - 1)
    return cfg.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - cfg.warmup) / span))))


@dataclass
class Example:
    prompt: list[int]
    target: list[int]  # the solution's tokens and the EOS
    label: str


def examples(rows: list[dict], tok, eos: int) -> list[Example]:
    out = []
    for row in rows:
        text = tok.apply_chat_template(row["prompt"], add_generation_prompt=True)
        out.append(Example(tok.encode(text), tok.encode(row["metadata"]["solution"]) + [eos], str(row["label"])))
    return out


def _trainer(model_dir: Path, cfg: WarmStartConfig):
    from rlk_core.plan import RoutePlan
    from rlk_core.readback import ReadbackRecorder
    from rlk_repro.engine.local import DTYPES, resolve_device
    from rlk_repro.engine.trainer import Trainer
    from rlk_repro.model.ops import Ops
    from rlk_repro.model.weights import load_checkpoint

    if cfg.dtype not in DTYPES:
        raise RlkConfigError(f"--dtype {cfg.dtype!r} is not one of {', '.join(DTYPES)}")
    device = resolve_device(cfg.device)
    model_cfg, weights = load_checkpoint(model_dir)
    plan = RoutePlan("P/P", "P/P", "P/P")
    ops = Ops(plan, "train", ReadbackRecorder("local", "train", plan, mode="audit"))
    return Trainer(model_cfg, {k: v.float() for k, v in weights.items()}, ops, device=device, dtype=DTYPES[cfg.dtype],
                   temperature=1.0, optimizer="adamw", lr=cfg.lr)


def _rows(batch: list[Example]) -> tuple[list[list[int]], torch.Tensor, int]:
    """Packed sequences and the packed positions whose next token is a target token."""
    seqs, rows, start = [], [], 0
    for ex in batch:
        seqs.append(ex.prompt + ex.target)
        n = len(ex.prompt) + len(ex.target) - 1
        rows.append(torch.arange(start + len(ex.prompt) - 1, start + n))
        start += n
    return seqs, torch.cat(rows), sum(len(ex.target) for ex in batch)


def heldout_loss(trainer, data: list[Example], batch: int) -> float:
    """Mean NLL per target token over ``data``, teacher-forced."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(data), batch):
            seqs, rows, n = _rows(data[i:i + batch])
            total += float(-trainer.forward_logprobs(seqs, rows.to(trainer.device)).double().sum())
            count += n
    return total / count


def greedy(trainer, prompts: list[list[int]], max_new: int, stop: set[int]) -> list[list[int]]:
    """Greedy responses (each ends at its first stop token, kept, or at ``max_new`` tokens), the whole prefix
    recomputed every step (no KV cache: short sequences)."""
    from rlk_repro.model import qwen3

    out: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    with torch.no_grad():
        for _ in range(max_new):
            if not live:
                break
            seqs = [prompts[i] + out[i] for i in live]
            hn, w = trainer.hidden(seqs)
            last = torch.tensor([len(s) for s in seqs]).cumsum(0) - 1
            logits = torch.nn.functional.linear(hn[last.to(hn.device)].float(), qwen3.lm_head_weight(w).float())
            nxt = logits.argmax(-1).tolist()
            for i, t in zip(live, nxt, strict=True):
                out[i].append(int(t))
            live = [i for i in live if out[i][-1] not in stop]
    return out


def evaluate(trainer, data: list[Example], tok, stop: set[int], cfg: WarmStartConfig) -> dict[str, Any]:
    """The held-out loss, and the greedy responses' deepscaler accuracy and readable share (one example kept)."""
    from rlk_repro.deepscaler import boxed_answer, reward, solution_part

    t0 = time.perf_counter()
    loss = heldout_loss(trainer, data, cfg.eval_batch)
    correct = readable = 0
    sample = None
    for i in range(0, len(data), cfg.eval_batch):
        chunk = data[i:i + cfg.eval_batch]
        for ex, resp in zip(chunk, greedy(trainer, [e.prompt for e in chunk], cfg.eval_max_new_tokens, stop),
                            strict=True):
            text = tok.decode(resp)
            part = solution_part(text)
            readable += part is not None and boxed_answer(part) is not None
            correct += reward(text, ex.label)
            if sample is None:
                sample = {"label": ex.label, "response": text}
    n = len(data)
    return {"heldout_loss": loss, "accuracy": correct / n, "readable": readable / n, "rows": n,
            "seconds": round(time.perf_counter() - t0, 2), "example": sample}


def warm_start(model_dir: Path, sft_jsonl: Path, heldout_jsonl: Path, dest: Path, cfg: WarmStartConfig,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train ``model_dir`` on ``sft_jsonl`` and write the result to ``dest``; returns the ``warmstart.json``
    document."""
    from rlk_repro import lifecycle, runs
    from rlk_repro.model.tokenizer import HFTokenizer
    from rlk_repro.model.weights import save_checkpoint
    from rlk_repro.prepare import TOKENIZER_FILES
    from rlk_repro.synthmath import read_rows
    from rlk_repro.synthmodel import checkpoint_record

    cfg.validate()
    if dest.resolve() == model_dir.resolve():
        raise RlkConfigError(f"warmstart writes a new model directory; --output {dest} is the input")
    tok = HFTokenizer(model_dir)
    trainer = _trainer(model_dir, cfg)
    eos = trainer.cfg.eos_token_id
    stop = set(tok.stop_token_ids(eos))
    train = examples(read_rows(sft_jsonl), tok, eos)
    held = examples(read_rows(heldout_jsonl)[:cfg.eval_rows], tok, eos)
    params = sum(int(p.numel()) for p in trainer.master.values())
    log(f"warmstart: {params / 1e6:.1f}M parameters, {len(train)} sft rows, {len(held)} held-out rows, {cfg.steps} "
        f"steps x {cfg.batch_size}, lr {cfg.lr:g}, {cfg.device} {cfg.dtype}")
    before = evaluate(trainer, held, tok, stop, cfg)
    log(f"warmstart: before: held-out loss {before['heldout_loss']:.4f}, accuracy {before['accuracy']:.3f}, "
        f"readable {before['readable']:.3f}")
    g = torch.Generator().manual_seed(cfg.seed)
    order: list[int] = []
    curve, evals = [], [{"step": 0, **before}]
    params_list = list(trainer.master.values())
    t0 = time.perf_counter()
    tokens = 0
    for step in range(cfg.steps):
        while len(order) < cfg.batch_size:
            order += torch.randperm(len(train), generator=g).tolist()
        batch, order = [train[i] for i in order[:cfg.batch_size]], order[cfg.batch_size:]
        seqs, rows, n = _rows(batch)
        lr = lr_at(step, cfg)
        for group in trainer.opt.param_groups:
            group["lr"] = lr
        loss = -trainer.forward_logprobs(seqs, rows.to(trainer.device)).mean()
        trainer.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params_list, 1.0))
        trainer.opt.step()
        tokens += sum(len(s) for s in seqs)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            if trainer.device.type == "cuda":
                torch.cuda.synchronize(trainer.device)
            el = time.perf_counter() - t0
            curve.append({"step": step + 1, "loss": float(loss.detach()), "grad_norm": grad_norm, "lr": lr,
                          "seconds": round(el, 2)})
            log(f"warmstart: step {step + 1}/{cfg.steps}: loss {curve[-1]['loss']:.4f}, grad norm {grad_norm:.3f}, lr "
                f"{lr:.3g}, {tokens / el:.0f} tok/s")
        if cfg.eval_every and (step + 1) % cfg.eval_every == 0 and step + 1 < cfg.steps:
            evals.append({"step": step + 1, **evaluate(trainer, held, tok, stop, cfg)})
            log(f"warmstart: step {step + 1}: held-out loss {evals[-1]['heldout_loss']:.4f}, accuracy "
                f"{evals[-1]['accuracy']:.3f}")
    train_seconds = time.perf_counter() - t0
    after = evaluate(trainer, held, tok, stop, cfg)
    evals.append({"step": cfg.steps, **after})
    log(f"warmstart: after: held-out loss {after['heldout_loss']:.4f}, accuracy {after['accuracy']:.3f}, readable "
        f"{after['readable']:.3f} (example: {after['example']['response']!r}, label {after['example']['label']!r})")
    if dest.exists():
        shutil.rmtree(dest)
    weights = {k: v.detach().float().cpu() for k, v in trainer.master.items()}
    save_checkpoint(dest, trainer.cfg, weights)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, dest / name)
    doc = {"schema": RECORD_SCHEMA, "created_at": lifecycle.utc_now(), "source_model": str(model_dir.resolve()),
           "sft_data": {"path": str(sft_jsonl.resolve()), "sha256": runs.file_sha256(sft_jsonl), "rows": len(train)},
           "heldout_data": {"path": str(heldout_jsonl.resolve()), "sha256": runs.file_sha256(heldout_jsonl),
                            "rows": len(held)},
           "config": asdict(cfg), "parameters": params, "train_seconds": round(train_seconds, 2),
           "train_tokens": tokens, "curve": curve, "evals": evals, "before": before, "after": after,
           "plan": "P/P (the local engine's production operators)", "optimizer": "AdamW, no weight decay, clip 1.0"}
    runs.write_json_atomic(dest / RECORD, doc)
    checkpoint_record(dest, trainer.cfg, weights, kind="warm start", source=str(model_dir.resolve()),
                      warmstart={"steps": cfg.steps, "before": _short(before), "after": _short(after)})
    return doc


def _short(ev: dict[str, Any]) -> dict[str, Any]:
    return {k: ev[k] for k in ("heldout_loss", "accuracy", "readable", "rows")}
