"""Each hook on its own: OOT dispatch per op, the linear / LM-head methods by prefix, the attention backend's
registration and KV-shim arithmetic, the log-prob hook and its strict refusals. Bitwise means torch.equal."""

import pytest
import torch

pytestmark = [
    pytest.mark.vllm,
    # vLLM 0.22 (written for torch 2.11) uses torch.jit.script_method while importing; torch 2.13 deprecates it
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@pytest.mark.parametrize("method", ["forward_native", "forward_cpu", "forward_cuda"])
def test_oot_rms_norm_runs_rlk_for_r_and_vllm_for_p(plugin, vllm_config, method):
    from vllm.model_executor.layers.layernorm import RMSNorm

    from rlk_core.ops import rms_norm

    rt = plugin(attention="P/R", ffn="P/P")
    norm = RMSNorm(64, eps=1e-6)
    assert type(norm).__name__ == "RlkRMSNorm" and isinstance(norm, RMSNorm)
    norm.weight.data = _bf16(64, seed=1)
    x, res = _bf16(7, 64), _bf16(7, 64, seed=2)
    norm._rlk_module = "attention"
    out, new_res = getattr(norm, method)(x, res)
    assert torch.equal(new_res, x + res) and torch.equal(out, rms_norm(x + res, norm.weight.data, 1e-6))
    assert torch.equal(getattr(norm, method)(x), rms_norm(x, norm.weight.data, 1e-6))
    norm._rlk_module = "ffn"  # P: vLLM's own method, counted once per call of the layer
    assert torch.equal(norm.forward_native(x), RMSNorm.forward_native(norm, x))
    dispatched = norm._forward_method.__name__
    assert torch.equal(norm(x), getattr(RMSNorm, dispatched)(norm, x))
    ops = rt.recorder.to_dict()["modules"]
    assert ops["attention"]["implementation"] == "rlk" and ops["attention"]["ops"]["rms_norm"]["call_count"] == 2
    assert ops["ffn"]["ops"]["rms_norm"]["backend_id"] == "production.vllm.RMSNorm"
    assert ops["ffn"]["ops"]["rms_norm"]["call_count"] == 1


def test_unbound_norm_is_refused_in_strict_mode(plugin, vllm_config):
    from vllm.model_executor.layers.layernorm import RMSNorm

    from rlk_core.errors import RlkPolicyError

    plugin(ffn="P/R")
    with pytest.raises(RlkPolicyError, match="before rlk-vllm-plugin bound it"):
        RMSNorm(64).forward_native(_bf16(3, 64))


def test_oot_silu_and_mul_and_rope(plugin, vllm_config):
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from rlk_core.ops import rope, swiglu

    plugin(attention="P/R", ffn="P/R")
    act = SiluAndMul()
    act._rlk_module = "ffn"
    x = _bf16(5, 2 * 48)
    assert torch.equal(act.forward_native(x), swiglu(x)) and torch.equal(act.forward_cpu(x), swiglu(x))
    emb = get_rope(16, max_position=512, is_neox_style=True, rope_parameters={"rope_theta": 10000.0},
                   dtype=torch.bfloat16)
    assert type(emb).__name__ == "RlkRotaryEmbedding"
    pos = torch.tensor([0, 3, 9, 200, 511])
    q, k = _bf16(5, 4 * 16, seed=3), _bf16(5, 2 * 16, seed=4)
    q2, k2 = emb.forward_native(pos, q, k)
    assert torch.equal(q2, rope(q.view(5, 4, 16), pos, 10000.0).view(5, 64))
    assert torch.equal(k2, rope(k.view(5, 2, 16), pos, 10000.0).view(5, 32))


def test_linear_and_lm_head_methods_route_by_prefix(plugin):
    import torch.nn.functional as F
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from rlk_core.ops import linear

    rt = plugin(attention="P/P", ffn="P/R", logp="P/R")
    x, w = _bf16(6, 64), _bf16(96, 64, seed=5)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    layer.prefix = "model.layers.1.mlp.gate_up_proj"
    assert torch.equal(UnquantizedLinearMethod().apply(layer, x), linear(x, w))
    layer.prefix = "model.layers.1.self_attn.qkv_proj"  # attention is P: vLLM's own CPU GEMM runs
    layer.cpu_linear = lambda x_, w_, b_: F.linear(x_, w_, b_)  # what vLLM's CPU weight processing sets
    assert torch.equal(UnquantizedLinearMethod().apply(layer, x), F.linear(x, w))
    assert torch.equal(UnquantizedEmbeddingMethod().apply(layer, x), linear(x, w))
    mods = rt.recorder.to_dict()["modules"]
    assert mods["ffn"]["ops"]["linear"]["backend_id"].startswith("rlk.")
    assert mods["logp"]["ops"]["linear"]["backend_id"].startswith("rlk.")
    assert mods["attention"]["ops"]["linear"]["backend_id"] == "production.vllm.UnquantizedLinearMethod.apply"
    layer.prefix = "model.layers.1.mystery_proj"
    from rlk_core.errors import RlkPolicyError
    with pytest.raises(RlkPolicyError, match="belongs to no rlk module"):
        UnquantizedLinearMethod().apply(layer, x)


def test_an_emptied_vllm_weight_is_refused_and_a_loaded_one_runs_rlk(plugin):
    # vLLM's weights are parameter subclasses (ModelWeightParameter, with a __torch_function__): the emptiness
    # check (CPU weight packing) reads them without it and must still see both cases
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.model_executor.parameter import ModelWeightParameter

    from rlk_core.errors import RlkPolicyError
    from rlk_core.ops import linear

    plugin(ffn="P/R", logp="P/R")
    x, w = _bf16(6, 64), _bf16(96, 64, seed=5)
    layer = torch.nn.Module()
    def vllm_weight(data):  # the parameter object alone (its __init__ asks for a TP group)
        return ModelWeightParameter.__new__(ModelWeightParameter, data=data)

    layer.weight = vllm_weight(w)
    assert type(layer.weight).__torch_function__ is not torch.nn.Parameter.__torch_function__
    layer.prefix = "model.layers.1.mlp.gate_up_proj"
    assert torch.equal(UnquantizedLinearMethod().apply(layer, x), linear(x, w))
    assert torch.equal(UnquantizedEmbeddingMethod().apply(layer, x), linear(x, w))
    layer.weight = vllm_weight(torch.empty(0, dtype=torch.bfloat16))
    with pytest.raises(RlkPolicyError, match="replaced the weight"):
        UnquantizedLinearMethod().apply(layer, x)
    with pytest.raises(RlkPolicyError, match="replaced the weight"):
        UnquantizedEmbeddingMethod().apply(layer, x)


def test_vllm_weight_parameters_take_the_direct_path(plugin, monkeypatch):
    """vLLM's weight parameters forward ``__torch_function__`` untouched, so once the plugin registers them an
    eager rlk call with one skips the dispatcher (host time only: the same result); a class that overrides
    ``__torch_function__`` again is not registered (control)."""
    import vllm.model_executor.parameter as vparam

    from rlk_core.ops import _dispatch, linear
    from rlk_vllm_plugin import layers

    monkeypatch.setattr(_dispatch, "PLAIN", {torch.Tensor, torch.nn.Parameter})
    x = _bf16(6, 64)
    w = vparam.ModelWeightParameter.__new__(vparam.ModelWeightParameter, data=_bf16(96, 64, seed=5))
    assert _dispatch._how((x, w, None)) == _dispatch.DISPATCHER
    before = linear(x, w)

    class Wrapping(vparam.ModelWeightParameter):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs)

    monkeypatch.setattr(vparam, "Wrapping", Wrapping, raising=False)
    types = layers.plain_weight_types()
    assert vparam.ModelWeightParameter in types and vparam.PackedvLLMParameter in types and Wrapping not in types
    assert _dispatch._how((x, w, None)) == _dispatch.DIRECT
    assert torch.equal(linear(x, w), before)
    with pytest.raises(TypeError, match="tensor types"):
        _dispatch.treat_as_plain(int)


