"""Worker for test_qkv_cache.py: one gloo rank, a real megatron-core GPTModel with the rlk spec (all R).

``python _qkv_cache_worker.py PORT``: checks ``RlkQKVLinear``'s cached ``[q; k; v]`` weight against the
uncached computation (``linear(x, W[rows])[..., cols]`` with autograd's own gathers) and prints one JSON
line of facts (``torch.equal`` results) for the test to assert on.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model


def main() -> None:
    with _model.single_rank(int(sys.argv[1])):
        print(json.dumps(checks()))

def checks() -> dict:
    import rlk_megatron_provider
    from rlk_megatron_provider import _state
    from rlk_megatron_provider.layers import RlkQKVLinear

    cfg = _model.config(False)
    model, _ = _model.build_megatron(cfg, 1, 1)
    _model.load(model, cfg, _model.weights(cfg), 1, 0)
    layer = model.decoder.layers[0].self_attention.linear_qkv
    assert isinstance(layer, RlkQKVLinear), type(layer)
    w = layer.weight
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1, cfg.hidden_size, generator=g)
    dy = torch.randn(6, 1, w.shape[0], generator=g)
    routes = _state.get().routes

    def cached():
        xi = x.clone().requires_grad_()
        w.grad = None
        y = layer(xi)[0]
        y.backward(dy)
        return y.detach(), xi.grad, w.grad.clone()

    def uncached():
        xi, wi = x.clone().requires_grad_(), w.detach().clone().requires_grad_()
        y = routes.call("ffn" if layer.rlk_module == "ffn" else layer.rlk_module, "linear", xi,
                        wi.index_select(0, layer._qkv_rows)).index_select(-1, layer._qkv_cols)
        y.backward(dy)
        return y.detach(), xi.grad, wi.grad

    def same(a, b):
        return all(torch.equal(u, v) for u, v in zip(a, b))

    out = {}
    first = cached()
    out["first_equals_uncached"] = same(first, uncached())
    out["second_call_equals_first"] = same(cached(), first)
    out["weight_grad_nonzero"] = bool(first[2].abs().sum() > 0)
    # Megatron's way of applying a step: an optimizer on an fp32 master copy, then param.data.copy_ (which
    # does not bump the parameter's version counter); the optimizer step's hook must invalidate the cache.
    master = w.detach().clone().requires_grad_()
    master.grad = first[2].clone()
    version = w._version
    torch.optim.SGD([master], lr=0.5).step()
    w.data.copy_(master.detach())
    out["version_unchanged_by_data_copy"] = w._version == version
    after_step = cached()
    out["after_step_equals_uncached"] = same(after_step, uncached())
    out["after_step_differs_from_before"] = not torch.equal(after_step[0], first[0])
    # in-place update through autograd's view (bumps the version counter)
    with torch.no_grad():
        w.mul_(0.5)
    out["after_inplace_equals_uncached"] = same(cached(), uncached())
    # negative control: a write the cache cannot see serves the stale operand ...
    stale = cached()
    w.data.copy_(w.detach() * 2)
    out["control_stale_after_hidden_write"] = same(cached(), stale) and not same(cached(), uncached())
    # ... until the documented call
    rlk_megatron_provider.invalidate_weight_caches()
    out["after_invalidate_equals_uncached"] = same(cached(), uncached())
    out.update(batch_checks(model, cfg))
    return out


def batch_checks(model, cfg) -> dict:
    """The core attention's per-batch cache (cu_seqlens read once per batch): a new batch, or the same
    tensor changed in place, is read again; the same batch is served from the cache."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from rlk_megatron_provider import attention

    core = model.decoder.layers[0].self_attention.core_attention
    g = torch.Generator().manual_seed(9)
    t, hq, hkv, d = 24, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))

    def psp(cu):
        c = torch.tensor(cu, dtype=torch.int32)
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=c, cu_seqlens_kv=c, max_seqlen_q=t, max_seqlen_kv=t)

    def fresh(p):
        attention._BATCH.clear()
        return core(q, k, v, None, packed_seq_params=p)

    a, b = psp([0, 8, 24]), psp([0, 16, 24])
    out_a, out_b = fresh(a), fresh(b)
    entry = attention._BATCH[0]
    out = {"batches_differ": not torch.equal(out_a, out_b)}
    out["same_batch_served_from_cache"] = torch.equal(core(q, k, v, None, packed_seq_params=b), out_b) and \
        attention._BATCH[0] is entry
    out["new_batch_read_again"] = torch.equal(core(q, k, v, None, packed_seq_params=a), out_a)
    a.cu_seqlens_q.copy_(torch.tensor([0, 16, 24], dtype=torch.int32))  # in place: the version counter moves
    out["inplace_change_read_again"] = torch.equal(core(q, k, v, None, packed_seq_params=a), out_b)
    return out


if __name__ == "__main__":
    main()
