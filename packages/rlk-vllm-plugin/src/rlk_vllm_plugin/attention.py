"""The ``CUSTOM`` attention backend: rlk's paged attention on vLLM's own paged KV cache.

``register()`` calls :func:`install`, which registers :data:`BACKEND_PATH` under
``AttentionBackendEnum.CUSTOM`` (selected with ``--attention-backend CUSTOM``; VIME:
``--vllm-attention-backend CUSTOM``) and, when ``RL_KERNEL_VLLM_ATTENTION_OVERRIDE`` names an existing
backend, under that name too (for launchers that cannot pass flags).

KV layout (``shared/reference/vllm.md`` §5.3): the backend declares 0.22's shape / stride order and 0.33's
``LBNHC`` layout so both versions allocate the same tensor, logical ``[B, Hkv, N, 2D]`` over physical
``[B, N, Hkv, 2D]``; :func:`rlk_vllm_plugin._compat.split_kv` gives the strided ``[B, N, Hkv, D]`` K and V
views the rlk ops accept. The impl writes K/V with ``kv_cache_write`` and then runs ``attention_decode``
(a batch of single-token decodes) or ``attention_paged_prefill`` (anything else: prefill, chunked
prefill, mixed batches); under contract ``rlk.attention.v1`` both give the same bits for a token.

The vLLM classes are subclassed lazily (on first attribute access), so importing this module imports no
vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rlk_vllm_plugin import _compat, _runtime

BACKEND_PATH = "rlk_vllm_plugin.attention.RlkAttentionBackend"
BLOCK_SIZE_MULTIPLE = 16
_CLASSES: dict[str, type] = {}


@dataclass(frozen=True)
class RlkAttentionMetadata:
    """What the impl needs from one step's ``CommonAttentionMetadata`` (core fields of both versions).

    One object serves every layer of the step: the views the ops take (``req_*``: the first ``num_reqs``
    requests, ``token_slot_mapping``: the first ``num_actual_tokens`` slots) are sliced once, here, instead
    of once per layer. They are views of the tensors passed in (vLLM's persistent buffers), exactly the
    slices :func:`run` took before, so a CUDA graph captured with them replays with vLLM's updated values.
    Frozen: a field changed after construction would leave the views stale."""

    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32, including the new tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    req_query_start_loc: torch.Tensor = field(init=False, repr=False)  # query_start_loc[:num_reqs + 1]
    req_seq_lens: torch.Tensor = field(init=False, repr=False)  # seq_lens[:num_reqs]
    req_block_table: torch.Tensor = field(init=False, repr=False)  # block_table[:num_reqs]
    token_slot_mapping: torch.Tensor = field(init=False, repr=False)  # slot_mapping[:num_actual_tokens]
    decode: bool = field(init=False, repr=False)  # a batch of single-token decodes: attention_decode

    def __post_init__(self) -> None:
        n, b = self.num_actual_tokens, self.num_reqs
        views = {"req_query_start_loc": self.query_start_loc[: b + 1], "req_seq_lens": self.seq_lens[:b],
                 "req_block_table": self.block_table[:b], "token_slot_mapping": self.slot_mapping[:n],
                 "decode": self.max_query_len == 1 and n == b}
        for name, value in views.items():
            object.__setattr__(self, name, value)


def _build_classes() -> dict[str, type]:
    backend_mod = _compat.module("vllm.v1.attention.backend")
    impl = _impl_class(backend_mod.AttentionImpl)
    builder = _builder_class(backend_mod.AttentionMetadataBuilder, backend_mod.AttentionCGSupport)
    backend = _backend_class(backend_mod.AttentionBackend, backend_mod.MultipleOf, impl, builder)
    return {"RlkAttentionBackend": backend, "RlkAttentionMetadataBuilder": builder, "RlkAttentionImpl": impl}


def _backend_class(base_backend: type, multiple_of: Any, impl_cls: type, builder_cls: type) -> type:
    class RlkAttentionBackend(base_backend):
        """rlk's attention backend (contract ``rlk.attention.v1``)."""

        forward_includes_kv_cache_update = True
        accept_output_buffer = True
        supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]  # noqa: RUF012
        supported_kv_cache_dtypes = ["auto", "float16", "bfloat16"]  # noqa: RUF012

        @staticmethod
        def get_name() -> str:
            return "CUSTOM"

        @staticmethod
        def get_impl_cls():
            return impl_cls

        @staticmethod
        def get_builder_cls():
            return builder_cls

        # the KV layout shim: 0.22 reads these two ...
        @staticmethod
        def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                               cache_dtype_str: str = "auto") -> tuple[int, ...]:
            return _compat.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
            if include_num_layers_dimension:
                raise NotImplementedError("rlk attention: cross-layer KV layouts (KV connectors) are not supported")
            return _compat.KV_STRIDE_ORDER

        # ... 0.33 reads this one; both read the block sizes
        @classmethod
        def supported_kv_cache_layouts(cls):
            layout = _compat.kv_cache_layout_lbnhc()
            return None if layout is None else (layout,)

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list:
            return [multiple_of(BLOCK_SIZE_MULTIPLE)]

        @classmethod
        def supports_batch_invariance(cls) -> bool:
            return True

    return RlkAttentionBackend


