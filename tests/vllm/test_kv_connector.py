"""The KV path of a Prefill/Decode split (issue 37) through vLLM 0.22's own shared-storage connector code.

vLLM's ``ExampleConnector`` moves a request's KV rows between engines as files (a byte copy), finding a token's row
by FlashAttention's layout. Measured here, on the CPU with vLLM's real connector: it round-trips FlashAttention's
``[2, B, N, H, D]`` cache bit for bit (the transport is lossless), and it cannot save rlk's ``[B, H, N, 2D]`` cache
(``IndexError``: it reads rlk's cache as ``[2, H * N, ...]``) — which is why an R/R P/D layout takes
``rlk_vllm_plugin.kv_connector.RlkSharedStorageConnector``, whose save and load here give the decode engine's cache
the prefill engine's bytes in other blocks, with every other slot untouched. (The whole two-engine run does not
start on this CPU install: vLLM's CPU worker needs compiled CPU ops the CUDA wheel lacks, pinned below; the two
engines on a GPU: ``tests/frameworks/pd_worker.py``.)"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.vllm,
              pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")]
vllm = pytest.importorskip("vllm")

B, N, H, D = 6, 16, 2, 8  # blocks, block size, KV heads, head size
LAYER = "model.layers.0.self_attn.attn"


def _connector(cls, tmp_path, role="kv_producer"):
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from rlk_vllm_plugin import kv_connector

    fields = kv_connector.kv_transfer_config(role, str(tmp_path))
    if cls.__name__ != kv_connector.CONNECTOR:  # one of vLLM's own, by its registered name
        fields = {**fields, "kv_connector": cls.__name__, "kv_connector_module_path": None}
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(**fields))
    vc.cache_config.block_size = N
    return cls(vc, KVConnectorRole.WORKER, None)


def _rlk_cache(values: torch.Tensor | None = None) -> torch.Tensor:
    """A layer cache as vLLM 0.22's runner allocates it for rlk's backend: the raw buffer viewed in the stride order's
    physical shape, permuted back to the logical ``[B, H, N, 2D]``."""
    from rlk_vllm_plugin import _compat

    shape, order = _compat.kv_cache_shape(B, N, H, D), _compat.KV_STRIDE_ORDER
    raw = torch.zeros(B * N * H * 2 * D, dtype=torch.bfloat16) if values is None else values
    return raw.view(tuple(shape[i] for i in order)).permute(*[order.index(i) for i in range(4)])


def _random(n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _rlk_metadata(slots: torch.Tensor):
    from rlk_vllm_plugin.attention import RlkAttentionMetadata

    return RlkAttentionMetadata(num_actual_tokens=len(slots), num_reqs=1, max_query_len=len(slots),
                                query_start_loc=torch.tensor([0, len(slots)], dtype=torch.int32),
                                seq_lens=torch.tensor([len(slots)], dtype=torch.int32),
                                block_table=torch.zeros(1, B, dtype=torch.int32), slot_mapping=slots)


def _meta(tokens: list[int], blocks: list[int], store: bool):
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnectorMetadata

    meta = ExampleConnectorMetadata()
    meta.add_request(tokens, blocks, N, store, [])
    return meta


def _forward_context(cache, attn):
    from types import SimpleNamespace

    from vllm.forward_context import ForwardContext

    # the connector reads a layer's `kv_cache` from the context's layers (vLLM's Attention layer holds it so)
    return ForwardContext(no_compile_layers={LAYER: SimpleNamespace(kv_cache=cache)}, attn_metadata={LAYER: attn},
                          slot_mapping={})


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def test_example_connector_round_trips_flash_attention_layout_bitwise(tmp_path):
    """The transport itself: FlashAttention's layout saved and loaded into other blocks, the bytes equal."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    tokens = list(range(100, 140))  # 40 tokens: the block-aligned prefix moved is 32 (2 blocks)
    src = _random(2 * B * N * H * D, 1).view(2, B, N, H, D)
    dst = torch.zeros_like(src)
    saver = _connector(ExampleConnector, tmp_path)
    saver.bind_connector_metadata(_meta(tokens, [3, 1, 4], store=True))
    saver.save_kv_layer(LAYER, src, object())  # any metadata but Triton / MLA: the FlashAttention path
    loader = _connector(ExampleConnector, tmp_path, "kv_consumer")
    loader.bind_connector_metadata(_meta(tokens, [0, 5, 2], store=False))
    loader.start_load_kv(_forward_context(dst, object()))
    assert torch.equal(_bits(dst[:, [0, 5]]), _bits(src[:, [3, 1]]))  # blocks 3, 1 -> 0, 5, every K and V byte
    assert not dst[:, [1, 2, 3, 4]].any()  # nothing else written (block 2 would be the third, unaligned, block)


