"""``Ops``: the local engine's operator table for one side, a client of :mod:`rlk_core.routes`.

Every floating-point operation of the model goes through an :class:`Ops` method that names its module
(``attention``, ``ffn``, ``logp``). Where the route layer says the module is ``R`` on this side, the
method runs ``routes.call(module, op, ...)`` (the rlk op, inside the recorder's scope, reporting its
backend and contract itself); for ``P`` it runs the production stand-in (``F.linear`` / SDPA /
``torch.log_softmax`` and the usual PyTorch RMSNorm, SiLU and RoPE formulas) and records
``production.torch*`` under the same op name.

The train side (Megatron stand-in) and the rollout side (vLLM stand-in) each get their own ``Ops``;
their attention cores and log-prob paths are different code: the train side runs packed varlen
attention and the fused ``linear_logprobs``; the rollout side writes a paged KV cache, runs paged
prefill / decode attention and computes log-probs from materialised logits after sampling.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.routes import SideRoutes

PRODUCTION = "production.torch"
PRODUCTION_SDPA = "production.torch.sdpa"


class Ops:
    """The operator table of one side (``train`` or ``rollout``) under one plan."""

    def __init__(self, plan: RoutePlan, side: str, recorder: ReadbackRecorder) -> None:
        self.routes = SideRoutes(plan, side, recorder)
        self.plan, self.side, self.rec = plan, side, recorder
        self.r = {m: self.routes.rlk(m) for m in ("attention", "ffn", "logp")}
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def _p(self, module: str, op: str, backend: str = PRODUCTION) -> None:
        self.routes.production(module, op, backend)

    # -- shared elementwise / GEMM ops ------------------------------------------------------------
    def linear(self, module: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if self.r[module]:
            return self.routes.call(module, "linear", x, w)
        self._p(module, "linear")
        return F.linear(x, w)

    def rms_norm(self, module: str, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if self.r[module]:
            return self.routes.call(module, "rms_norm", x, w, eps)
        self._p(module, "rms_norm")
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w.to(x.dtype) * xf.to(x.dtype)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        if self.r["ffn"]:
            return self.routes.call("ffn", "swiglu", x)
        self._p("ffn", "swiglu")
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def moe(self, x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
            normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts of one MoE block (the ``ffn`` module's MoE form, ``docs/ops/moe.md``) for ``x [T, H]``
        after the post-attention RMSNorm: ``(y [T, H], ids [T, k])``, ``router [E, H]``, ``w13 [E, 2I, H]``, ``w2
        [E, H, I]``. R: rlk's block (:func:`rlk_core.ops.moe.layer.moe_ffn`, contract ``rlk.moe.v1``); P: what a
        stock framework computes (:func:`native_moe`)."""
        if self.r["ffn"]:
            from rlk_core.ops.moe.layer import moe_ffn

            with self.routes.scope("ffn"):
                return moe_ffn(x, router, w13, w2, top_k, normalize)
        for op in ("linear", "moe_topk", "moe_grouped_linear", "moe_combine"):
            self._p("ffn", op)
        return native_moe(x, router, w13, w2, top_k, normalize)

    def rope(self, x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
        """x ``[T, H, D]`` rotated (rotate-half layout) at absolute ``positions`` ``[T]``."""
        if self.r["attention"]:
            return self.routes.call("attention", "rope", x, positions, theta)
        self._p("attention", "rope")
        d = x.shape[-1]
        inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.int64).float() / d))
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin

    # -- attention cores --------------------------------------------------------------------------
    def attention_varlen(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                         seq_lens: list[int], scale: float) -> torch.Tensor:
        """Train side: causal attention over packed sequences (q/k/v ``[T, H, D]``)."""
        if self.r["attention"]:
            return self.routes.call("attention", "attention_varlen", q, k, v, cu_seqlens, cu_seqlens, scale,
                                    causal=True)
        self._p("attention", "attention_varlen", PRODUCTION_SDPA)
        return _sdpa_packed_causal(q, k, v, seq_lens, scale)

    def kv_cache_write(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
        if self.r["attention"]:
            self.routes.call("attention", "kv_cache_write", k, v, k_cache, v_cache, slot_mapping)
            return
        self._p("attention", "kv_cache_write")
        hkv, d = k_cache.shape[-2:]
        k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v)

    def attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_table: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: list[int],
                         scale: float) -> torch.Tensor:
        """Rollout side: one new token per sequence (q ``[B, H, D]``) over its paged KV."""
        if self.r["attention"]:
            return self.routes.call("attention", "attention_decode", q, k_cache, v_cache, block_table, seq_lens,
                                    scale)
        self._p("attention", "attention_decode", PRODUCTION_SDPA)
        return _sdpa_paged_decode(q, k_cache, v_cache, block_table, seq_lens, max(seq_lens_host), scale)

    def attention_paged_prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                                q_lens_host: list[int], seq_lens_host: list[int], scale: float) -> torch.Tensor:
        """Rollout side: a (chunk of a) prompt per sequence; the new tokens are the last ``Lq`` positions."""
        if self.r["attention"]:
            return self.routes.call("attention", "attention_paged_prefill", q, k_cache, v_cache, block_table,
                                    cu_seqlens_q, seq_lens, scale)
        self._p("attention", "attention_paged_prefill", PRODUCTION_SDPA)
        outs, start = [], 0
        for b, (lq, n) in enumerate(zip(q_lens_host, seq_lens_host, strict=True)):
            k, v = _gather(k_cache, v_cache, block_table[b], n)
            outs.append(_sdpa(q[start : start + lq], k, v, scale, causal=True))
            start += lq
        return torch.cat(outs)

    # -- log-probs --------------------------------------------------------------------------------
    def kept_set(self, logits: torch.Tensor, params: list) -> tuple[torch.Tensor, Any]:
        """The processed logits (fp32 ``[B, V]``, ``logits / T`` with ``-inf`` outside each row's kept set) and the
        kept set for :meth:`token_logprobs` / :meth:`linear_logprobs`: rlk's threshold (``kept_set``, contract
        ``rlk.logp.processed.v1``) for R, the native filter's mask for P. ``params``: each row's
        ``SamplingParams`` (temperature, top_k, top_p, min_p)."""
        from rlk_repro.engine.sampling import filtered, native_processed

        temp = torch.tensor([p.temperature for p in params], device=logits.device, dtype=torch.float32)
        if not any(filtered(p) for p in params):  # nothing to keep out: the whole vocabulary, no kept set
            return logits.float() / temp[:, None], None
        if self.r["logp"]:
            kept = self.routes.call("logp", "kept_set", logits, temp, [p.top_k for p in params],
                                    [p.top_p for p in params], [p.min_p for p in params])
            return self.routes.call("logp", "apply_kept", logits, temp, kept), kept
        self._p("logp", "kept_set")
        z = native_processed(logits, params)
        return z, z != float("-inf")

    def token_logprobs(self, logits: torch.Tensor, target: torch.Tensor, temperature: float | torch.Tensor,
                       kept: Any = None) -> torch.Tensor:
        """Rollout side: log-prob of ``target`` under softmax(logits / T), from materialised logits; with ``kept``
        (from :meth:`kept_set`) over the kept set only (the processed log-prob)."""
        if self.r["logp"]:
            return self.routes.call("logp", "token_logprobs", logits, target, temperature, kept=kept)[0]
        self._p("logp", "token_logprobs")
        return _native_logprobs(logits, target, temperature, kept)

    def linear_logprobs(self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                        temperature: float, kept: Any = None) -> torch.Tensor:
        """Train side: LM head + log-softmax + selection (fused for R; full logits for P); with ``kept`` over the
        kept set only."""
        if self.r["logp"]:
            return self.routes.call("logp", "linear_logprobs", hidden, weight, target, temperature, kept=kept)[0]
        self._p("logp", "linear")
        logits = F.linear(hidden, weight)
        self._p("logp", "token_logprobs")
        return _native_logprobs(logits, target, temperature, kept)


