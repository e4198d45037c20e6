"""Qualification of a backend against its contract before strict mode accepts it.

A backend that is not built into rlk (say, a Blackwell or ROCm kernel package registering itself
through the ``rlk.backends`` entry points) must show, on the device it will run on, that it keeps
the contract's invariances (batch invariance, run-to-run) and agrees with rlk's reference within
:func:`~rlk_core.testing.dtype_tols`. Inputs are small and random; the check takes seconds.

Row-wise ops (linear, rms_norm, swiglu, rope) get a generic row suite. The attention family is
qualified as a family: prefill, chunked prefill and decode must agree bit for bit, so a backend id that
claims one forward attention op must register all three, and the checks of
:mod:`rlk_core.testing.attention` run over its three functions. ``kv_cache_write`` must move data
exactly; the varlen backward must be deterministic and close to the reference backward. The log-prob
ops run their batch, vocab-shard (list form) and run-to-run checks, and ``linear_logprobs`` must equal
``token_logprobs(linear(...))`` with the same backend id's ``linear`` and ``token_logprobs``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlk_core.testing.compare import dtype_tols
from rlk_core.testing.invariance import check_batch_invariance, check_run_to_run


def _suites(op: str, device: str, gen: torch.Generator) -> list[tuple[Any, Callable[..., Any]]]:
    """``[(rows, make(fn) -> row-wise callable)]`` for ops with a generic row-wise suite, in fp32 and
    bf16 (the CPU's BLAS, for one, breaks batch invariance in fp32 at K=256 where bf16 holds)."""
    suites = []
    for dtype in (torch.float32, torch.bfloat16):
        def randn(*shape: int, dtype=dtype) -> torch.Tensor:
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        if op == "linear":
            w = randn(96, 256)
            suites.append((randn(64, 256), lambda f, w=w: (lambda x: f(x, w, None))))
        elif op == "rms_norm":
            w = randn(256)
            suites.append((randn(64, 256), lambda f, w=w: (lambda x: f(x, w, 1e-6))))
        elif op == "swiglu":
            suites.append((randn(64, 256), lambda f: (lambda x: f(x))))
        elif op == "rope":
            pos = torch.randint(0, 8192, (64,), generator=gen).to(device)
            suites.append(((randn(64, 4, 64), pos), lambda f: (lambda x, p: f(x, p, 1e6, 64))))
    return suites


def qualify_backend(backend, device_type: str, seed: int = 0) -> tuple[bool, str]:
    """Run the contract checks of ``backend.op`` with ``backend.fn`` on ``device_type``."""
    from rlk_core.backends import REGISTRY

    gen = torch.Generator().manual_seed(seed)
    special = _FAMILY_CHECKS.get(backend.op)
    if special is not None:
        try:
            return special(backend, device_type, gen)
        except Exception as exc:
            return False, f"raised {type(exc).__name__}: {exc}"
    suites = _suites(backend.op, device_type, gen)
    if not suites:
        return False, (f"no qualification suite for op {backend.op!r} yet; "
                       "strict mode accepts only rlk's built-in backends")
    reference = REGISTRY.get(backend.op, "rlk.reference").fn
    for rows, make in suites:
        fn, ref = make(backend.fn), make(reference)
        args = rows if isinstance(rows, tuple) else (rows,)
        dtype = args[0].dtype
        try:
            ok, detail = check_batch_invariance(fn, rows)
            if not ok:
                return False, f"batch invariance ({dtype}): {detail}"
            ok, detail = check_run_to_run(lambda fn=fn, args=args: fn(*args), repeats=5)
            if not ok:
                return False, f"run-to-run ({dtype}): {detail}"
            got, want = fn(*args), ref(*args)
            tols = dtype_tols(got.dtype)
            if not torch.allclose(got.double(), want.double(), **tols):
                err = float((got.double() - want.double()).abs().max())
                return False, f"differs from rlk.reference by up to {err:.3g} ({dtype}, tolerance {tols})"
        except Exception as exc:
            return False, f"raised {type(exc).__name__}: {exc}"
    return True, "batch invariance, run-to-run and reference tolerance passed in fp32 and bf16"


# -- attention ------------------------------------------------------------------------------------
ATTENTION_FORWARD = ("attention_varlen", "attention_paged_prefill", "attention_decode")
_DTYPES = (torch.float32, torch.bfloat16)


def _same_id(backend, ops: tuple[str, ...]) -> dict[str, Callable[..., Any]]:
    """``{op: fn}`` of ``backend.id`` for ``ops``; raise naming what is missing."""
    from rlk_core.backends import REGISTRY

    missing = [op for op in ops if backend.id not in {b.id for b in REGISTRY.backends(op)}]
    if missing:
        raise LookupError(f"backend {backend.id!r} registers {backend.op!r} but not {missing}: these ops must "
                          "come from one backend for their results to agree bit for bit")
    return {op: REGISTRY.get(op, backend.id).fn for op in ops}


def _randn(gen: torch.Generator, device: str, dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    tols = dtype_tols(got.dtype)
    if torch.allclose(got.double(), want.double(), **tols):
        return None
    return f"{what}: differs from rlk.reference by up to {float((got.double() - want.double()).abs().max()):.3g}"


def _qualify_attention_forward(backend, device: str, gen: torch.Generator) -> tuple[bool, str]:
    from rlk_core.backends import REGISTRY
    from rlk_core.testing.attention import check_cp_sharding, check_prefill_chunked_decode, cu_seqlens

    fns = _same_id(backend, ATTENTION_FORWARD)
    varlen_fn = fns["attention_varlen"]

    def varlen(q, k, v, cq, ck, scale, causal=True, q_positions=None):
        return varlen_fn(q, k, v, cq, ck, scale, causal, q_positions)

    ref = REGISTRY.get("attention_varlen", "rlk.reference").fn
    for dtype in _DTYPES:
        q, k, v = (_randn(gen, device, dtype, 150, h, 64) for h in (4, 2, 2))
        scale = 64**-0.5
        for ok, detail in (
            check_prefill_chunked_decode(q, k, v, scale, page_sizes=(16,), chunk_sizes=(37,), random_chunkings=1,
                                         generator=gen, varlen=varlen, paged_prefill=fns["attention_paged_prefill"],
                                         decode=fns["attention_decode"]),
            check_cp_sharding(q, k, v, scale, cp_sizes=(2,), varlen=varlen),
            check_run_to_run(lambda q=q, k=k, v=v, s=scale: varlen(q, k, v, cu_seqlens([150], device),
                                                                 cu_seqlens([150], device), s), repeats=3),
        ):
            if not ok:
                return False, f"{dtype}: {detail}"
        # batch composition: the sequence packed after another one gives the same rows as alone
        q2, k2, v2 = (_randn(gen, device, dtype, 41, h, 64) for h in (4, 2, 2))
        cu = cu_seqlens([41, 150], device)
        packed = varlen(torch.cat([q2, q]), torch.cat([k2, k]), torch.cat([v2, v]), cu, cu, scale)
        alone = varlen(q, k, v, cu_seqlens([150], device), cu_seqlens([150], device), scale)
        if not torch.equal(packed[41:], alone):
            return False, f"{dtype}: a sequence packed after another differs from the same sequence alone"
        report = _close(alone, ref(q, k, v, cu_seqlens([150], device), cu_seqlens([150], device), scale, True, None),
                        f"attention_varlen ({dtype})")
        if report:
            return False, report
    return True, ("prefill == chunked (varlen, paged) == decode, CP shards, batch composition, run-to-run and "
                  "reference tolerance passed in fp32 and bf16")


def _qualify_kv_cache_write(backend, device: str, gen: torch.Generator) -> tuple[bool, str]:
    from rlk_core.testing.attention import vllm_kv_cache

    for dtype in _DTYPES:
        k, v = _randn(gen, device, dtype, 20, 2, 64), _randn(gen, device, dtype, 20, 2, 64)
        slots = torch.randperm(8 * 16, generator=gen)[:20].to(device)
        slots[3] = -1
        caches = []
        for write in (backend.fn, None):
            kc, vc = vllm_kv_cache(8, 16, 2, 64, dtype, device=device)  # views covering one NaN-filled buffer
            if write is None:  # the exact expectation, by indexing
                keep = (slots >= 0).nonzero()[:, 0]
                for i in keep.tolist():
                    page, off = divmod(int(slots[i]), 16)
                    kc[page, off], vc[page, off] = k[i], v[i]
            else:
                write(k, v, kc, vc, slots)
            caches.append(torch.cat([kc, vc], -1).nan_to_num(7.0))
        if not torch.equal(caches[0], caches[1]):
            return False, f"{dtype}: the cache buffer differs from an exact write of the slots"
    return True, "exact writes (slot -1 skipped, nothing else touched) in fp32 and bf16"


def _qualify_attention_backward(backend, device: str, gen: torch.Generator) -> tuple[bool, str]:
    from rlk_core.backends import REGISTRY
    from rlk_core.testing.attention import cu_seqlens

    ref = REGISTRY.get("attention_varlen_backward", "rlk.reference").fn
    for dtype in _DTYPES:
        lens = [19, 70]
        q, k, v, do = (_randn(gen, device, dtype, 89, h, 64) for h in (4, 2, 2, 4))
        cu = cu_seqlens(lens, device)
        args = (do, q, k, v, cu, cu, 64**-0.5, True, None)
        ok, detail = check_run_to_run(lambda args=args: backend.fn(*args), repeats=3)
        if not ok:
            return False, f"{dtype}: run-to-run: {detail}"
        rtol = dtype_tols(dtype)["rtol"]
        for name, got, want in zip(("dq", "dk", "dv"), backend.fn(*args), ref(*args)):
            err = float((got.double() - want.double()).norm())
            if err > rtol * float(want.double().norm()) + dtype_tols(dtype)["atol"]:
                return False, f"{dtype}: {name} differs from rlk.reference by {err:.3g} in norm (rtol {rtol})"
    return True, "deterministic and within tolerance (norm-relative) of the reference backward in fp32 and bf16"


# -- log-probs ------------------------------------------------------------------------------------
def _logp_inputs(gen: torch.Generator, device: str, dtype: torch.dtype, t: int, v: int):
    target = torch.randint(0, v, (t,), generator=gen).to(device)
    temp = (0.5 + torch.rand(t, generator=gen)).to(device)
    return target, temp


def _qualify_token_logprobs(backend, device: str, gen: torch.Generator) -> tuple[bool, str]:
    from rlk_core.backends import REGISTRY
    from rlk_core.ops import _logp_tree as L
    from rlk_core.testing.logp import check_vocab_shard_merge

    def public(logits, target, temperature):
        shards = [logits] if isinstance(logits, torch.Tensor) else list(logits)
        temp = L.as_temperature("token_logprobs", temperature, target.shape[0], target.device)
        return backend.fn(shards, target, temp)

    ref = REGISTRY.get("token_logprobs", "rlk.reference").fn
    for dtype in _DTYPES:
        logits = _randn(gen, device, dtype, 24, 1000) * 3
        target, temp = _logp_inputs(gen, device, dtype, 24, 1000)
        for ok, detail in (
            check_batch_invariance(lambda x, y, t: torch.stack(public(x, y, t), -1), (logits, target, temp),
                                   batch_sizes=(1, 3, 16)),
            check_vocab_shard_merge(logits, target, temp, shard_counts=(2, 8), token_fn=public, partials=False),
            check_run_to_run(lambda a=(logits, target, temp): public(*a), repeats=3),
        ):
            if not ok:
                return False, f"{dtype}: {detail}"
        report = _close(public(logits, target, temp)[0], ref([logits], target, temp)[0], f"token_logprobs ({dtype})")
        if report:
            return False, report
    return True, "batch invariance, vocab shards 2/8, run-to-run and reference tolerance passed in fp32 and bf16"


def _qualify_linear_logprobs(backend, device: str, gen: torch.Generator) -> tuple[bool, str]:
    from rlk_core.backends import REGISTRY
    from rlk_core.ops import _logp_tree as L
    from rlk_core.testing.logp import check_fused_equals_unfused, check_linear_vocab_shard_merge

    parts = _same_id(backend, ("linear", "token_logprobs"))

    def public(hidden, weight, target, temperature):
        weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        temp = L.as_temperature("linear_logprobs", temperature, target.shape[0], target.device)
        return backend.fn(hidden, weights, target, temp)

    def token(logits, target, temperature):
        temp = L.as_temperature("token_logprobs", temperature, target.shape[0], target.device)
        return parts["token_logprobs"]([logits], target, temp)

    ref = REGISTRY.get("linear_logprobs", "rlk.reference").fn
    for dtype in _DTYPES:
        hidden, weight = _randn(gen, device, dtype, 24, 64), _randn(gen, device, dtype, 1000, 64) * 0.3
        target, temp = _logp_inputs(gen, device, dtype, 24, 1000)
        for ok, detail in (
            check_batch_invariance(lambda h, y, t, w=weight: torch.stack(public(h, w, y, t), -1),
                                   (hidden, target, temp), batch_sizes=(1, 3, 16)),
            check_linear_vocab_shard_merge(hidden, weight, target, temp, shard_counts=(2, 8), fused_fn=public,
                                           partials=False),
            check_fused_equals_unfused(hidden, weight, target, temp, fused_fn=public,
                                       linear_fn=lambda h, w: parts["linear"](h, w, None), token_fn=token),
            check_run_to_run(lambda a=(hidden, weight, target, temp): public(*a), repeats=3),
        ):
            if not ok:
                return False, f"{dtype}: {detail}"
        report = _close(public(hidden, weight, target, temp)[0], ref(hidden, [weight], target, temp)[0],
                        f"linear_logprobs ({dtype})")
        if report:
            return False, report
    return True, ("batch invariance, weight shards 2/8, fused == unfused (same backend's linear and "
                  "token_logprobs), run-to-run and reference tolerance passed in fp32 and bf16")


_FAMILY_CHECKS: dict[str, Callable[[Any, str, torch.Generator], tuple[bool, str]]] = {
    **{op: _qualify_attention_forward for op in ATTENTION_FORWARD},
    "kv_cache_write": _qualify_kv_cache_write,
    "attention_varlen_backward": _qualify_attention_backward,
    "token_logprobs": _qualify_token_logprobs,
    "linear_logprobs": _qualify_linear_logprobs,
}