def _builder_class(base_builder: type, cg: Any) -> type:
    class RlkAttentionMetadataBuilder(base_builder):
        # FULL_DECODE_ONLY graphs (uniform single-token decode batches); PIECEWISE graphs need nothing
        # from the builder. Mixed batches run attention eagerly between the pieces.
        _cudagraph_support = cg.UNIFORM_SINGLE_TOKEN_DECODE
        reorder_batch_threshold = None

        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)

        def build(self, common_prefix_len: int, common_attn_metadata, fast_build: bool = False):
            if common_prefix_len:
                raise NotImplementedError("rlk attention: cascade attention (common_prefix_len > 0) is not "
                                          "supported; it splits the KV reduction by batch composition")
            c = common_attn_metadata
            return RlkAttentionMetadata(
                num_actual_tokens=int(c.num_actual_tokens), num_reqs=int(c.num_reqs),
                max_query_len=int(c.max_query_len), query_start_loc=c.query_start_loc, seq_lens=c.seq_lens,
                block_table=c.block_table_tensor, slot_mapping=c.slot_mapping)

        def build_for_cudagraph_capture(self, common_attn_metadata):
            return self.build(0, common_attn_metadata)

        def use_cascade_attention(self, *args, **kwargs) -> bool:
            return False

    return RlkAttentionMetadataBuilder


def _impl_class(base_impl: type) -> type:
    class RlkAttentionImpl(base_impl):
        def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                     alibi_slopes=None, sliding_window=None, kv_cache_dtype: str = "auto",
                     logits_soft_cap=None, attn_type: str = "decoder", kv_sharing_target_layer_name=None,
                     **unsupported: Any) -> None:
            refused = {k: v for k, v in {
                "alibi_slopes": alibi_slopes, "sliding_window": sliding_window,
                "logits_soft_cap": logits_soft_cap or None,
                "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
                **{k: v for k, v in unsupported.items() if v not in (None, False, 0)}}.items() if v is not None}
            if str(getattr(attn_type, "value", attn_type)).lower() != "decoder":
                refused["attn_type"] = attn_type
            if kv_cache_dtype not in ("auto", "float16", "bfloat16"):
                refused["kv_cache_dtype"] = kv_cache_dtype
            if refused:
                raise NotImplementedError(f"rlk attention (causal decoder, plain KV cache) does not support {refused}")
            self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
            self.num_kv_heads = num_kv_heads or num_heads
            self.kv_cache_dtype = kv_cache_dtype
            self.attn_type = attn_type

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                    output_block_scale=None):
            if output_scale is not None or output_block_scale is not None:
                raise NotImplementedError("rlk attention: fused output quantization is not supported")
            if attn_metadata is None:  # vLLM's profiling run: no KV cache to read
                return output.fill_(0)
            return run(attn_metadata, self, query, key, value, kv_cache, output)

    return RlkAttentionImpl