def native_moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
               normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The production MoE block: the arithmetic of transformers' ``Qwen3MoeSparseMoeBlock`` (its eager experts)
    written out — the router ``F.linear``, an fp32 softmax, ``torch.topk`` (no tie order), the top-k weights
    renormalised and rounded to x's dtype, then per expert that received tokens ``F.linear`` over exactly those tokens
    (the BLAS kernel chosen by their count), SwiGLU, ``F.linear``, scaled by the weight and ``index_add_``-ed into the
    output in x's dtype (a rounding per slot, in expert order). Differentiable. Returns ``(y, ids)``."""
    num_experts = router.shape[0]
    probs = torch.softmax(F.linear(x, router), dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    with torch.no_grad():
        mask = F.one_hot(ids, num_classes=num_experts).permute(2, 1, 0)  # [E, k, T]
        hit = (mask.sum(dim=(1, 2)) > 0).nonzero().flatten().tolist()
    for e in hit:
        slot, tok = torch.where(mask[e])
        gate, up = F.linear(x[tok], w13[e]).chunk(2, dim=-1)
        o = F.linear(F.silu(gate) * up, w2[e]) * weights[tok, slot, None]
        out = out.index_add(0, tok, o.to(out.dtype))
    return out, ids


def _native_logprobs(logits: torch.Tensor, target: torch.Tensor, temperature, kept) -> torch.Tensor:
    t = temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature
    z = logits.float() / t
    if kept is not None:
        z = z.masked_fill(~kept, float("-inf"))
    return torch.log_softmax(z, dim=-1).gather(-1, target[:, None]).squeeze(-1)


def _gather(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, n: int):
    """The first ``n`` positions of one sequence's paged K/V, gathered contiguous ``[n, Hkv, D]``."""
    page = k_cache.shape[1]
    idx = blocks[: (n + page - 1) // page].long()
    hkv, d = k_cache.shape[-2:]
    return k_cache[idx].reshape(-1, hkv, d)[:n], v_cache[idx].reshape(-1, hkv, d)[:n]


def _heads_first(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[B, L, H, D]`` -> ``[B, H * rep, L, D]`` (GQA: each KV head repeated for its query heads)."""
    return (x.repeat_interleave(rep, dim=2) if rep > 1 else x).transpose(1, 2)


def _sdpa_packed_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int],
                        scale: float) -> torch.Tensor:
    """Production training attention: the packed sequences right-padded into one batch and one causal
    SDPA call (a padded key comes after every real query of its row, so ``is_causal`` alone masks it);
    padded rows are dropped again. Differentiable."""
    if not seq_lens:
        return q.new_empty(q.shape)
    b, lmax = len(seq_lens), max(seq_lens)
    lens = torch.tensor(seq_lens, device=q.device)
    valid = torch.arange(lmax, device=q.device)[None, :] < lens[:, None]  # [B, Lmax]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros((b, lmax, *x.shape[1:]))
        return out.masked_scatter(valid[..., None, None], x)

    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(_heads_first(pad(q), 1), _heads_first(pad(k), rep),
                                         _heads_first(pad(v), rep), is_causal=True, scale=scale)
    return out.transpose(1, 2)[valid]


def _sdpa_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """Production decode: every sequence's pages gathered into one padded ``[B, Lmax]`` K/V batch and one
    SDPA call with a key-padding mask (q ``[B, Hq, D]``)."""
    b, page = q.shape[0], k_cache.shape[1]
    npages = -(-max_len // page)
    idx = block_table[:, :npages].long()
    hkv, d = k_cache.shape[-2:]
    k = k_cache[idx].reshape(b, npages * page, hkv, d)[:, :max_len]
    v = v_cache[idx].reshape(b, npages * page, hkv, d)[:, :max_len]
    mask = torch.arange(max_len, device=q.device)[None, :] < seq_lens[:, None].long()  # [B, Lmax]
    rep = q.shape[1] // hkv
    out = F.scaled_dot_product_attention(q[:, :, None, :], _heads_first(k, rep), _heads_first(v, rep),
                                         attn_mask=mask[:, None, None, :], scale=scale)
    return out[:, :, 0, :]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    """Production attention: SDPA over contiguous K/V; q ``[Lq, Hq, D]`` are the last Lq positions of k."""
    lq, hq, _ = q.shape
    lk, hkv, _ = k.shape
    rep = hq // hkv
    qh = q.transpose(0, 1)[None]
    kh = k.repeat_interleave(rep, dim=1).transpose(0, 1)[None]
    vh = v.repeat_interleave(rep, dim=1).transpose(0, 1)[None]
    mask = None
    if causal and lq > 1:
        rows = torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        mask = torch.arange(lk, device=q.device)[None, :] <= rows
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    return out[0].transpose(0, 1).contiguous()
