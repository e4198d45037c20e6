"""The rollout engine (vLLM stand-in): paged KV cache, continuous batching, chunked prefill, sampling.

Each engine step schedules, vLLM-style, one token for every running request that is decoding and then
prompt chunks (at most ``chunk_size`` tokens per request, within the step's token budget) for requests
still in prefill; requests arrive at their own step and finish on EOS or their token limit, so the
batch changes from step to step. Attention of the step runs in two calls: paged decode for the
decoding requests and paged prefill for the prompt chunks, both over the same paged cache. Logits are
computed for each request whose known tokens are all in the cache; the next token is sampled from the
processed distribution (the kept set of its top-k / top-p / min-p: ``Ops.kept_set``) and its log-prob is
recorded by the ``logp`` module over the kept set (``processed``, vLLM's ``processed_logprobs``) or over the
whole vocabulary (``unfiltered``), as the engine's ``logprobs`` says.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from rlk_core.errors import RlkConfigError
from rlk_repro.engine.sampling import SamplingParams, draw_seed, race
from rlk_repro.model import qwen3
from rlk_repro.model.config import Qwen3Config
from rlk_repro.model.ops import Ops
from rlk_repro.model.weights import Weights


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    arrival_step: int = 0
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)  # of softmax(logits / T) where each token was sampled
    kept_sizes: list[int] = field(default_factory=list)  # the kept set's size where each token was sampled
    routing: list[torch.Tensor] = field(default_factory=list)  # MoE: each step's [n, layers, k] expert ids
    num_computed: int = 0  # tokens whose K/V are in the cache
    blocks: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def decoding(self) -> bool:
        return self.num_computed >= len(self.prompt)


@dataclass
class RolloutStats:
    steps: int = 0
    tokens: int = 0  # prompt + generated tokens run through the model
    generated: int = 0
    seconds: float = 0.0
    decode_calls: int = 0
    prefill_calls: int = 0
    chunked_prompts: int = 0  # prompts whose prefill took more than one step
    composition_changes: int = 0  # steps whose set of scheduled requests differs from the previous step's
    max_batch: int = 0
    # wall time of each step (a step that samples ends on the sampled tokens' read: a sync) and its tokens
    step_seconds: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    # of each step's wall time, the host's part before the first wait on the device: its inputs copied and every
    # layer queued (the rest is the wait for the layers, the LM head and sampling: the device's time shows there)
    step_launch_seconds: list[float] = field(default_factory=list)


LOGPROBS = ("processed", "unfiltered")  # the recorded log-prob: over the kept set, or over the whole vocabulary


class PagedKVCache:
    """Per layer ``k``/``v`` of ``[num_blocks, page_size, Hkv, D]`` with a free list of blocks.

    The free list starts in a seeded random order, so block tables are scattered from the first step.
    """

    def __init__(self, cfg: Qwen3Config, num_blocks: int, page_size: int, device: torch.device,
                 dtype: torch.dtype, seed: int = 0) -> None:
        shape = (num_blocks, page_size, cfg.num_key_value_heads, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.page_size, self.num_blocks = page_size, num_blocks
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)

    def reserve(self, req: Request, n_tokens: int) -> bool:
        need = -(-n_tokens // self.page_size) - len(req.blocks)
        if need > len(self.free):
            return False
        for _ in range(max(need, 0)):
            req.blocks.append(self.free.pop())
        return True

    def release(self, req: Request) -> None:
        self.free.extend(reversed(req.blocks))
        req.blocks = []


class RolloutEngine:
    def __init__(self, cfg: Qwen3Config, weights: Weights, ops: Ops, *, device: torch.device, dtype: torch.dtype,
                 page_size: int = 16, chunk_size: int = 16, max_num_seqs: int = 8,
                 max_batched_tokens: int | None = None, max_model_len: int = 512, seed: int = 0,
                 stop_token_ids: list[int] | None = None, logprobs: str = "processed") -> None:
        if ops.side != "rollout":
            raise RlkConfigError(f"the rollout engine needs rollout-side ops, got {ops.side!r}")
        if logprobs not in LOGPROBS:
            raise RlkConfigError(f"logprobs {logprobs!r} is not one of {', '.join(LOGPROBS)}")
        self.logprobs = logprobs
        for name, val in (("page_size", page_size), ("chunk_size", chunk_size), ("max_num_seqs", max_num_seqs)):
            if val < 1:
                raise RlkConfigError(f"{name} must be >= 1, got {val}")
        self.cfg, self.ops, self.device, self.dtype = cfg, ops, device, dtype
        self.chunk_size, self.max_num_seqs, self.max_model_len = chunk_size, max_num_seqs, max_model_len
        # a response ends at any of these (kept in the response, as vLLM keeps its EOS); default: the config's EOS
        self.stop_token_ids = frozenset(stop_token_ids) if stop_token_ids else frozenset({cfg.eos_token_id})
        self.max_batched_tokens = max_batched_tokens or (max_num_seqs + 2 * chunk_size)
        if self.max_batched_tokens < max_num_seqs + 1:
            raise RlkConfigError(f"max_batched_tokens={self.max_batched_tokens} must exceed "
                                 f"max_num_seqs={max_num_seqs}")
        blocks_per_seq = -(-max_model_len // page_size)
        self.cache = PagedKVCache(cfg, max_num_seqs * blocks_per_seq + 1, page_size, device, dtype, seed)
        self.weights: Weights = {}
        self.load_weights(weights)
        self.scale = cfg.head_dim**-0.5

    def load_weights(self, weights: Weights) -> bool:
        """Weight sync from the trainer: copy into the engine's own tensors; True when any bit changed."""
        changed = not self.weights
        for name, src in weights.items():
            src = src.detach().to(device=self.device, dtype=self.dtype)
            dst = self.weights.get(name)
            if dst is None:
                self.weights[name] = src.clone()
            else:
                if not changed and not torch.equal(dst.view(_int_dtype(dst.dtype)), src.view(_int_dtype(src.dtype))):
                    changed = True
                dst.copy_(src)
        return changed

    # -- the loop ---------------------------------------------------------------------------------
    def generate(self, requests: list[Request], on_token: Callable[[int], None] | None = None) -> RolloutStats:
        stats = RolloutStats()
        for r in requests:
            if len(r.prompt) + r.params.max_new_tokens > self.max_model_len:
                raise RlkConfigError(f"request {r.rid}: prompt ({len(r.prompt)}) + max_new_tokens "
                                     f"({r.params.max_new_tokens}) exceeds max_model_len={self.max_model_len}")
        waiting = sorted(requests, key=lambda r: (r.arrival_step, r.rid))
        running: list[Request] = []
        prefill_steps: dict[int, int] = {}
        last: tuple[int, ...] = ()
        step = 0
        t0 = time.perf_counter()
        while waiting or running:
            while waiting and waiting[0].arrival_step <= step and len(running) < self.max_num_seqs:
                running.append(waiting.pop(0))
            if not running:
                step = waiting[0].arrival_step
                continue
            batch = self._schedule(running)
            ids = tuple(r.rid for r, _ in batch)
            stats.composition_changes += ids != last
            last = ids
            stats.max_batch = max(stats.max_batch, len(batch))
            for r, _ in batch:
                if not r.decoding:
                    prefill_steps[r.rid] = prefill_steps.get(r.rid, 0) + 1
            t_step = time.perf_counter()
            sampled = self._step(batch, stats)
            stats.step_seconds.append(time.perf_counter() - t_step)
            stats.step_tokens.append(sum(n for _, n in batch))
            for r in sampled:
                if on_token is not None:
                    on_token(1)
                if r.output[-1] in self.stop_token_ids:
                    r.finish_reason = "eos"
                elif len(r.output) >= r.params.max_new_tokens:
                    r.finish_reason = "length"
                if r.finish_reason is not None:
                    self.cache.release(r)
                    running.remove(r)
            stats.steps += 1
            step += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        stats.chunked_prompts = sum(1 for n in prefill_steps.values() if n > 1)
        return stats

    def _schedule(self, running: list[Request]) -> list[tuple[Request, int]]:
        """Decodes first (one token each), then prompt chunks within the token budget."""
        budget = self.max_batched_tokens
        batch = []
        for r in running:
            if r.decoding and self.cache.reserve(r, r.num_computed + 1):
                batch.append((r, 1))
                budget -= 1
        for r in running:
            if r.decoding or budget <= 0:
                continue
            n = min(len(r.prompt) - r.num_computed, self.chunk_size, budget)
            if self.cache.reserve(r, r.num_computed + n):
                batch.append((r, n))
                budget -= n
        return batch

    @torch.no_grad()
    def _step(self, batch: list[tuple[Request, int]], stats: RolloutStats) -> list[Request]:
        t0 = time.perf_counter()
        cfg, ops, dev, page = self.cfg, self.ops, self.device, self.cache.page_size
        ids, pos, slots = [], [], []
        for r, n in batch:
            toks = r.tokens
            for p in range(r.num_computed, r.num_computed + n):
                ids.append(toks[p])
                pos.append(p)
                slots.append(r.blocks[p // page] * page + p % page)
        dec = [(r, n) for r, n in batch if r.decoding]
        pre = [(r, n) for r, n in batch if not r.decoding]
        nd = len(dec)
        ids_t = torch.tensor(ids, device=dev, dtype=torch.long)
        pos_t = torch.tensor(pos, device=dev, dtype=torch.long)
        slots_t = torch.tensor(slots, device=dev, dtype=torch.long)
        width = max(len(r.blocks) for r, _ in batch)
        seq_lens_host = [r.num_computed + n for r, n in batch]
        # the decode and the prefill halves' block tables and lengths each in their own tensor: a row slice of one
        # shared tensor starts at any 4-byte offset, a pointer the kernels (rlk.cuda's AOT variants as the JIT's)
        # specialise on (a misaligned one is another JIT binary: rlk.triton compiles it mid-run)
        tables = [torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r, _ in part], device=dev,
                               dtype=torch.int32) if part else None for part in (dec, pre)]
        lens = [torch.tensor(seq_lens_host[a:b], device=dev, dtype=torch.int32) if b > a else None
                for a, b in ((0, nd), (nd, len(batch)))]
        q_lens = [n for _, n in pre]
        cu_q = torch.tensor([0, *torch.tensor(q_lens, dtype=torch.int64).cumsum(0).tolist()], device=dev,
                            dtype=torch.int32)

        w = self.weights
        routing: list[torch.Tensor] | None = [] if cfg.is_moe else None
        h = qwen3.embed(w, ids_t)
        for layer in range(cfg.num_hidden_layers):
            q, k, v = qwen3.attention_qkv(ops, cfg, w, layer, h, pos_t)
            kc, vc = self.cache.k[layer], self.cache.v[layer]
            ops.kv_cache_write(k, v, kc, vc, slots_t)
            parts = []
            if dec:
                parts.append(ops.attention_decode(q[:nd], kc, vc, tables[0], lens[0], seq_lens_host[:nd],
                                                  self.scale))
            if pre:
                parts.append(ops.attention_paged_prefill(q[nd:], kc, vc, tables[1], cu_q, lens[1], q_lens,
                                                         seq_lens_host[nd:], self.scale))
            o = torch.cat(parts) if len(parts) > 1 else parts[0]
            h = h + qwen3.attention_out(ops, w, layer, o)
            h = h + qwen3.ffn(ops, cfg, w, layer, h, routing)
        if routing is not None:  # each token's experts at every layer, kept on the device (no sync here)
            chosen, start = torch.stack(routing, dim=1), 0
            for r, n in batch:
                r.routing.append(chosen[start:start + n])
                start += n
        stats.step_launch_seconds.append(time.perf_counter() - t0)
        stats.decode_calls += bool(dec)
        stats.prefill_calls += bool(pre)
        stats.tokens += len(ids)

        # logits for requests whose known tokens are now all in the cache
        rows, ready, offset = [], [], 0
        for r, n in batch:
            r.num_computed += n
            offset += n
            if r.num_computed == len(r.tokens):
                rows.append(offset - 1)
                ready.append(r)
        if not ready:
            return []
        hn = qwen3.final_norm(ops, cfg, w, h[torch.tensor(rows, device=dev)])
        logits = ops.linear("logp", hn, qwen3.lm_head_weight(w))
        params = [r.params for r in ready]
        z, kept = ops.kept_set(logits, params)
        tokens = race(z, [draw_seed(r.params.seed, r.rid, len(r.output)) for r in ready])
        target = torch.tensor(tokens, device=dev, dtype=torch.long)
        temp = torch.tensor([p.temperature for p in params], device=dev, dtype=torch.float32)
        if self.logprobs == "processed":
            logp = ops.token_logprobs(logits, target, temp, kept)
        else:
            logp = ops.token_logprobs(logits, target, temp)
        sizes = torch.isfinite(z).sum(-1).to(torch.float32)
        ent = entropy(logits, [r.params.temperature for r in ready])  # evidence only: never feeds a log-prob
        for r, tok, (lp, h, n) in zip(ready, tokens, torch.stack([logp, ent, sizes], 1).tolist(), strict=True):
            r.output.append(tok)
            r.logprobs.append(lp)
            r.entropies.append(h)
            r.kept_sizes.append(int(n))
        stats.generated += len(ready)
        return ready


def entropy(logits: torch.Tensor, temperatures: list[float]) -> torch.Tensor:
    """Entropy (nats, fp32) of ``softmax(logits / T)`` per row: how peaked the distribution sampled from was."""
    temp = torch.tensor(temperatures, device=logits.device, dtype=torch.float32)
    lsm = torch.log_softmax(logits.float() / temp[:, None], dim=-1)
    return -(lsm.exp() * lsm).sum(-1)


def _int_dtype(dtype: torch.dtype) -> torch.dtype:
    return {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
            torch.float64: torch.int64}[dtype]