def run(md: RlkAttentionMetadata, impl: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        kv_cache: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """One layer's attention for one step: write the new K/V into the paged cache, then attend."""
    n, d = md.num_actual_tokens, impl.head_size
    k_cache, v_cache = kv_views(kv_cache, d)
    q = _first(query, n).view(n, impl.num_heads, d)
    _runtime.rlk("attention", "kv_cache_write", _first(key, n).view(n, impl.num_kv_heads, d),
                 _first(value, n).view(n, impl.num_kv_heads, d), k_cache, v_cache, md.token_slot_mapping)
    if md.decode:
        out = _runtime.rlk("attention", "attention_decode", q, k_cache, v_cache, md.req_block_table,
                           md.req_seq_lens, impl.scale)
    else:
        out = _runtime.rlk("attention", "attention_paged_prefill", q, k_cache, v_cache, md.req_block_table,
                           md.req_query_start_loc, md.req_seq_lens, impl.scale)
    written = _first(output, n)
    written.copy_(out.view(written.shape))
    return output


def _first(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x[:n]``; ``x`` itself when it has exactly ``n`` rows (the same sizes, strides and storage offset)."""
    return x if x.shape[0] == n else x[:n]


def kv_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rlk_vllm_plugin._compat.split_kv` of ``kv_cache``, made once per KV-cache tensor: the views are
    kept on the tensor object (attribute ``_rlk_kv_views``), so they live exactly as long as vLLM keeps that
    tensor, and every layer's call of every step reuses them (views of the same storage: valid across
    CUDA-graph replays; a cache vLLM reallocates is a new tensor object, which gets its own)."""
    cached = getattr(kv_cache, "_rlk_kv_views", None)
    if cached is not None and cached[0] == head_size:
        return cached[1], cached[2]
    k_cache, v_cache = _compat.split_kv(kv_cache, head_size)
    kv_cache._rlk_kv_views = (head_size, k_cache, v_cache)
    return k_cache, v_cache


def __getattr__(name: str) -> Any:
    if name in ("RlkAttentionBackend", "RlkAttentionMetadataBuilder", "RlkAttentionImpl"):
        if not _CLASSES:
            _CLASSES.update(_build_classes())
        return _CLASSES[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(probe: _compat.Probe, override: str | None) -> list[str]:
    """Register the backend under ``CUSTOM`` (and ``override``); returns the member names registered."""
    registry = _compat.module("vllm.v1.attention.backends.registry")
    enum = registry.AttentionBackendEnum
    names = ["CUSTOM"] + ([override] if override else [])
    for name in names:
        member = getattr(enum, name, None)
        if member is None:
            raise RuntimeError(f"vLLM has no attention backend named {name!r}")
        registry.register_backend(member, BACKEND_PATH)
    __getattr__("RlkAttentionBackend")  # build the classes now: a vLLM mismatch surfaces in register()
    return names


def uninstall() -> None:
    registry = _compat.module("vllm.v1.attention.backends.registry")
    for member in list(registry._ATTN_OVERRIDES):
        if registry._ATTN_OVERRIDES[member] == BACKEND_PATH:
            member.clear_override()


def check_model(model: torch.nn.Module, rt: _runtime.Runtime) -> list[str]:
    """attention R: every attention layer of ``model`` must run rlk's impl (else the backend selection
    ignored ours). Returns the names of the attention layers checked."""
    if not rt.r("attention"):
        return []
    impl_cls = __getattr__("RlkAttentionImpl")
    names, wrong = [], []
    for name, layer in model.named_modules():
        impl = getattr(layer, "impl", None)
        if impl is None or not hasattr(layer, "attn_backend"):
            continue
        names.append(name)
        if not isinstance(impl, impl_cls):
            wrong.append(f"{name}: {type(impl).__name__}")
    if wrong:
        rt.violation("attention R, but vLLM selected another attention backend for " + ", ".join(wrong)
                     + " (launch with --attention-backend CUSTOM, or set RL_KERNEL_VLLM_ATTENTION_OVERRIDE)")
    return names