def test_bind_model_notes_each_linear_module_once(plugin):
    """After model load the linear method reads the module bound to the layer (no regex per call); the
    binding is what decides (a wrong binding routes wrongly: the negative control)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from rlk_core.ops import linear
    from rlk_vllm_plugin import layers

    rt = plugin(attention="P/P", ffn="P/R", logp="P/P")
    x, w = _bf16(6, 64), _bf16(96, 64, seed=5)
    model = torch.nn.Module()
    model.down = torch.nn.Module()
    model.down.weight = torch.nn.Parameter(w, requires_grad=False)
    model.down.prefix, model.down.quant_method = "model.layers.0.mlp.down_proj", UnquantizedLinearMethod()
    layers.bind_model(model)
    assert model.down._rlk_linear_module == "ffn"
    assert torch.equal(model.down.quant_method.apply(model.down, x), linear(x, w))
    model.down.prefix = "model.layers.0.self_attn.o_proj"  # the binding, not the prefix, decides now
    model.down.quant_method.apply(model.down, x)
    assert rt.recorder.to_dict()["modules"]["ffn"]["ops"]["linear"]["call_count"] == 2
    model.down._rlk_linear_module = "attention"  # a wrong binding: attention is P, vLLM's own GEMM runs
    model.down.cpu_linear = lambda x_, w_, b_: torch.nn.functional.linear(x_, w_, b_)
    model.down.quant_method.apply(model.down, x)
    assert rt.recorder.to_dict()["modules"]["attention"]["ops"]["linear"]["backend_id"].startswith("production.")


# -- attention ---------------------------------------------------------------------------------------
def test_custom_backend_is_registered_and_batch_invariant(plugin):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin(attention="P/R", RL_KERNEL_VLLM_ATTENTION_OVERRIDE="FLASH_ATTN")
    for member in (AttentionBackendEnum.CUSTOM, AttentionBackendEnum.FLASH_ATTN):
        cls = member.get_class()
        assert cls.__name__ == "RlkAttentionBackend" and cls.supports_batch_invariance()
        assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
    assert AttentionBackendEnum.TRITON_ATTN.get_class().__name__ != "RlkAttentionBackend"


def _allocate_like_vllm_022(backend, num_blocks, block_size, heads, d, dtype=torch.bfloat16):
    shape = backend.get_kv_cache_shape(num_blocks, block_size, heads, d)
    order = backend.get_kv_cache_stride_order()
    raw = torch.zeros(num_blocks * block_size * heads * 2 * d, dtype=dtype)
    return raw, raw.view([shape[i] for i in order]).permute(*[order.index(i) for i in range(4)])


def test_kv_shim_gives_0_33s_layout_and_the_writes_land_where_vllm_expects(plugin):
    from rlk_core.ops import kv_cache_write
    from rlk_vllm_plugin import _compat

    plugin(attention="P/R")
    from rlk_vllm_plugin.attention import RlkAttentionBackend
    raw, kv = _allocate_like_vllm_022(RlkAttentionBackend, 10, 16, 2, 8)
    assert kv.shape == (10, 2, 16, 16) and kv.stride() == (512, 16, 32, 1)  # 0.33's LBNHC, measured (§5.3)
    with pytest.raises(NotImplementedError):
        RlkAttentionBackend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    k_cache, v_cache = _compat.split_kv(kv, 8)
    assert k_cache.shape == (10, 16, 2, 8) and k_cache.stride() == (512, 32, 16, 1)
    k, v = _bf16(3, 2, 8, seed=6), _bf16(3, 2, 8, seed=7)
    slots = torch.tensor([37, 5, 159])
    kv_cache_write(k, v, k_cache, v_cache, slots)
    phys = raw.view(10, 16, 2, 16)  # [block, token, head, K|V]
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(phys[s // 16, s % 16, :, :8], k[i]) and torch.equal(phys[s // 16, s % 16, :, 8:], v[i])
    assert int((raw != 0).sum()) == int((k != 0).sum() + (v != 0).sum())


def test_impl_prefill_chunk_then_decode_equals_varlen_attention(plugin):
    from rlk_core.ops import attention_varlen
    from rlk_vllm_plugin.attention import RlkAttentionMetadata

    plugin(attention="P/R")
    from rlk_vllm_plugin.attention import RlkAttentionBackend, RlkAttentionImpl
    hq, hkv, d, n = 4, 2, 16, 16
    impl = RlkAttentionImpl(hq, d, d**-0.5, hkv)
    _, kv = _allocate_like_vllm_022(RlkAttentionBackend, 6, n, hkv, d)
    L = 23
    q, k, v = _bf16(L, hq, d, seed=8), _bf16(L, hkv, d, seed=9), _bf16(L, hkv, d, seed=10)
    table = torch.tensor([[4, 1, 0]], dtype=torch.int32)
    out = torch.empty(L, hq, d, dtype=torch.bfloat16)
    for a, b in ((0, 9), (9, 21), (21, 22), (22, 23)):
        slots = torch.tensor([int(table[0, p // n]) * n + p % n for p in range(a, b)])
        md = RlkAttentionMetadata(b - a, 1, b - a, torch.tensor([0, b - a], dtype=torch.int32),
                                  torch.tensor([b], dtype=torch.int32), table, slots)
        impl.forward(None, q[a:b], k[a:b], v[a:b], kv, md, out[a:b])
    cu = torch.tensor([0, L], dtype=torch.int32)
    assert torch.equal(out, attention_varlen(q, k, v, cu, cu, d**-0.5, causal=True))


def _same_view(a, b):
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(), b.dtype)


@pytest.mark.parametrize("n,b,max_q", [(9, 3, 5), (3, 3, 1), (4, 3, 2), (1, 1, 1)],
                         ids=["prefill", "decode", "mixed", "one"])
def test_metadata_slices_once_per_step_what_run_sliced_per_layer(n, b, max_q):
    # the views run() passes to the ops are made when the step's metadata is built: the same storage, shapes
    # and strides as the per-layer slices of the persistent (padded) buffers they replace
    import dataclasses

    from rlk_vllm_plugin.attention import RlkAttentionMetadata

    qsl, seq_lens = torch.arange(8, dtype=torch.int32), torch.arange(1, 8, dtype=torch.int32)
    table, slots = torch.arange(7 * 4, dtype=torch.int32).view(7, 4), torch.arange(16)
    md = RlkAttentionMetadata(n, b, max_q, qsl, seq_lens, table, slots)
    assert _same_view(md.req_query_start_loc, qsl[: b + 1]) and _same_view(md.req_seq_lens, seq_lens[:b])
    assert _same_view(md.req_block_table, table[:b]) and _same_view(md.token_slot_mapping, slots[:n])
    assert md.decode == (max_q == 1 and n == b)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a changed field would leave the views stale
        md.num_reqs = b + 1


def test_kv_views_are_split_kv_made_once_per_cache_tensor(plugin):
    from rlk_vllm_plugin import _compat
    from rlk_vllm_plugin.attention import kv_views

    plugin(attention="P/R")
    from rlk_vllm_plugin.attention import RlkAttentionBackend
    _, kv = _allocate_like_vllm_022(RlkAttentionBackend, 5, 16, 2, 8)
    k, v = kv_views(kv, 8)
    want_k, want_v = _compat.split_kv(kv, 8)
    assert _same_view(k, want_k) and _same_view(v, want_v)
    assert kv_views(kv, 8)[0] is k and kv_views(kv, 8)[1] is v  # reused by every layer call of every step
    _, other = _allocate_like_vllm_022(RlkAttentionBackend, 5, 16, 2, 8)  # a new cache tensor: its own views
    assert _same_view(kv_views(other, 8)[0], _compat.split_kv(other, 8)[0])


def test_impl_on_padded_buffers_writes_only_the_actual_tokens(plugin):
    # vLLM pads the token dimension (CUDA-graph sizes): run() reads and writes the first n rows only
    from rlk_vllm_plugin.attention import RlkAttentionMetadata

    plugin(attention="P/R")
    from rlk_vllm_plugin.attention import RlkAttentionBackend, RlkAttentionImpl
    hq, hkv, d, n = 4, 2, 16, 16
    impl = RlkAttentionImpl(hq, d, d**-0.5, hkv)
    table = torch.tensor([[3, 1], [0, 2], [4, 5]], dtype=torch.int32)
    q, k, v = _bf16(8, hq * d, seed=1), _bf16(8, hkv * d, seed=2), _bf16(8, hkv * d, seed=3)
    slots = torch.tensor([3 * n, 3 * n + 1, 3 * n + 2, 0, 0, 0, 0, 0])
    md = RlkAttentionMetadata(3, 1, 3, torch.tensor([0, 3, 3, 3], dtype=torch.int32),
                              torch.tensor([3, 0, 0], dtype=torch.int32), table, slots)
    outs = []
    for pad in (8, 3):  # padded buffers, and buffers of exactly n rows
        _, kv = _allocate_like_vllm_022(RlkAttentionBackend, 6, n, hkv, d)
        out = torch.full((pad, hq * d), 7.0, dtype=torch.bfloat16)
        impl.forward(None, q[:pad], k[:pad], v[:pad], kv, md, out)
        assert torch.equal(out[3:], torch.full((pad - 3, hq * d), 7.0, dtype=torch.bfloat16))
        outs.append((out[:3].clone(), kv.clone()))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


# -- log-probs ---------------------------------------------------------------------------------------
def test_logprob_hook_is_rlk_token_logprobs_with_the_request_temperature(plugin):
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu.sample import logprob

    from rlk_core.ops import token_logprobs
    from rlk_vllm_plugin import logprobs

    plugin(logp="P/R")
    logits = _bf16(5, 1000, seed=11) * 4
    temp = torch.tensor([1.0, 0.7, 1.3, 0.25, 2.0])
    ids = torch.tensor([[3, 17], [999, 0], [512, 4], [7, 7], [100, 900]])
    token = logprobs._STEP.set({"logits": logits, "temperature": temp, "kept": None})
    try:
        got = logprob.compute_token_logprobs(logits.float() / temp[:, None], ids)  # processed logits are ignored
    finally:
        logprobs._STEP.reset(token)
    want = torch.stack([token_logprobs(logits, ids[:, j], temp)[0] for j in range(2)], dim=1)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # outside a sampling step (prompt log-probs): temperature 1 on the given logits
    assert torch.equal(logprob.compute_token_logprobs(logits, ids[:, :1])[:, 0], token_logprobs(logits, ids[:, 0])[0])
    # negative control: vLLM's own path is different code (a Triton kernel, not runnable here) and its V1
    # full log_softmax does not give the same bits
    assert logprob.compute_token_logprobs._rlk_original is not logprobs.token_logprobs_hook
    v1 = Sampler.compute_logprobs._rlk_original(logits.float() / temp[:, None]).gather(1, ids)
    assert not torch.equal(v1, want)


def test_logit_processors_are_refused_and_filters_served(plugin, monkeypatch):
    """top-k / top-p / min-p and greedy requests are served under logp R (contract rlk.logp.processed.v1);
    penalties, logit bias, bad words, allowed ids and min_tokens change the logits before the kept set and are
    refused in strict mode for requests that ask for log-probs."""
    from vllm import SamplingParams

    from rlk_core.errors import RlkPolicyError
    from rlk_vllm_plugin import _runtime, logprobs

    plugin(logp="P/R")
    rt = _runtime.current()
    for sp in (SamplingParams(temperature=1.0, logprobs=0), SamplingParams(top_p=0.9, top_k=20, min_p=0.05, logprobs=0),
               SamplingParams(temperature=0.0, logprobs=0), SamplingParams(presence_penalty=0.5)):  # last: no logprobs
        logprobs.check_request(sp, rt)
    for sp, what in ((SamplingParams(presence_penalty=0.5, logprobs=0), "presence_penalty=0.5"),
                     (SamplingParams(repetition_penalty=1.1, logprobs=0), "repetition_penalty=1.1"),
                     (SamplingParams(min_tokens=3, logprobs=0), "min_tokens=3"),
                     (SamplingParams(logit_bias={3: 1.0}, logprobs=0), "logit_bias")):
        with pytest.raises(RlkPolicyError, match=what):
            logprobs.check_request(sp, rt)
    # vLLM's own start-up warms the sampler with every processor on: that request is not refused, a user's
    # request with the same parameters is
    warmup = SamplingParams.for_sampler_warmup()
    logprobs.check_request(warmup, rt)
    user = SamplingParams(**{k: getattr(warmup, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                                              "presence_penalty", "logprobs")})
    if user.presence_penalty:
        with pytest.raises(RlkPolicyError, match="presence_penalty"):
            logprobs.check_request(user, rt)


class _Uva:
    """The ``.np`` / ``.gpu`` pair of vLLM's ``UvaBackedTensor`` (UVA is unavailable on the CPU, so the real
    ``SamplingStates`` cannot be built here; the GPU frameworks suite runs the real one)."""

    def __init__(self, values, dtype):
        import numpy as np

        self.np = np.asarray(values)
        self.gpu = torch.tensor(values, dtype=dtype)


def _apply_sampling_params(sampler, logits, n: int):
    """``Sampler.apply_sampling_params`` with the installed vLLM's arguments by name (0.22 and 0.33 differ)."""
    import inspect

    import numpy as np
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    zeros = torch.zeros(n, dtype=torch.long)
    values = {"logits": logits, "expanded_idx_mapping": torch.arange(n), "idx_mapping": torch.arange(n),
              "idx_mapping_np": np.arange(n), "pos": zeros, "input_ids": zeros, "expanded_local_pos": zeros,
              "seq_lens_upper_bound_np": np.full(n, 64)}
    names = list(inspect.signature(Sampler.apply_sampling_params._rlk_original).parameters)[1:]
    return Sampler.apply_sampling_params(sampler, **{k: values[k] for k in names if k in values})


