"""``RlkSharedStorageConnector``: vLLM's shared-storage KV connector, able to read and write rlk's KV layout.

A Prefill/Decode split (issue 37, ``rlk-repro plan --pd``) runs two vLLM engines: the prefill engine
(``kv_role="kv_producer"``) computes a prompt's KV cache and hands it to the decode engine
(``kv_role="kv_consumer"``), which samples the response. vLLM 0.22's ``ExampleConnector`` (the one connector of
0.22 that runs both engines on one GPU with no extra package or network: it writes each request's KV rows to
files with safetensors and reads them back, a byte copy) locates a token's KV row by assuming FlashAttention's
cache layout ``[2, num_blocks, block_size, Hkv, D]`` for every backend but Triton and MLA. rlk's ``CUSTOM``
backend (:mod:`rlk_vllm_plugin.attention`) keeps logical ``[B, Hkv, N, 2D]`` over physical ``[B, N, Hkv, 2D]``:
there the example connector's ``reshape(2, Hkv * N, -1)`` copies the cache, so a save indexes slots past its end
(``IndexError``, measured on the CPU: ``tests/vllm/test_kv_connector.py``) or reads other tokens' bytes, and a
load writes into the copy and leaves the cache as it was.

This connector keeps the example connector's scheduler side unchanged (which requests store or load, the
block-aligned prompt prefix it moves, the files keyed by the prompt's token ids) and replaces the two
layout-dependent steps when the step's attention metadata is rlk's: a token's KV row is ``[Hkv, 2D]`` of the
``[B * N, Hkv, 2D]`` view of the cache (a view: physical ``[B, N, Hkv, 2D]`` is contiguous), saved as it is and
written back in place, so the decode engine's cache holds the prefill engine's bytes exactly. A file whose shape
or dtype is not the cache's row is refused (no conversion). For any other backend (a ``P`` attention run) the
example connector's own code runs.

The example connector keys the files by the prompt's tokens only, not by the weights that computed them: a run
that updates the weights must clear the store at every weight sync (the P/D layout records it).

Selected with ``KVTransferConfig(kv_connector="RlkSharedStorageConnector",
kv_connector_module_path="rlk_vllm_plugin.kv_connector", kv_connector_extra_config={"shared_storage_path":
DIR})``. The class is built on first attribute access, so importing this module imports no vLLM.
"""

from __future__ import annotations

from typing import Any

from rlk_vllm_plugin import _compat

CONNECTOR = "RlkSharedStorageConnector"
MODULE_PATH = "rlk_vllm_plugin.kv_connector"
EXAMPLE = "vllm.distributed.kv_transfer.kv_connector.v1.example_connector"
_CLASSES: dict[str, type] = {}
# what this process's connectors moved of rlk's layout (the P/D worker reads it: the decode engine did load KV)
COUNTS = {"saved_rows": 0, "saved_files": 0, "loaded_rows": 0, "loaded_files": 0}


def kv_transfer_config(role: str, storage: str) -> dict[str, Any]:
    """The ``KVTransferConfig`` fields (``LLM(kv_transfer_config=...)``) of one engine of a P/D pair: ``role``
    ``kv_producer`` (prefill) or ``kv_consumer`` (decode), ``storage`` the directory both engines share."""
    if role not in ("kv_producer", "kv_consumer"):
        raise ValueError(f"a P/D engine's kv_role is kv_producer or kv_consumer, not {role!r}")
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": MODULE_PATH, "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def is_rlk_metadata(attn_metadata: Any) -> bool:
    """Whether a step's attention metadata (one object, or layer name -> object) is rlk's backend's, every layer."""
    from rlk_vllm_plugin.attention import RlkAttentionMetadata

    values = list(attn_metadata.values()) if isinstance(attn_metadata, dict) else [attn_metadata]
    return bool(values) and all(isinstance(v, RlkAttentionMetadata) for v in values)


def token_rows(kv_cache: Any) -> Any:
    """The ``[B * N, Hkv, 2D]`` view of an rlk layer cache (logical ``[B, Hkv, N, 2D]``): row ``s`` is slot ``s``'s
    K and V. Raises where the cache is not laid out as the rlk backend allocates it (a copy would lose writes)."""
    if kv_cache.dim() != 4:
        raise RuntimeError(f"rlk KV connector: a layer cache of rlk's backend is 4-D [B, Hkv, N, 2D], got shape "
                           f"{tuple(kv_cache.shape)}")
    by_token = kv_cache.transpose(1, 2)
    if not by_token.is_contiguous():
        raise RuntimeError(f"rlk KV connector: the layer cache's strides {kv_cache.stride()} are not rlk's physical "
                           "[B, N, Hkv, 2D] order; its token rows are not a view")
    b, n, h, c = by_token.shape
    return by_token.view(b * n, h, c)


def _build() -> type:
    base = _compat.module(EXAMPLE).ExampleConnector

    class RlkSharedStorageConnector(base):
        """vLLM's ``ExampleConnector`` with rlk's KV layout (:mod:`rlk_vllm_plugin.kv_connector`)."""

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            if not is_rlk_metadata(attn_metadata):
                return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)
            import safetensors.torch

            rows = token_rows(kv_layer)
            for req in self._get_connector_metadata().requests:
                if not req.is_store:
                    continue
                path = self._generate_filename_debug(layer_name, req.token_ids, req.mm_hashes)
                picked = rows[req.slot_mapping.to(rows.device)]
                safetensors.torch.save_file({"kv_cache": picked.detach().cpu().contiguous()}, path)
                COUNTS["saved_rows"] += int(picked.shape[0])
                COUNTS["saved_files"] += 1

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            attn = forward_context.attn_metadata
            if attn is None or not is_rlk_metadata(attn):
                return super().start_load_kv(forward_context, **kwargs)
            import safetensors.torch

            for req in self._get_connector_metadata().requests:
                if req.is_store:
                    continue
                for name, layer in forward_context.no_compile_layers.items():
                    cache = getattr(layer, "kv_cache", None)
                    if cache is None or (isinstance(attn, dict) and name not in attn):
                        continue
                    rows = token_rows(cache)
                    path = self._generate_filename_debug(name, req.token_ids, req.mm_hashes)
                    src = safetensors.torch.load_file(path, device=str(rows.device))["kv_cache"]
                    want = (len(req.slot_mapping), *rows.shape[1:])
                    if tuple(src.shape) != want or src.dtype != rows.dtype:
                        raise RuntimeError(f"rlk KV connector: {path} holds {src.dtype} {tuple(src.shape)}, the "
                                           f"cache's rows of layer {name} are {rows.dtype} {want}; not converted")
                    rows[req.slot_mapping.to(rows.device)] = src
                    COUNTS["loaded_rows"] += int(src.shape[0])
                    COUNTS["loaded_files"] += 1

    return RlkSharedStorageConnector


def __getattr__(name: str) -> Any:
    if name != CONNECTOR:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _CLASSES:
        _CLASSES[name] = _build()
    return _CLASSES[name]
