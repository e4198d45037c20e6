"""The ops' fast path (``rlk_core._C.fast``, csrc/rlk_cuda.cpp) on the GPU: for each op ``rlk.cuda`` runs as one
program, a repeat call is taken by the fast path (counted), and its result is ``torch.equal`` to the Python
path's (the fast path off) and to ``rlk.triton``'s; the readback counts every call, eager and under CUDA-graph
capture; a side stream gets the launch; what the fast path must refuse (grad, subclasses, value checks) it refuses.
Negative control: the same comparison tells apart a call with another eps.

Needs the extension and the cubins of the op families it tests (the module fails, not skips, where ``rlk.cuda`` is
unavailable: a missing build cannot pass as green). bf16 only (what a sitting's ``RLK_BUILD_DTYPES=bf16`` builds).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlk_core import ops
from rlk_core.backends import REGISTRY
from rlk_core.ops import _dispatch as D
from rlk_core.ops.rope import reserve_tables
from rlk_core.readback import ReadbackRecorder
from rlk_core.routes import RoutePlan

pytestmark = pytest.mark.gpu
DT = torch.bfloat16


def _randn(*shape, seed=0, scale=1.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, device="cuda", generator=g) * scale).to(DT)


@pytest.fixture
def hits(monkeypatch):
    """Whether each fast-path call was served (True) or missed (False), in order."""
    assert REGISTRY.is_available(REGISTRY.get("linear", "rlk.cuda"), "cuda")[0], "rlk.cuda is not built"
    ops.linear(_randn(4, 64), _randn(16, 64))  # the first rlk.cuda launch loads the extension: the fast path is on
    real = D._FAST[0]
    assert real is not None, "the fast path is off (RLK_FAST_PATH=0?)"
    seen: list[bool] = []

    def counting(slot, *args):
        out = real(slot, *args)
        seen.append(out is not D.MISS)
        return out

    monkeypatch.setattr(D, "_FAST", [counting])  # _dispatch reads _FAST[0] per call
    yield seen


def _cases():
    """(name, the call, its rlk.triton backend call) per op the fast path takes."""
    from rlk_core.ops.attention import attention_decode, attention_paged_prefill, attention_varlen, kv_cache_write

    x, w = _randn(64, 1024, seed=1), _randn(3072, 1024, seed=2, scale=1024 ** -0.5)
    g = _randn(64, 3072, seed=3)
    h, wn = _randn(64, 4096, seed=4), _randn(4096, seed=5)
    gu, gd = _randn(64, 2 * 3072, seed=6), _randn(64, 3072, seed=7)
    xr, pos = _randn(64, 16, 128, seed=8), torch.arange(64, device="cuda")
    reserve_tables("cuda", 128, 1e6, 40960)
    hq, hkv, d, page, b, ctx = 16, 8, 128, 16, 8, 512
    pages = b * ctx // page
    kc, vc = _randn(pages, page, hkv, d, seed=9), _randn(pages, page, hkv, d, seed=10)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, ctx // page)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    q = _randn(b, hq, d, seed=11)
    kn, vn = _randn(b, hkv, d, seed=12), _randn(b, hkv, d, seed=13)
    slots = (table[:, -1].long() * page + page - 1)
    qp = _randn(4 * 32, hq, d, seed=14)
    cu_q = torch.arange(0, 4 * 32 + 1, 32, dtype=torch.int32, device="cuda")
    qv, kv_, vv = _randn(256, hq, d, seed=15), _randn(256, hkv, d, seed=16), _randn(256, hkv, d, seed=17)
    cu = torch.tensor([0, 100, 256], dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    vocab = 151936  # one TP-8 shard of the Qwen3 vocabulary, and the merge of its 8 groups
    shard, target = _randn(64, vocab // 8, seed=18), torch.randint(0, vocab, (64,), device="cuda")
    temp = torch.full((64,), 0.7, device="cuda")
    m, s_, zt = _randn(64, 8, seed=19).float(), _randn(64, 8, seed=20).float().abs() + 1, _randn(64, seed=21).float()
    tri = lambda op: REGISTRY.get(op, "rlk.triton").fn  # noqa: E731
    return [
        ("linear", lambda: ops.linear(x, w), lambda: tri("linear")(x, w, None)),
        ("linear dx (stored layout)", lambda: D.op("linear")(g, w.t(), None), lambda: tri("linear")(g, w.t(), None)),
        ("linear dW (stored layout)", lambda: D.op("linear")(g.t(), x.t(), None),
         lambda: tri("linear")(g.t(), x.t(), None)),
        ("rms_norm", lambda: ops.rms_norm(h, wn, 1e-6), lambda: tri("rms_norm")(h, wn, 1e-6)),
        ("rms_norm_backward", lambda: D.op("rms_norm_backward")(h, h, wn, 1e-6),
         lambda: tri("rms_norm_backward")(h, h, wn, 1e-6)),
        ("swiglu", lambda: ops.swiglu(gu), lambda: tri("swiglu")(gu)),
        ("swiglu_backward", lambda: D.op("swiglu_backward")(gd, gu), lambda: tri("swiglu_backward")(gd, gu)),
        ("rope", lambda: ops.rope(xr, pos, 1e6, 128), lambda: tri("rope")(xr, pos, 1e6, 128)),
        ("rope_backward", lambda: D.op("rope_backward")(xr, pos, 1e6, 128),
         lambda: tri("rope_backward")(xr, pos, 1e6, 128)),
        ("attention_decode", lambda: attention_decode(q, kc, vc, table, lens, scale),
         lambda: tri("attention_decode")(q, kc, vc, table, lens, scale)),
        ("attention_paged_prefill", lambda: attention_paged_prefill(qp, kc, vc, table[:4], cu_q, lens[:4], scale),
         lambda: tri("attention_paged_prefill")(qp, kc, vc, table[:4], cu_q, lens[:4], scale)),
        ("attention_varlen", lambda: attention_varlen(qv, kv_, vv, cu, cu, scale),
         lambda: tri("attention_varlen")(qv, kv_, vv, cu, cu, scale, True, None)),
        ("kv_cache_write", lambda: (kv_cache_write(kn, vn, kc, vc, slots), kc.clone())[1],
         lambda: (tri("kv_cache_write")(kn, vn, kc, vc, slots), kc.clone())[1]),
        ("logp_partials", lambda: ops.logp_partials(shard, target, temp, 0, vocab),
         lambda: tri("logp_partials")(shard, target, temp, 0, vocab)),
        ("merge_logp_partials", lambda: ops.merge_logp_partials(m, s_, zt, vocab),
         lambda: tri("merge_logp_partials")(m, s_, zt, vocab)),
    ]


def _built_ops() -> set[str]:
    """The ops whose variants this AOT build has (its manifest's ``selection``; none recorded: all)."""
    from rlk_core.ops import _cuda

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_cuda_backend_gpu import FAMILY_OPS

    families = (_cuda.manifest(_cuda.TARGETS[torch.cuda.get_device_capability()])[1].get("selection") or {}).get(
        "families") or list(FAMILY_OPS)
    ops = {op for f in families for op in FAMILY_OPS.get(f, ())}
    return ops | ({"linear_backward"} if "linear" in families else set())


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("case", range(15))
def test_a_repeat_is_served_by_the_fast_path_with_the_python_path_s_bits(hits, case):
    name, call, triton = _cases()[case]
    op = "linear_backward" if "stored layout" in name else name.split(" ")[0]
    built = _built_ops()
    if op not in built:
        pytest.skip(f"{op}: this build's AOT selection has no {op} variants ({sorted(built)})")
    counting, D._FAST[0] = D._FAST[0], None  # the Python path (without forgetting what was stored)
    python = call()
    D._FAST[0] = counting
    torch.cuda.synchronize()
    outs = [call() for _ in range(3)]  # the first stores it (a miss), the next two are served
    torch.cuda.synchronize()
    assert hits[-2:] == [True, True], (name, hits)
    want = triton()
    for out in outs:
        assert _equal(out, python), name
        assert _equal(out, want), name


def test_negative_control_the_check_tells_another_result_apart(hits):
    """The comparison the tests above make fails where the bits differ: the fast path's rms_norm against the same
    call with another eps (cuBLAS is no control here: at M = 64 its bf16 GEMM gave rlk's bits on the H200)."""
    h, w = _randn(64, 4096, seed=4), _randn(4096, seed=5)
    ops.rms_norm(h, w, 1e-6)
    out = ops.rms_norm(h, w, 1e-6)
    assert hits[-1] is True
    assert not _equal(out, ops.rms_norm(h, w, 1e-5))


def test_the_readback_counts_every_call_eager_and_captured(hits):
    x, w = _randn(64, 1024, seed=1), _randn(3072, 1024, seed=2)
    rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"))
    with rec.scope("ffn"):
        eager = [ops.linear(x, w) for _ in range(5)]
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up on a side stream, eager
                ops.linear(x, w)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = [ops.linear(x, w) for _ in range(3)]
    graph.replay()
    torch.cuda.synchronize()
    doc = rec.to_dict()["modules"]["ffn"]["ops"]["linear"]
    assert doc["call_count"] == 5 + 2 + 3 and doc["execution_mode"] == "mixed"
    # the first captured call misses (the scope's 'graph' record is not stored yet), then served
    assert hits[-3:] == [False, True, True]
    for y in captured:
        assert torch.equal(y, eager[0])


def test_a_side_stream_gets_the_launch(hits):
    x, w = _randn(64, 1024, seed=1), _randn(3072, 1024, seed=2)
    want = ops.linear(x, w)
    ops.linear(x, w)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # the launch must queue behind this on the side stream
        got = ops.linear(x, w)
    assert hits[-1] is True
    side.synchronize()
    assert torch.equal(got, want)


def test_what_the_fast_path_refuses(hits, monkeypatch):
    x, w = _randn(64, 1024, seed=1), _randn(3072, 1024, seed=2)
    ops.linear(x, w), ops.linear(x, w)
    assert hits[-1] is True
    n = len(hits)
    y = ops.linear(x.detach().requires_grad_(), w)  # the public call misses; its Function's forward is served
    assert y.grad_fn is not None and hits[n:] == [False, True]

    class Sub(torch.Tensor):
        pass

    n = len(hits)
    ops.linear(x.as_subclass(Sub), w)
    assert True not in hits[n:]
    monkeypatch.setenv("RLK_VALUE_CHECKS", "always")
    n = len(hits)
    ops.linear(x, w)
    assert hits[n:] == [False]
    monkeypatch.delenv("RLK_VALUE_CHECKS")
    REGISTRY.refresh()
    n = len(hits)
    ops.linear(x, w)
    assert hits[n:] == [False]  # forgotten: the Python path runs (and stores it again)