def _sampler_with(temperature, top_k, top_p, min_p):
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.sample.sampler import Sampler

    sampler = object.__new__(Sampler)  # the real class and its (patched) methods; states below
    sampler.sampling_states = SimpleNamespace(temperature=_Uva(temperature, torch.float32),
                                              top_k=_Uva(top_k, torch.int32), top_p=_Uva(top_p, torch.float32),
                                              min_p=_Uva(min_p, torch.float32))
    return sampler


def test_filtered_sampling_step_is_rlk_processed_logprobs(plugin):
    """Under logp R the MRv2 sampler's processing is contract rlk.logp.processed.v1: the processed logits are
    rlk's ``apply_kept`` of each row's kept set, and the returned log-probs rlk's processed ``token_logprobs`` —
    bit for bit what a trainer computes from the same logits with the same parameters (its own kept sets). A
    greedy row takes T = 1. Negative control: vLLM's own top-k/top-p (``apply_top_k_top_p``) + log-softmax is
    not those bits."""
    import numpy as np
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p
    from vllm.v1.worker.gpu.sample import logprob

    from rlk_core.ops import apply_kept, kept_set, token_logprobs
    from rlk_vllm_plugin import logprobs

    plugin(logp="P/R")
    v = 1000
    logits = _bf16(4, v, seed=5) * 4
    temps, ks, ps, ms = [0.7, 1.0, 0.0, 1.3], [40, v, 5, v], [0.95, 0.9, 1.0, 1.0], [0.0, 0.0, 0.0, 0.05]
    sampler = _sampler_with(temps, ks, ps, ms)
    _mapping, _mapping_np = torch.arange(4), np.arange(4)
    token = logprobs._STEP.set({"logits": logits, "temperature": torch.ones(4), "kept": None})
    try:
        z = _apply_sampling_params(sampler, logits, 4)
        step = logprobs._STEP.get()
        ids = torch.stack([z.argmax(-1), torch.tensor([0, 1, 2, 3])], 1)  # the argmax is kept; the others may not be
        got = logprob.compute_token_logprobs(z, ids)
    finally:
        logprobs._STEP.reset(token)
    t_eff = torch.tensor([0.7, 1.0, 1.0, 1.3])
    want_k = kept_set(logits, t_eff, [40, 0, 5, 0], ps, ms)  # the trainer's own kept sets from the same logits
    assert torch.equal(step["kept"].value, want_k.value) and torch.equal(step["kept"].token_id, want_k.token_id)
    assert torch.equal(z, apply_kept(logits, t_eff, want_k))
    want = torch.stack([token_logprobs(logits, ids[:, j], t_eff, kept=want_k)[0] for j in range(2)], 1)
    assert torch.equal(got, want)
    assert bool(torch.isfinite(got[:, 0]).all()) and int(want_k.size[2]) == 5
    # negative control: vLLM's own filter and log-softmax on the same logits (top-k/top-p rows)
    x = logits.float() / t_eff[:, None]
    native = apply_top_k_top_p(x.clone(), torch.tensor([40, v, 5, v]), torch.tensor(ps))
    native_lp = torch.log_softmax(native, -1).gather(1, ids[:, :1])[:, 0]
    assert not torch.equal(native_lp[:2], got[:2, 0])
    torch.testing.assert_close(native_lp[:2], got[:2, 0], rtol=1e-4, atol=1e-4)  # the same semantics


