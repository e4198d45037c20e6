"""The frameworks engine's dump producers: forward hooks on real vLLM's and real megatron-core's Qwen3 modules that
fill the same :class:`~rlk_repro.attribute_dumps.Dump` the local engine's operator tap fills, so that
:func:`~rlk_repro.attribute_dumps.compare_dumps` walks a frameworks run unchanged.

One :class:`HookTap` per side. A forward of the model is framed by :meth:`HookTap.begin` (the ``(sequence,
position)`` key of every row the forward computes, and of every row its logits are taken at) and
:meth:`HookTap.end` (which files the rows of the selected sequences; a row computed twice keeps its last value).
Every captured tensor is made ``[rows, features]`` by the frame's ``flatten`` (vLLM's tokens are already rows;
Megatron's ``[s, b, ...]`` activations are turned batch-major and their padding dropped), and its features kept in the
order the local engine's points have them: Megatron's ``linear_qkv`` output, grouped by query group, is put back into
``[q; k; v]`` (:func:`megatron_qkv_rows`).

The points, per side (``docs/attribution.md``):

========================  =============================================  ===========================================
point                     vLLM ``Qwen3DecoderLayer``                     Megatron ``TransformerLayer``
========================  =============================================  ===========================================
``residual_in``           ``input_layernorm``'s residual (its input at   ``input_layernorm``'s input
                          layer 0, the fused add's sum after)
``attention.input_norm``  ``input_layernorm``                            ``input_layernorm``
``attention.qkv``         ``self_attn.qkv_proj``                         ``self_attention.linear_qkv`` (to [q; k; v])
``attention.q_norm`` /    ``self_attn.q_norm`` / ``k_norm``              ``self_attention.q_layernorm`` /
``k_norm``                                                               ``k_layernorm``
``attention.rope_q`` /    the attention layer's query / key inputs       ``core_attention``'s query / key inputs
``rope_k``                (``self_attn.attn``)                           (none under rlk's core attention, which
                                                                         applies RoPE inside: listed as missing)
``attention.core``        ``self_attn.attn``                             ``self_attention.core_attention``
``attention.o_proj``      ``self_attn.o_proj``                           ``self_attention.linear_proj``
``residual_mid``          ``post_attention_layernorm``'s residual        ``pre_mlp_layernorm``'s input
``ffn.post_norm``         ``post_attention_layernorm``                   ``pre_mlp_layernorm``
``ffn.gate_up``           ``mlp.gate_up_proj``                           ``mlp.linear_fc1``
``ffn.swiglu``            ``mlp.act_fn``                                 ``mlp.linear_fc2``'s input
``ffn.down``              ``mlp.down_proj``                              ``mlp.linear_fc2``
``final.residual`` /      ``model.norm``'s residual / output             ``decoder.final_layernorm``'s input /
``final.norm``                                                           output
``final.logits``          ``logits_processor`` (the logit rows)          ``output_layer`` (P ``logp``; an R one keeps
                                                                         no logits: the caller adds its GEMM's)
========================  =============================================  ===========================================

The ops each side ran at a point are named ``<framework>.<module class>`` (vLLM's attention: its impl's class). An
:class:`~rlk_repro.attribute_local.Injection` at a point hooked on a module's output replaces that output by one ulp
up, so the difference flows downstream as a real one would (the positive control); points read from a module's input
(``residual_*``, ``rope_*``, Megatron's ``ffn.swiglu``) are not injectable here.

Nothing here imports vLLM or megatron-core: the hooks go on the modules of a model the caller built.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlk_repro.attribute_dumps import Dump
from rlk_repro.attribute_local import Injection, _one_ulp_up

Rows = Callable[[torch.Tensor], torch.Tensor]


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


class HookTap:
    """Forward hooks of one side, filing what they see into ``dump`` (rows keyed ``(sequence, position)``)."""

    def __init__(self, side: str, dump: Dump, selected: set[int], injection: Injection | None = None,
                 framework: str = "") -> None:
        self.side, self.dump, self.selected, self.framework = side, dump, selected, framework
        self.injection = injection if injection is not None and injection.side == side else None
        self.injected = False
        self.handles: list[Any] = []
        self.layers_seen = 0
        self._token_keys: list[tuple[int, int]] = []
        self._logit_keys: list[tuple[int, int]] = []
        self._flatten: Rows = _flat
        self._pending: dict[str, list[tuple[str, torch.Tensor]]] = {}
        self._active = False

    # -- framing -----------------------------------------------------------------------------------------------
    def begin(self, token_keys: list[tuple[int, int]], logit_keys: list[tuple[int, int]],
              flatten: Rows | None = None) -> None:
        self._token_keys, self._logit_keys = list(token_keys), list(logit_keys)
        self._flatten = flatten or _flat
        self._pending, self._active = {}, True

    def end(self) -> None:
        self._active = False
        for label, parts in self._pending.items():
            if len(parts) != 1:
                raise RuntimeError(f"tap ({self.side}): point {label} was computed {len(parts)} times in one forward")
            op, keys, rows = parts[0]
            if keys:
                self.dump.add(label, {op}, keys, rows)
            if label.startswith("layers."):
                self.layers_seen = max(self.layers_seen, int(label.split(".")[1]) + 1)
        self._pending = {}

    def _kept_rows(self, label: str, n: int) -> tuple[list[tuple[int, int]], list[int]]:
        """The keys and row indices of the selected sequences' rows of an ``n``-row tensor at ``label``."""
        keys, wanted = self._token_keys, None
        if label == "final.logits":  # vLLM: one row per logit key; Megatron: every token's (keep the logit rows)
            wanted = set(self._logit_keys)
            if n == len(self._logit_keys):
                keys = self._logit_keys
        if n != len(keys):
            raise RuntimeError(f"tap ({self.side}): point {label} has {n} rows, the forward {len(self._token_keys)} "
                               f"token rows and {len(self._logit_keys)} logit rows")
        keep = [i for i, k in enumerate(keys) if k[0] in self.selected and (wanted is None or k in wanted)]
        return [keys[i] for i in keep], keep

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # -- hooks -------------------------------------------------------------------------------------------------
    def _put(self, label: str, op: str, t: torch.Tensor, flatten: bool = True) -> None:
        """File the selected rows of ``t`` now, as a copy: vLLM's fused add + RMSNorm writes its inputs in place
        (the residual and the previous layer's output), so a reference kept until :meth:`end` would change."""
        if self._active:
            rows = self._flatten(t.detach()) if flatten else _flat(t.detach())
            keys, keep = self._kept_rows(label, rows.shape[0])
            picked = rows.index_select(0, torch.tensor(keep, dtype=torch.long, device=rows.device))
            self._pending.setdefault(label, []).append((op, keys, picked.to("cpu", copy=True)))

    def _maybe_inject(self, label: str, t: torch.Tensor) -> torch.Tensor:
        if self._active and self.injection is not None and label == self.injection.label:
            self.injected = True
            return _one_ulp_up(t)
        return t

    def on_output(self, module: torch.nn.Module, label: str, pick: int | None = None, op: str | None = None,
                  convert: Rows | None = None, flatten: bool = True) -> None:
        """``label`` = the module's output (element ``pick`` of a tuple output), converted row-wise by ``convert``."""
        name = op or f"{self.framework}.{type(module).__name__}"

        def hook(mod, args, out):
            y = out if pick is None else out[pick]
            y = self._maybe_inject(label, y)
            rows_t = y if convert is None else convert(y)
            self._put(label, name, rows_t, flatten)
            if pick is None:
                return y
            return (*out[:pick], y, *out[pick + 1:])

        self.handles.append(module.register_forward_hook(hook))

    def on_qkv(self, module: torch.nn.Module, label: str, convert: Rows) -> None:
        """Megatron's ``linear_qkv``: its output ``[0]`` in Megatron's grouped order, put back into ``[q; k; v]`` by
        ``convert`` — unless it was asked for ``[q | k | v]`` columns already (rlk's attention calls
        ``RlkQKVLinear(x, rlk_qkv_order=True)``)."""
        name = f"{self.framework}.{type(module).__name__}"

        def hook(mod, args, kwargs, out):
            y = self._maybe_inject(label, out[0])
            self._put(label, name, y if kwargs.get("rlk_qkv_order") else convert(y))
            return (y, *out[1:])

        self.handles.append(module.register_forward_hook(hook, with_kwargs=True))

    def on_input(self, module: torch.nn.Module, labels: dict[str, int | str], op: str | None = None) -> None:
        """Each ``labels[label]`` = the module's positional input at that index (or keyword at that name)."""
        name = op or f"{self.framework}.{type(module).__name__}"

        def hook(mod, args, kwargs):
            for label, where in labels.items():
                t = kwargs.get(where) if isinstance(where, str) else (args[where] if len(args) > where else None)
                if t is None and isinstance(where, int):
                    t = kwargs.get(("query", "key", "value")[where]) if where < 3 else None
                if t is None:
                    raise RuntimeError(f"tap ({self.side}): {type(mod).__name__} got no input {where!r} for {label}")
                self._put(label, name, t)
            return None

        self.handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def on_norm_with_residual(self, module: torch.nn.Module, residual: str, normed: str) -> None:
        """vLLM's ``RMSNorm(x)`` (returns the norm; the residual is ``x``) or ``RMSNorm(x, residual)`` (returns
        ``(norm, x + residual)``: the residual stream is the fused add's sum)."""
        name = f"{self.framework}.{type(module).__name__}"

        def hook(mod, args, kwargs, out):
            if isinstance(out, tuple):
                y = self._maybe_inject(normed, out[0])
                self._put(residual, "residual", out[1])
                self._put(normed, name, y)
                return (y, *out[1:])
            x = args[0] if args else kwargs.get("x")
            self._put(residual, "residual", x)
            y = self._maybe_inject(normed, out)
            self._put(normed, name, y)
            return y

        self.handles.append(module.register_forward_hook(hook, with_kwargs=True))


