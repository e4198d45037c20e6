"""The attention checks' fast path (``_validate._*_fast``: a few attribute tests, no message built) agrees with
the full checks it stands in front of: on a sweep of valid calls it takes every one of them, and on every
call made from a valid one by changing one argument (dtype, rank, one dim, device, type, scale, causal)
the outcome — pass, or the exception and its message — is that of the full checks alone."""

from __future__ import annotations

import math

import pytest
import torch

from rlk_core.ops.attention import _validate as V
from rlk_core.testing.attention import cu_seqlens, vllm_kv_cache

FAST = ("_varlen_fast", "_paged_fast", "_kv_cache_write_fast")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ALL_DTYPES = (*DTYPES, torch.float64, torch.int32, torch.int64)


def _varlen(dtype, hq, hkv, d, lens, *, causal=True, positions=None, device="cpu"):
    t = sum(lens)
    q, k, v = (torch.randn(t, h, d, dtype=dtype, device=device) for h in (hq, hkv, hkv))
    cu = cu_seqlens(lens, device)
    if positions is not None:
        positions = torch.cat([torch.arange(n) for n in lens]).to(positions).to(device)
    return V.check_varlen, (q, k, v, cu, cu, d**-0.5, causal, positions)


def _cache(dtype, num_blocks, page, hkv, d, device, contiguous):
    if contiguous:
        return tuple(torch.zeros(num_blocks, page, hkv, d, dtype=dtype, device=device) for _ in range(2))
    return vllm_kv_cache(num_blocks, page, hkv, d, dtype, device, fill=0.0)


def _paged(dtype, hq, hkv, d, page, lens, new, *, device="cpu", contiguous=False):
    """``check_paged_prefill`` (``new``: each sequence's new tokens) or, ``new`` None, ``check_decode``."""
    pages = [(n + page - 1) // page for n in lens]
    kc, vc = _cache(dtype, sum(pages) + 1, page, hkv, d, device, contiguous)
    table = torch.zeros(len(lens), max(pages) + 1, dtype=torch.int32)
    first = 0
    for b, n in enumerate(pages):
        table[b, :n] = torch.arange(first, first + n)
        first += n
    table, seq_lens = table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)
    if new is None:
        return V.check_decode, (torch.randn(len(lens), hq, d, dtype=dtype, device=device), kc, vc, table, seq_lens,
                                0.125)
    q = torch.randn(sum(new), hq, d, dtype=dtype, device=device)
    return V.check_paged_prefill, (q, kc, vc, table, cu_seqlens(new, device), seq_lens, 0.125)


def _kv_write(dtype, hkv, d, page, tokens, *, device="cpu", contiguous=False):
    kc, vc = _cache(dtype, 4, page, hkv, d, device, contiguous)
    k, v = (torch.randn(tokens, hkv, d, dtype=dtype, device=device) for _ in range(2))
    slots = torch.full((tokens,), -1, dtype=torch.int64)
    slots[: min(tokens, 4 * page)] = torch.arange(min(tokens, 4 * page))
    return V.check_kv_cache_write, (k, v, kc, vc, slots.to(device))


def _valid_calls():
    for dtype in DTYPES:
        for hq, hkv in ((1, 1), (4, 4), (8, 2), (6, 1)):
            for d in (1, 8, 64):
                yield _varlen(dtype, hq, hkv, d, [3, 5])
                yield _paged(dtype, hq, hkv, d, 16, [5, 17, 1], [2, 17, 1])
                yield _paged(dtype, hq, hkv, d, 1, [5, 17, 1], None)
                yield _kv_write(dtype, hkv, d, 16, 7)
    yield _varlen(torch.bfloat16, 8, 2, 16, [4])
    yield _varlen(torch.bfloat16, 8, 2, 16, [0, 4, 0])
    yield _varlen(torch.float32, 4, 2, 8, [3, 5], causal=False)
    yield _varlen(torch.float32, 4, 2, 8, [3, 5], positions=torch.int32)
    yield _varlen(torch.float32, 4, 2, 8, [3, 5], positions=torch.int64)
    yield _varlen(torch.float32, 4, 2, 8, [3, 5], device="meta")
    yield _varlen(torch.float32, 4, 2, 8, [3, 5], positions=torch.int64, device="meta")
    yield _paged(torch.bfloat16, 16, 8, 128, 16, [40] * 4, [32] * 4, contiguous=True)
    yield _paged(torch.bfloat16, 16, 8, 128, 16, [40] * 4, None, contiguous=True)
    yield _paged(torch.float32, 4, 2, 8, 4, [5, 8], [1, 8], device="meta")
    yield _paged(torch.float32, 4, 2, 8, 4, [5, 8], None, device="meta")
    yield _kv_write(torch.bfloat16, 8, 128, 16, 64, contiguous=True)
    yield _kv_write(torch.float32, 2, 8, 4, 0)
    yield _kv_write(torch.float32, 2, 8, 4, 3, device="meta")


def _fast(check, args) -> bool:
    """The fast path that ``check`` runs on ``args``."""
    if check is V.check_paged_prefill:
        q, kc, vc, table, cu, lens, scale = args
        return V._paged_fast(q, kc, vc, table, lens, scale, cu)
    if check is V.check_decode:
        return V._paged_fast(*args, None)
    return (V._varlen_fast if check is V.check_varlen else V._kv_cache_write_fast)(*args)


def _outcome(check, args):
    try:
        check(*args)
    except Exception as exc:  # compared by type and message
        return type(exc).__name__, str(exc)
    return None