def test_a_step_without_filters_takes_the_unfiltered_op(plugin):
    """No row filters: the processed logits are z = x / T and the log-probs rlk's unfiltered token_logprobs (the
    same distribution; no kept-set pass over the logits)."""
    from vllm.v1.worker.gpu.sample import logprob

    from rlk_core.ops import token_logprobs
    from rlk_vllm_plugin import logprobs

    plugin(logp="P/R")
    logits = _bf16(3, 400, seed=7) * 4
    sampler = _sampler_with([1.0, 0.8, 0.0], [400, 400, 400], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    token = logprobs._STEP.set({"logits": logits, "temperature": torch.ones(3), "kept": None})
    try:
        z = _apply_sampling_params(sampler, logits, 3)
        assert logprobs._STEP.get()["kept"] is None
        ids = z.argmax(-1)[:, None]
        got = logprob.compute_token_logprobs(z, ids)[:, 0]
    finally:
        logprobs._STEP.reset(token)
    t = torch.tensor([1.0, 0.8, 1.0])
    assert torch.equal(z, logits.float() / t[:, None])
    assert torch.equal(got, token_logprobs(logits, ids[:, 0], t)[0])


def test_unfiltered_opt_in_returns_full_vocabulary_logprobs(plugin):
    from vllm.v1.worker.gpu.sample import logprob

    from rlk_core.ops import token_logprobs
    from rlk_vllm_plugin import logprobs

    plugin(logp="P/R", RL_KERNEL_VLLM_UNFILTERED_LOGPROBS="1")
    logits = _bf16(2, 500, seed=6) * 4
    sampler = _sampler_with([1.0, 0.8], [10, 500], [1.0, 0.5], [0.0, 0.0])
    token = logprobs._STEP.set({"logits": logits, "temperature": torch.ones(2), "kept": None})
    try:
        z = _apply_sampling_params(sampler, logits, 2)
        ids = z.argmax(-1)[:, None]
        got = logprob.compute_token_logprobs(z, ids)[:, 0]
    finally:
        logprobs._STEP.reset(token)
    assert torch.equal(got, token_logprobs(logits, ids[:, 0], torch.tensor([1.0, 0.8]))[0])


def test_rope_tables_are_reserved_for_the_model_length_when_attention_is_r(plugin, monkeypatch):
    """vLLM captures rope in its CUDA graphs; rlk reserves the cos/sin table for max_position_embeddings
    when the model is bound (a rope call under capture cannot size its table)."""
    import importlib

    from rlk_vllm_plugin import layers

    rope_mod = importlib.import_module("rlk_core.ops.rope")  # the module (rlk_core.ops.rope is also the op)
    seen = []
    monkeypatch.setattr(rope_mod, "reserve_tables", lambda *a: seen.append(a))
    plugin(attention="P/R")
    cls = layers.oot_classes(None)["RotaryEmbedding"]
    rope = cls.__new__(cls)
    torch.nn.Module.__init__(rope)
    rope._rlk_op, rope.rotary_dim, rope.base, rope.max_position_embeddings = "rope", 64, 1e6, 40960
    model = torch.nn.Module()
    model.rotary_emb = rope
    layers.bind_model(model)
    assert seen == [(torch.device("cpu"), 64, 1e6, 40960)]


def test_v1_runner_logprobs_are_refused_under_logp_r(plugin):
    from vllm.v1.sample.sampler import Sampler

    from rlk_core.errors import RlkPolicyError

    plugin(logp="P/R")
    with pytest.raises(RlkPolicyError, match="V1 runner"):
        Sampler.compute_logprobs(torch.zeros(2, 8))


def test_sampler_add_request_checks_the_request_with_the_installed_vllms_arguments(plugin):
    """vLLM's Model Runner V2 calls ``Sampler.add_request(req_idx, prompt_len, sampling_params)`` in 0.22 and
    ``add_request(req_idx, sampling_params)`` in 0.33: the wrapper finds the request's parameters by name and
    passes every argument through unchanged."""
    import inspect
    from unittest import mock

    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    from rlk_core.errors import RlkPolicyError

    plugin(logp="P/R")
    names = list(inspect.signature(Sampler.add_request._rlk_original).parameters)[1:]  # as the runner calls it
    assert names[0] == "req_idx" and names[-1] == "sampling_params", names

    def call(sp):
        stub = mock.MagicMock()
        Sampler.add_request(stub, *[{"req_idx": 3, "prompt_len": 11, "sampling_params": sp}[n] for n in names])
        return stub

    with pytest.raises(RlkPolicyError, match="presence_penalty=0.5"):
        call(SamplingParams(presence_penalty=0.5, logprobs=0))
    sp = SamplingParams(temperature=0.8, logprobs=0)
    stub = call(sp)  # accepted: vLLM's own add_request ran with the same arguments
    stub.sampling_states.add_request.assert_called_once_with(3, sp)
    stub.logprob_token_ids_state.add_request.assert_called_once_with(3, sp)


def _add_requests(*params):
    """Each ``SamplingParams`` through the plugin's ``Sampler.add_request`` with the installed vLLM's arguments (the
    sampler's states are a mock: UVA tensors cannot be built on the CPU); returns the mocks vLLM's own method filled."""
    import inspect
    from unittest import mock

    from vllm.v1.worker.gpu.sample.sampler import Sampler

    names = list(inspect.signature(Sampler.add_request._rlk_original).parameters)[1:]
    stubs = []
    for i, sp in enumerate(params):
        stubs.append(mock.MagicMock())
        Sampler.add_request(stubs[-1], *[{"req_idx": i, "prompt_len": 7, "sampling_params": sp}[n] for n in names])
    return stubs


def _sampling_note(tmp_path):
    """The flushed readback's ``annotations.sampling`` (the run directory is ``tmp_path``, the readbacks under
    ``readbacks/<hostname>/``) and rlk-validate's findings on it (bitwise equality required)."""
    import json
    import socket

    import jsonschema

    import rlk_vllm_plugin
    from rlk_core.readback import schema
    from rlk_validate.greedy import check_greedy
    from rlk_validate.readbacks import _validate_doc
    from rlk_validate.safeio import Root

    rlk_vllm_plugin.flush()
    (path,) = (tmp_path / "readbacks" / socket.gethostname()).glob("vllm-rollout-*.json")
    doc = json.loads(path.read_text())
    jsonschema.validate(doc, schema())
    assert _validate_doc(doc, path.name) is None  # rlk-validate reads it (torch-free rules)
    findings = check_greedy(Root(tmp_path, check="run"), None, require_exact=True)
    return doc.get("annotations", {}).get("sampling"), [(f.code, f.severity) for f in findings]


def test_greedy_requests_are_served_and_marked_not_comparable_in_the_readback(plugin, tmp_path):
    """Issue 40: under logp R a greedy request (temperature 0) asking for log-probs is served, not refused — its row
    of a sampling step is vLLM's greedy semantics (T = 1) — and the process's readback counts the requests its
    sampler took (``annotations.sampling``: greedy / sampled, with log-probs) and marks the log-probs it served
    ``comparable: false`` with the reason. vLLM's own sampler warm-up is left out. Real vLLM SamplingParams and
    Sampler methods; the readback is what rlk-validate reads."""
    import numpy as np
    from vllm import SamplingParams

    from rlk_core.ops import token_logprobs
    from rlk_vllm_plugin import logprobs

    plugin(logp="P/R", RL_KERNEL_READBACK_DIR=str(tmp_path / "readbacks"))
    greedy, sampled = SamplingParams(temperature=0.0, logprobs=0), SamplingParams(temperature=0.8, logprobs=0)
    stubs = _add_requests(SamplingParams.for_sampler_warmup(), greedy)
    stubs[1].sampling_states.add_request.assert_called_once_with(1, greedy)  # vLLM's own add_request ran
    note, findings = _sampling_note(tmp_path)
    assert note["counts"] == {"greedy": 1, "greedy_with_logprobs": 1} and note["comparable"] is False
    assert findings == [("GREEDY_NOT_COMPARABLE", "error")]  # greedy only: the compared log-probs are argmax ones
    _add_requests(sampled, SamplingParams(temperature=0.0))
    note, findings = _sampling_note(tmp_path)
    assert note["counts"] == {"greedy": 2, "greedy_with_logprobs": 1, "sampled": 1, "sampled_with_logprobs": 1}
    assert note["comparable"] is False and "argmax" in note["reason"] and "Sampler.add_request" in note["counted"]
    assert findings == [("GREEDY_NOT_COMPARABLE", "warning")]  # beside a sampled request: an evaluation pass?
    # the greedy row of a step is served at T = 1 (its processed logits and log-probs are those of the raw logits)
    logits = _bf16(2, 64, seed=9) * 4
    sampler = _sampler_with([0.0, 0.8], [64, 64], [1.0, 1.0], [0.0, 0.0])
    token = logprobs._STEP.set({})
    try:
        z = _apply_sampling_params(sampler, logits, 2)
        ids = z.argmax(-1, keepdim=True)
        got = logprobs.token_logprobs_hook(z, ids)[:, 0]
    finally:
        logprobs._STEP.reset(token)
    assert torch.equal(z[0], logits[0].float()) and np.isfinite(got.numpy()).all()
    assert torch.equal(got[0], token_logprobs(logits[:1], ids[:1, 0], 1.0)[0][0])


def test_a_process_that_served_sampled_requests_only_has_no_greedy_mark(plugin, tmp_path):
    """The negative control, under logp P (the requests are counted for every plan): sampled requests only leave
    ``comparable: true`` and no greedy count; the first greedy request asking for log-probs flips the mark."""
    from vllm import SamplingParams

    plugin(logp="P/P", RL_KERNEL_READBACK_DIR=str(tmp_path / "readbacks"))
    _add_requests(SamplingParams.for_sampler_warmup(), SamplingParams(temperature=1.0, logprobs=0),
                  SamplingParams(temperature=1e-6, logprobs=0),  # not 0 in float32: MRv2 draws (Gumbel)
                  SamplingParams(temperature=0.7))
    note, findings = _sampling_note(tmp_path)
    assert note["counts"] == {"sampled": 3, "sampled_with_logprobs": 2} and note["comparable"] is True
    assert note["reason"] is None and findings == []
    _add_requests(SamplingParams(temperature=0.0, logprobs=0))
    note, findings = _sampling_note(tmp_path)
    assert note["counts"]["greedy_with_logprobs"] == 1 and note["comparable"] is False
    assert findings == [("GREEDY_NOT_COMPARABLE", "warning")]


def test_kept_export_writes_the_threshold_each_sampled_token_was_drawn_under(plugin, tmp_path):
    """RL_KERNEL_VLLM_KEPT_EXPORT=1: a sampling step under logp R appends one record per sampled token beside the
    readbacks — the request, position and token, the kept set's threshold (exact bits) and size, greedy rows
    marked not comparable — and the threshold read back is bit for bit the kept set the trainer finds from the same
    logits (what the Megatron provider takes as ``metadata["rlk_kept"]``). Real vLLM InputBatch / SamplerOutput /
    Sampler methods; the step runs through the plugin's ``Sampler.__call__`` wrapper."""
    import json

    from vllm.v1.outputs import SamplerOutput
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from rlk_core.ops import kept_set
    from rlk_vllm_plugin import logprobs

    plugin(logp="P/R", RL_KERNEL_VLLM_KEPT_EXPORT="1", RL_KERNEL_READBACK_DIR=str(tmp_path))
    v = 1000
    logits = _bf16(3, v, seed=11) * 4
    temps, ks, ps, ms = [0.7, 0.0, 1.3], [40, v, v], [0.95, 1.0, 0.9], [0.0, 0.0, 0.05]
    sampler = _sampler_with(temps, ks, ps, ms)
    batch = InputBatch.make_dummy(3, 12, InputBuffers(3, 12, torch.device("cpu")))
    batch.positions.copy_(torch.arange(12) % 4 + 7)  # each request's last input token at position 10

    def step(self, logits_, input_batch):  # what vLLM's Sampler.__call__ does around apply_sampling_params
        z = _apply_sampling_params(self, logits_, 3)
        return SamplerOutput(sampled_token_ids=z.argmax(-1, keepdim=True).to(torch.int32), logprobs_tensors=None)

    out = logprobs._sampler_call(step)(sampler, logits, batch)
    files = list(tmp_path.rglob("rlk-kept-*.jsonl"))
    assert len(files) == 1
    recs = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert [r["req_id"] for r in recs] == batch.req_ids and [r["pos"] for r in recs] == [11, 11, 11]
    assert [r["token"] for r in recs] == out.sampled_token_ids[:, 0].tolist()
    assert [(r["greedy"], r["comparable"]) for r in recs] == [(False, True), (True, False), (False, True)]
    want = kept_set(logits, torch.tensor([0.7, 1.0, 1.3]), [40, 0, 0], ps, ms)
    value = torch.tensor([float.fromhex(r["value_hex"]) for r in recs], dtype=torch.float32)
    assert torch.equal(value, want.value) and [r["token_id"] for r in recs] == want.token_id.tolist()
    assert [r["size"] for r in recs] == want.size.tolist() and recs[1]["value"] is None and recs[1]["size"] == v
    # negative control: the threshold of the same logits at the untempered scale is not what was sampled under
    assert not torch.equal(kept_set(logits, 1.0, [40, 0, 0], ps, ms).value, value)
    # a second step appends
    logprobs._sampler_call(step)(sampler, logits, batch)
    assert len(files[0].read_text().splitlines()) == 6


def test_processed_logits_are_finite_exactly_on_the_kept_set(plugin):
    """vLLM >= 0.28's ``return_sampling_mask`` takes each token's support as ``isfinite(processed_logits)`` after
    sampling (its docs, "How it works"); under logp R the processed logits are rlk's ``apply_kept``, so that support
    is exactly rlk's kept set — the set the trainer's own ``kept_set`` finds — with ties, a -inf logit (vocab
    padding) and a greedy row. Negative control: vLLM's own top-k / top-p support differs on a tied row."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    from rlk_core.ops import kept_set
    from rlk_core.ops.kept_set import kept_mask
    from rlk_vllm_plugin import logprobs

    plugin(logp="P/R")
    v = 512
    logits = _bf16(4, v, seed=13) * 4
    logits[1, :64] = logits[1].max()  # a tie at the top-k boundary: 64 equal maxima, top-k 40
    logits[2, -8:] = float("-inf")  # vocab padding
    temps, ks, ps, ms = [0.8, 1.0, 1.0, 0.0], [40, 40, v, 5], [0.95, 1.0, 0.9, 1.0], [0.0, 0.0, 0.05, 0.0]
    sampler = _sampler_with(temps, ks, ps, ms)
    token = logprobs._STEP.set({})
    try:
        z = _apply_sampling_params(sampler, logits, 4)
    finally:
        logprobs._STEP.reset(token)
    t_eff = torch.tensor([0.8, 1.0, 1.0, 1.0])
    want = kept_set(logits, t_eff, [40, 40, 0, 5], ps, ms)
    support = torch.isfinite(z)
    assert torch.equal(support, kept_mask(logits, t_eff, want) & torch.isfinite(logits))
    assert support.sum(-1).tolist() == want.size.tolist()
    assert support[1].nonzero()[:, 0].tolist() == list(range(40))  # ties kept by id ascending, exactly top_k
    native = torch.isfinite(apply_top_k_top_p(logits.float()[1:2] / 1.0, torch.tensor([40]), None))
    assert not torch.equal(native[0], support[1])  # vLLM's own top-k keeps every tied token


def test_a_quantized_linear_method_is_counted_under_p_and_refused_under_r(plugin):
    """Issue 38: an FP8 rollout's GEMMs are vLLM's quantized linear method (``Fp8LinearMethod``), not the unquantized
    one rlk hooks; bind_model wraps such a method's ``apply`` so the readback counts it in the layer's module (P) and
    an R module refuses it. A real ``LinearMethodBase`` subclass stands for the FP8 method (which needs FP8 tensor
    cores); the unquantized method is left alone (its own hook routes it)."""
    from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

    from rlk_core.errors import RlkPolicyError
    from rlk_vllm_plugin import layers

    class HalfScaleLinearMethod(LinearMethodBase):  # a quantized method in miniature: its own GEMM
        def create_weights(self, *args, **kwargs):
            raise NotImplementedError

        def apply(self, layer, x, bias=None):
            return torch.nn.functional.linear(x, layer.weight * 0.5, bias)

    class HalfScaleOnline(HalfScaleLinearMethod):  # inherits apply: the defining class is wrapped
        pass

    rt = plugin(attention="P/P", ffn="P/R", logp="P/P")
    x, w = _bf16(6, 64), _bf16(96, 64, seed=5)
    model = torch.nn.Module()
    for name, prefix, method in (("o", "model.layers.0.self_attn.o_proj", HalfScaleOnline()),
                                 ("down", "model.layers.0.mlp.down_proj", HalfScaleLinearMethod()),
                                 ("qkv", "model.layers.0.self_attn.qkv_proj", UnquantizedLinearMethod())):
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
        layer.prefix, layer.quant_method = prefix, method
        setattr(model, name, layer)
    assert getattr(HalfScaleLinearMethod.apply, "_rlk_original", None) is None
    layers.bind_model(model)
    assert HalfScaleLinearMethod.apply._rlk_original is not None  # wrapped once, on the class defining apply
    assert "apply" not in HalfScaleOnline.__dict__
    assert torch.equal(model.o.quant_method.apply(model.o, x), torch.nn.functional.linear(x, w * 0.5))
    ops = rt.recorder.to_dict()["modules"]["attention"]["ops"]["linear"]
    assert ops["backend_id"] == "production.vllm.HalfScaleLinearMethod.apply" and ops["call_count"] == 1
    hooks = {h[0] for h in rt.hooks}
    assert "linear_quantized.HalfScaleLinearMethod" in hooks
    assert not any("UnquantizedLinearMethod" in h for h in hooks if h.startswith("linear_quantized"))
    with pytest.raises(RlkPolicyError, match="quantized method HalfScaleLinearMethod in module 'ffn'"):
        model.down.quant_method.apply(model.down, x)  # ffn is R on the rollout side
    layers.uninstall()
    assert getattr(HalfScaleLinearMethod.apply, "_rlk_original", None) is None  # uninstall put it back