# -- vLLM ------------------------------------------------------------------------------------------------------
def install_vllm(tap: HookTap, model: torch.nn.Module) -> int:
    """Hooks on a vLLM ``Qwen3ForCausalLM`` (``model.model.layers``, ``model.model.norm``,
    ``model.logits_processor``); returns the number of decoder layers hooked. The attention layer's op is named
    after its impl (``vllm.RlkAttentionImpl``, ``vllm.FlashAttentionImpl``, ...)."""
    tap.framework = "vllm"
    layers = list(model.model.layers)
    for i, layer in enumerate(layers):
        p = f"layers.{i}."
        a, m = layer.self_attn, layer.mlp
        attn_op = f"vllm.{type(getattr(a.attn, 'impl', a.attn)).__name__}"
        tap.on_norm_with_residual(layer.input_layernorm, p + "residual_in", p + "attention.input_norm")
        tap.on_output(a.qkv_proj, p + "attention.qkv", pick=0)
        tap.on_output(a.q_norm, p + "attention.q_norm")
        tap.on_output(a.k_norm, p + "attention.k_norm")
        tap.on_input(a.attn, {p + "attention.rope_q": 0, p + "attention.rope_k": 1}, op=attn_op)
        tap.on_output(a.attn, p + "attention.core", op=attn_op)
        tap.on_output(a.o_proj, p + "attention.o_proj", pick=0)
        tap.on_norm_with_residual(layer.post_attention_layernorm, p + "residual_mid", p + "ffn.post_norm")
        tap.on_output(m.gate_up_proj, p + "ffn.gate_up", pick=0)
        tap.on_output(m.act_fn, p + "ffn.swiglu")
        tap.on_output(m.down_proj, p + "ffn.down", pick=0)
    tap.on_norm_with_residual(model.model.norm, "final.residual", "final.norm")
    tap.on_output(model.logits_processor, "final.logits")
    return len(layers)