def _full_outcome(monkeypatch, check, args):
    """The outcome with every fast path switched off: today's full checks alone."""
    with monkeypatch.context() as m:
        for name in FAST:
            m.setattr(V, name, lambda *a: False)
        return _outcome(check, args)


def test_paged_fast_argument_order_matches_the_checks():
    """``_fast`` above calls ``_paged_fast`` in the checks' order: a prefill call with cu_seqlens_q and seq_lens
    swapped would fail the fast path (int32 [B + 1] vs [B]), so the sweep below cannot pass by a wrong call."""
    check, args = _paged(torch.float32, 4, 2, 8, 4, [5, 8], [1, 8])
    q, kc, vc, table, cu, lens, scale = args
    assert V._paged_fast(q, kc, vc, table, lens, scale, cu)
    assert not V._paged_fast(q, kc, vc, table, cu, scale, lens)


@pytest.mark.parametrize("values", ["auto", "never"])
def test_fast_path_takes_every_valid_call(monkeypatch, values):
    monkeypatch.setenv("RLK_VALUE_CHECKS", values)
    n = 0
    for check, args in _valid_calls():
        assert _full_outcome(monkeypatch, check, args) is None, (check.__name__, args)
        assert _fast(check, args), (check.__name__, [getattr(a, "shape", a) for a in args])
        assert _outcome(check, args) is None
        n += 1
    assert n >= 150


def _resized(t: torch.Tensor, i: int, size) -> torch.Tensor | None:
    if not -t.dim() <= i < t.dim() or size(t.shape[i]) in (t.shape[i], -1):
        return None
    shape = list(t.shape)
    shape[i] = size(shape[i])
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


def _changes():
    """One change each, to be made to one tensor or alike to several (None: does not apply to that tensor):
    a non-tensor, another dtype, one dim more or fewer, one dim resized (0, n - 1, n + 1, 2n), another device."""
    yield lambda t: "t"
    for dtype in ALL_DTYPES:
        yield lambda t, dtype=dtype: t.to(dtype) if t.dtype != dtype else None
    yield lambda t: t.unsqueeze(0)
    yield lambda t: t[..., 0] if t.dim() > 1 else None
    for i in range(-4, 4):
        for size in (lambda n: 0, lambda n: n - 1, lambda n: n + 1, lambda n: 2 * n):
            yield lambda t, i=i, size=size: _resized(t, i, size)
    yield lambda t: t.to("meta")


def _changed_calls():
    """Calls made from valid ones by one change to one argument, or the same change to a group of arguments
    whose shapes the checks compare with each other (k and v; q, k and v; the batch of the paged ops, ...):
    those reach each check that one changed argument alone cannot (e.g. D = 0, page_size 0, B = 0)."""
    bases = [(_varlen(torch.float32, 4, 2, 8, [3, 5]), [(1, 2), (0, 1, 2), (3, 4)]),
             (_varlen(torch.float32, 4, 2, 8, [3, 5], positions=torch.int64), [(1, 2), (0, 7), (3, 4)]),
             (_paged(torch.bfloat16, 4, 2, 8, 4, [5, 8], [1, 8]), [(1, 2), (0, 1, 2), (3, 4, 5)]),
             (_paged(torch.bfloat16, 4, 2, 8, 4, [5], [2]), [(1, 2), (3, 4, 5)]),
             (_paged(torch.bfloat16, 4, 2, 8, 4, [5, 8], None), [(1, 2), (0, 1, 2), (0, 3, 4)]),
             (_kv_write(torch.float32, 2, 8, 4, 3), [(0, 1), (2, 3), (0, 1, 4), (0, 1, 2, 3)])]
    for (check, args), groups in bases:
        tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        for group in [(i,) for i in tensors] + groups:
            for change in _changes():
                new = [change(args[i]) for i in group]
                if all(t is not None for t in new):
                    changed = list(args)
                    for i, t in zip(group, new):
                        changed[i] = t
                    yield check, tuple(changed)
        for i, a in enumerate(args):
            others = ((0.0, -1.0, math.nan, math.inf, 1, "0.1") if type(a) is float
                      else (False,) if type(a) is bool else ())
            for b in others:
                yield check, (*args[:i], b, *args[i + 1:])


@pytest.mark.parametrize("values", ["auto", "never"])
def test_fast_path_never_passes_what_the_full_checks_refuse(monkeypatch, values):
    monkeypatch.setenv("RLK_VALUE_CHECKS", values)
    refused = taken = 0
    for check, args in _changed_calls():
        full = _full_outcome(monkeypatch, check, args)
        assert _outcome(check, args) == full, (check.__name__, [getattr(a, "shape", a) for a in args])
        if _fast(check, args):
            # the fast path stands in for the shape/dtype/device checks only: with value checks off they pass
            monkeypatch.setenv("RLK_VALUE_CHECKS", "never")
            assert _full_outcome(monkeypatch, check, args) is None, (check.__name__, args)
            monkeypatch.setenv("RLK_VALUE_CHECKS", values)
            taken += 1
        refused += full is not None
    assert refused >= 1000 and taken >= 100


def test_fake_tensors_take_the_fast_path():
    """Under torch.compile the checks run on fake tensors (the ops' fake impls): the same attribute tests."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = (_varlen(torch.bfloat16, 8, 2, 16, [3, 5]), _paged(torch.bfloat16, 8, 2, 16, 4, [5, 8], None),
             _paged(torch.bfloat16, 8, 2, 16, 4, [5, 8], [1, 8]), _kv_write(torch.bfloat16, 2, 16, 4, 3))
    with FakeTensorMode() as mode:
        for check, args in calls:
            fake = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
            assert _fast(check, fake), check.__name__
            check(*fake)