def test_example_connector_cannot_save_rlk_layout(tmp_path):
    """The measured reason an R/R P/D layout cannot take vLLM's example connector: rlk's cache read as
    ``[2, H * N, ...]`` (32 rows here) has no row for slot 48."""
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    cache = _rlk_cache(_random(B * N * H * 2 * D, 2))
    saver = _connector(ExampleConnector, tmp_path)
    saver.bind_connector_metadata(_meta(list(range(100, 140)), [3, 1, 4], store=True))
    with pytest.raises(IndexError, match="out of bounds"):
        saver.save_kv_layer(LAYER, cache, _rlk_metadata(torch.arange(40)))


def test_rlk_connector_moves_rlk_layout_kv_bitwise(tmp_path):
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    from rlk_vllm_plugin import kv_connector

    cls = kv_connector.RlkSharedStorageConnector
    assert issubclass(cls, ExampleConnector) and cls.__name__ == kv_connector.CONNECTOR
    tokens = list(range(100, 140))
    src = _rlk_cache(_random(B * N * H * 2 * D, 3))
    saver = _connector(cls, tmp_path)
    saver.bind_connector_metadata(_meta(tokens, [3, 1, 4], store=True))
    saver.save_kv_layer(LAYER, src, _rlk_metadata(torch.arange(40)))
    dst = _rlk_cache()
    loader = _connector(cls, tmp_path, "kv_consumer")
    loader.bind_connector_metadata(_meta(tokens, [0, 5, 2], store=False))
    loader.start_load_kv(_forward_context(dst, _rlk_metadata(torch.arange(40))))
    # logical [B, H, N, 2D]: blocks 3, 1 of the prefill cache are blocks 0, 5 of the decode cache, byte for byte
    assert torch.equal(_bits(dst[[0, 5]]), _bits(src[[3, 1]]))
    assert not dst[[1, 2, 3, 4]].any()
    # negative control: the example connector's load into the same layout leaves the cache as it was (it writes into
    # a reshaped copy) or fails; either way the decode engine would not get the prefill engine's KV
    other = _rlk_cache()
    plain = _connector(ExampleConnector, tmp_path, "kv_consumer")
    plain.bind_connector_metadata(_meta(tokens, [0, 5, 2], store=False))
    try:
        plain.start_load_kv(_forward_context(other, _rlk_metadata(torch.arange(40))))
    except (IndexError, RuntimeError):
        pass
    assert not torch.equal(_bits(other[[0, 5]]), _bits(src[[3, 1]]))


def test_rlk_connector_refuses_a_file_of_another_shape(tmp_path):
    import safetensors.torch

    from rlk_vllm_plugin import kv_connector

    cls = kv_connector.RlkSharedStorageConnector
    tokens = list(range(100, 140))
    saver = _connector(cls, tmp_path)
    saver.bind_connector_metadata(_meta(tokens, [3, 1, 4], store=True))
    saver.save_kv_layer(LAYER, _rlk_cache(_random(B * N * H * 2 * D, 4)), _rlk_metadata(torch.arange(40)))
    path = saver._generate_filename_debug(LAYER, torch.tensor(tokens[:32]), [])
    safetensors.torch.save_file({"kv_cache": torch.zeros(32, H, 2 * D, dtype=torch.float16)}, path)
    loader = _connector(cls, tmp_path, "kv_consumer")
    loader.bind_connector_metadata(_meta(tokens, [0, 5, 2], store=False))
    with pytest.raises(RuntimeError, match="not converted"):
        loader.start_load_kv(_forward_context(_rlk_cache(), _rlk_metadata(torch.arange(40))))


def test_the_cpu_install_cannot_start_a_vllm_engine():
    """Why the two engines are not run here: vLLM's CPU worker starts with ``torch.ops._C.init_cpu_memory_env``
    (vllm/v1/worker/cpu_worker.py), a compiled CPU op that the CUDA wheel installed on this machine lacks
    (measured: ``LLM(...)`` fails in the worker with that AttributeError)."""
    import importlib.util
    from pathlib import Path

    import vllm._custom_ops  # noqa: F401  (loads vllm._C where it can be loaded)

    source = Path(importlib.util.find_spec("vllm.v1.worker.cpu_worker").origin).read_text(encoding="utf-8")
    assert "torch.ops._C.init_cpu_memory_env" in source
    assert not hasattr(torch.ops._C, "init_cpu_memory_env")


def test_the_plan_s_transfer_config_names_rlk_s_connector_to_vllm(capsys):
    """What ``rlk-repro plan --pd`` prints for each engine is a KVTransferConfig vLLM accepts, and vLLM's connector
    factory resolves it to rlk's class (as an engine's worker creates its connector)."""
    import json

    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from rlk_repro import cli
    from rlk_vllm_plugin import kv_connector

    assert cli.main(["plan", "--engine", "frameworks", "--model", "tiny", "--pd"]) == 0
    pd = json.loads(capsys.readouterr().out)["pd"]
    for role in ("prefill", "decode"):
        kt = KVTransferConfig(**pd[role]["kv_transfer_config"])
        assert kt.kv_role == pd[role]["kv_role"] and (kt.is_kv_producer, kt.is_kv_consumer) == (
            role == "prefill", role == "decode")
        assert KVConnectorFactory.get_connector_class(kt) is kv_connector.RlkSharedStorageConnector