def vllm_step_keys(req_seq: list[int | None], query_start_loc: list[int], positions: list[int]
                   ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """One vLLM forward's row keys: ``req_seq[b]`` the sequence of the batch's request ``b`` (None: not one of the
    replay's, e.g. a warm-up request: its rows get sequence -1 and are never kept), its tokens
    ``query_start_loc[b]:query_start_loc[b + 1]`` at ``positions``; one logit row per request, at its last
    scheduled token (vLLM computes logits there whether or not it samples: a partial prefill chunk's is dropped
    later)."""
    tokens, logits = [], []
    for b, s in enumerate(req_seq):
        seq = -1 if s is None else s
        lo, hi = query_start_loc[b], query_start_loc[b + 1]
        tokens += [(seq, positions[t]) for t in range(lo, hi)]
        if hi > lo:
            logits.append((seq, positions[hi - 1]))
    return tokens, logits


# -- Megatron --------------------------------------------------------------------------------------------------
def megatron_qkv_rows(cfg) -> Rows:
    """Megatron's ``linear_qkv`` output rows (per query group ``g``: its ``Hq/Hkv`` query heads, then its key and
    its value head) as ``[q; k; v]`` (vLLM's and the local engine's order), TP 1."""
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    r = hq // hkv

    def convert(y: torch.Tensor) -> torch.Tensor:
        g = y.reshape(*y.shape[:-1], hkv, (r + 2) * d)
        q, k, v = g.split([r * d, d, d], dim=-1)
        return torch.cat([q.reshape(*y.shape[:-1], hq * d), k.reshape(*y.shape[:-1], hkv * d),
                          v.reshape(*y.shape[:-1], hkv * d)], dim=-1)

    return convert


def install_megatron(tap: HookTap, model: torch.nn.Module, cfg, logits: bool) -> int:
    """Hooks on a megatron-core ``GPTModel`` (``model.decoder.layers``, ``model.decoder.final_layernorm``, and
    ``model.output_layer`` when ``logits``: a P ``logp`` materialises them; an R one returns the hidden states);
    returns the number of layers hooked."""
    tap.framework = "megatron"
    layers = list(model.decoder.layers)
    qkv = megatron_qkv_rows(cfg)
    for i, layer in enumerate(layers):
        p = f"layers.{i}."
        a, m = layer.self_attention, layer.mlp
        tap.on_input(layer.input_layernorm, {p + "residual_in": 0}, op="residual")
        tap.on_output(layer.input_layernorm, p + "attention.input_norm")
        tap.on_qkv(a.linear_qkv, p + "attention.qkv", qkv)
        tap.on_output(a.q_layernorm, p + "attention.q_norm")
        tap.on_output(a.k_layernorm, p + "attention.k_norm")
        core_op = f"megatron.{type(a.core_attention).__name__}"
        if not getattr(a.core_attention, "apply_rope", False):  # rlk's core attention applies RoPE itself: no point
            tap.on_input(a.core_attention, {p + "attention.rope_q": 0, p + "attention.rope_k": 1}, op=core_op)
        tap.on_output(a.core_attention, p + "attention.core", op=core_op)
        tap.on_output(a.linear_proj, p + "attention.o_proj", pick=0)
        tap.on_input(layer.pre_mlp_layernorm, {p + "residual_mid": 0}, op="residual")
        tap.on_output(layer.pre_mlp_layernorm, p + "ffn.post_norm")
        tap.on_output(m.linear_fc1, p + "ffn.gate_up", pick=0)
        tap.on_input(m.linear_fc2, {p + "ffn.swiglu": 0}, op=f"megatron.{type(m).__name__}.activation")
        tap.on_output(m.linear_fc2, p + "ffn.down", pick=0)
    tap.on_input(model.decoder.final_layernorm, {"final.residual": 0}, op="residual")
    tap.on_output(model.decoder.final_layernorm, "final.norm")
    if logits:
        tap.on_output(model.output_layer, "final.logits", pick=0)
    return len(layers)


def megatron_rows(lens: list[int], batch: int) -> Rows:
    """``[s, b, ...]`` activations (or THD's ``[t, ...]`` / ``[t, 1, ...]``) of one Megatron forward as one row per
    real token, sample by sample: sbhd (``batch`` = the number of samples, right-padded) takes sample ``i``'s first
    ``lens[i]`` positions of column ``i``; THD (``batch`` = 1) is already packed in sample order."""
    total, s_max = sum(lens), max(lens)

    def rows(t: torch.Tensor) -> torch.Tensor:
        if batch == 1:
            if t.shape[0] != total:
                raise RuntimeError(f"tap: a THD activation of {t.shape[0]} rows, the forward packs {total} tokens")
            return t.reshape(total, -1)
        if tuple(t.shape[:2]) != (s_max, batch):
            raise RuntimeError(f"tap: an sbhd activation of shape {tuple(t.shape)}, expected [{s_max}, {batch}, ...]")
        bm = t.transpose(0, 1).reshape(batch, s_max, -1)
        return torch.cat([bm[i, :n] for i, n in enumerate(lens)])

    return rows


def megatron_keys(seqs: list[int], lens: list[int], prompt_lens: list[int]
                  ) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The row keys of one Megatron forward over samples ``seqs`` (each ``lens[i]`` = prompt + response - 1 input
    tokens), and its log-prob rows (positions ``prompt - 1 ..``)."""
    tokens = [(s, p) for s, n in zip(seqs, lens, strict=True) for p in range(n)]
    logit = [(s, p) for s, n, lp in zip(seqs, lens, prompt_lens, strict=True) for p in range(lp - 1, n)]
    return tokens, logit
