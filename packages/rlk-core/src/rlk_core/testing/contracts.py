"""The contract-check suite: per op, named checks ``(name, fn(subject, device) -> (ok, reason))``.

One suite, three callers:

* ``rlk-selfcheck`` (:mod:`rlk_core.selfcheck`) runs it on the available device against what rlk
  dispatches there (:func:`dispatched`);
* :func:`rlk_core.testing.qualify.qualify_backend` runs it for a backend that is not built into rlk
  (:func:`for_backend`) before strict mode accepts it;
* the tests parametrise over it (``tests/core/test_contracts.py``).

A :class:`Subject` holds the implementations under test in the registry's calling convention
(``Backend.fn``). Checks of a family (attention forward: varlen, paged prefill and decode must agree bit
for bit; ``linear_logprobs`` == ``token_logprobs(linear(...))``) take the other ops from the same backend
id, so a backend that claims one op of a family must register the others. Every check runs in fp32 and
bf16 on small random inputs (seconds on a GPU) and returns ``(ok, reason)``; it never asserts. Checks
marked ``dispatched_only`` exercise rlk's own public op (its autograd backward), not a plug-in backend's
function, and run only for :func:`dispatched` subjects. The GEMM's ``every_tile_same_bits`` runs where
``rlk.triton`` runs the GEMM: the tile rule picks tiles by M for speed, and that every tile gives the same
bits is a property of the GPU, so it is checked on each one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from rlk_core.testing.compare import bitwise_diff_report, dtype_tols
from rlk_core.testing.invariance import check_batch_invariance, check_run_to_run

Result = tuple[bool, str]
DTYPES = (torch.float32, torch.bfloat16)
ATTENTION_FORWARD = ("attention_varlen", "attention_paged_prefill", "attention_decode")


@dataclass(frozen=True)
class Subject:
    """What the checks run: ``fns[op]`` in the registry's calling convention, ``ids[op]`` the backend id
    behind it. ``dispatched``: the ops as rlk dispatches them on the device (selfcheck, tests), as opposed
    to one backend on trial (qualification)."""

    op: str
    fns: Mapping[str, Callable[..., Any]]
    ids: Mapping[str, str]
    dispatched: bool = False

    def fn(self, op: str | None = None) -> Callable[..., Any]:
        return self.need((op or self.op,))[op or self.op]

    def need(self, ops: tuple[str, ...]) -> dict[str, Callable[..., Any]]:
        """``{op: fn}`` for ``ops``; raises naming what the subject's backend does not register."""
        missing = [op for op in ops if op not in self.fns]
        if missing:
            raise LookupError(f"backend {self.ids[self.op]!r} registers {self.op!r} but not {missing}: these ops "
                              "must come from one backend for their results to agree bit for bit")
        return {op: self.fns[op] for op in ops}


def for_backend(backend: Any) -> Subject:
    """``backend`` on trial, with the other ops its id registers (for the family checks)."""
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import OP_CONTRACTS

    fns = {op: REGISTRY.get(op, backend.id).fn for op in OP_CONTRACTS
           if backend.id in {b.id for b in REGISTRY.backends(op)}}
    fns[backend.op] = backend.fn
    return Subject(backend.op, fns, {op: backend.id for op in fns})


def dispatched(op: str, device: str) -> Subject:
    """Every op as rlk selects it on ``device`` (per call, with fallback, like the public ops)."""
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import OP_CONTRACTS

    def select(name: str) -> Callable[..., Any]:
        return lambda *args: REGISTRY.select(name, device, args, strict=False).backend.fn(*args)

    fns = {name: select(name) for name in OP_CONTRACTS}
    ids = {name: (REGISTRY.candidates(name, device) or [None])[0] for name in OP_CONTRACTS}
    return Subject(op, fns, {k: b.id if b is not None else "none" for k, b in ids.items()}, dispatched=True)


class Check(NamedTuple):
    """``fn(subject, device) -> (ok, reason)``. ``dispatched_only``: exercises rlk's own public op.
    ``applies(subject, device)``: where the check means something (None: everywhere)."""

    name: str
    fn: Callable[[Subject, str], Result]
    dispatched_only: bool = False
    applies: Callable[[Subject, str], bool] | None = None


# -- helpers ----------------------------------------------------------------------------------------
def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen: torch.Generator, device: str, dtype: torch.dtype, *shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def _reference(op: str) -> Callable[..., Any]:
    from rlk_core.backends import REGISTRY

    return REGISTRY.get(op, "rlk.reference").fn


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> Result:
    """Within the dtype's rtol in norm: two valid fp32 summation orders differ per element by ~sqrt(K) eps
    of ``sum |terms|``, which an elementwise atol cannot bound near zero."""
    rtol = dtype_tols(got.dtype)["rtol"]
    rel = float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))
    return rel <= rtol, f"{what}: relative error {rel:.3g} vs rlk.reference (rtol {rtol})"


def _each_dtype(check: Callable[[torch.dtype, torch.Generator], Result]) -> Result:
    """Run ``check`` in fp32 and bf16; the first failure, or the last detail with the dtypes."""
    gen = _gen()
    detail = ""
    for dtype in DTYPES:
        ok, detail = check(dtype, gen)
        if not ok:
            return False, f"{dtype}: {detail}"
    return True, f"{detail} (fp32, bf16)"


def _not_reference(subject: Subject, op: str) -> bool:
    return subject.ids.get(op) != "rlk.reference"  # comparing the reference with itself proves nothing


# -- row-wise ops: linear, rms_norm, swiglu, rope ---------------------------------------------------
def _row_inputs(op: str, device: str, dtype: torch.dtype, gen: torch.Generator):
    """``(rows, call(fn) -> row-wise callable)`` of the op's generic row suite."""
    if op == "linear":
        w = _randn(gen, device, dtype, 96, 256, scale=256**-0.5)
        return _randn(gen, device, dtype, 64, 256), lambda f: (lambda x: f(x, w, None))
    if op == "rms_norm":
        w = _randn(gen, device, dtype, 256)
        return _randn(gen, device, dtype, 64, 256), lambda f: (lambda x: f(x, w, 1e-6))
    if op == "swiglu":
        return _randn(gen, device, dtype, 64, 256), lambda f: (lambda x: f(x))
    pos = torch.randint(0, 8192, (64,), generator=gen).to(device)
    return (_randn(gen, device, dtype, 64, 4, 64), pos), lambda f: (lambda x, p: f(x, p, 1e6, 64))


def _rows_batch_invariance(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        rows, call = _row_inputs(subject.op, device, dtype, gen)
        return check_batch_invariance(call(subject.fn()), rows)
    return _each_dtype(one)


def _rows_run_to_run(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        rows, call = _row_inputs(subject.op, device, dtype, gen)
        fn, args = call(subject.fn()), rows if isinstance(rows, tuple) else (rows,)
        return check_run_to_run(lambda: fn(*args), repeats=5)
    return _each_dtype(one)


def _rows_matches_reference(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        rows, call = _row_inputs(subject.op, device, dtype, gen)
        args = rows if isinstance(rows, tuple) else (rows,)
        return _close(call(subject.fn())(*args), call(_reference(subject.op))(*args), subject.op)
    return _each_dtype(one)


def _rope_offset_invariance(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        rope = subject.fn()
        x = _randn(gen, device, dtype, 64, 4, 64)
        full = rope(x, torch.arange(64, device=device), 1e6, 64)
        part = rope(x[40:], torch.arange(40, 64, device=device), 1e6, 64)
        report = bitwise_diff_report(part, full[40:], "a chunk starting at position 40 vs the full sequence")
        return report is None, report or "a chunk starting at position 40 equals the full sequence's rows"
    return _each_dtype(one)


# -- the row-wise ops' backward companions: rms_norm_backward, swiglu_backward, rope_backward ------------------
def _backward_rows(op: str, device: str, dtype: torch.dtype, gen: torch.Generator):
    """``(rows, call(fn) -> callable of the rows returning the op's outputs as a tuple)``; the rows are
    ``(grad, x)`` or, for rope, ``(grad, positions)``, indexed together along dim 0."""
    if op == "rms_norm_backward":
        w = _randn(gen, device, dtype, 256)
        rows = (_randn(gen, device, dtype, 64, 256), _randn(gen, device, dtype, 64, 256))
        return rows, lambda f: (lambda g, x: tuple(f(g, x, w, 1e-6)))
    if op == "swiglu_backward":
        rows = (_randn(gen, device, dtype, 64, 128), _randn(gen, device, dtype, 64, 256, scale=3.0))
        return rows, lambda f: (lambda g, x: (f(g, x),))
    pos = torch.randint(0, 8192, (64,), generator=gen).to(device)
    return (_randn(gen, device, dtype, 64, 4, 64), pos), lambda f: (lambda g, p: (f(g, p, 1e6, 64),))


def _backward_dx_batch_invariance(subject: Subject, device: str) -> Result:
    """dx of a row depends on that row alone (rms_norm's dweight sums every row: not checked here)."""
    def one(dtype, gen):
        rows, call = _backward_rows(subject.op, device, dtype, gen)
        fn = call(subject.fn())
        return check_batch_invariance(lambda *r: fn(*r)[0], rows)
    return _each_dtype(one)


def _backward_run_to_run(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        rows, call = _backward_rows(subject.op, device, dtype, gen)
        fn = call(subject.fn())
        return check_run_to_run(lambda: fn(*rows), repeats=5)
    return _each_dtype(one)


def _backward_matches_reference(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        rows, call = _backward_rows(subject.op, device, dtype, gen)
        got, want = call(subject.fn())(*rows), call(_reference(subject.op))(*rows)
        names = ("dx", "dweight")
        for name, a, b in zip(names, got, want, strict=False):
            ok, detail = _close(a, b, f"{subject.op} {name}")
            if not ok:
                return False, detail
        return True, f"{', '.join(names[:len(got)])} within tolerance (norm-relative) of the reference backward"
    return _each_dtype(one)


def _backward_suite() -> list[Check]:
    return [Check("dx_batch_invariance", _backward_dx_batch_invariance), Check("run_to_run", _backward_run_to_run),
            Check("matches_reference", _backward_matches_reference)]


def _linear_every_tile_same_bits(subject: Subject, device: str) -> Result:
    """Every tile the rule can pick (TMA kernel where the operands allow it, and the pointer kernel) gives
    the bits of the shipped choice, at M where the rule picks different tiles."""
    from rlk_core.ops.linear import tiles
    from rlk_core.ops.linear import triton as lt

    gen = _gen()
    x, w = _randn(gen, device, torch.bfloat16, 300, 1024), _randn(gen, device, torch.bfloat16, 1536, 1024, scale=1 / 32)
    count = 0
    for m in (1, 20, 65, 90, 300):
        want = lt.linear_2d(x[:m], w, None)
        for tile in tiles.shipped_tiles():
            for tma in (False, True):
                if (not tma and len(tile) > 6) or (tma and not lt._tma_compatible(x, w, want)):
                    continue
                got = lt.linear_2d(x[:m], w, None, tiles.tile_config(tile, 1024, tma=tma))
                report = bitwise_diff_report(got, want, f"M={m}: tile {tile} tma={tma} vs the rule's choice")
                if report is not None:
                    return False, report
                count += 1
    return True, f"{count} (M, tile, kernel) combinations bit-identical to the rule's choice (bf16, 1536x1024)"


def _runs_triton_gemm(subject: Subject, device: str) -> bool:
    return device == "cuda" and subject.ids.get("linear") == "rlk.triton"


def _linear_backward_run_to_run(subject: Subject, device: str) -> Result:
    import rlk_core.ops as ops

    def one(dtype, gen):
        x, w = _randn(gen, device, dtype, 33, 128), _randn(gen, device, dtype, 48, 128, scale=128**-0.5)
        b, g = _randn(gen, device, dtype, 48), _randn(gen, device, dtype, 33, 48)

        def grads():
            leaves = [t.detach().requires_grad_() for t in (x, w, b)]
            return torch.autograd.grad(ops.linear(*leaves), leaves, g)
        return check_run_to_run(grads, repeats=3)
    return _each_dtype(one)


_ROWS = [Check("batch_invariance", _rows_batch_invariance), Check("run_to_run", _rows_run_to_run),
         Check("matches_reference", _rows_matches_reference)]


# -- attention ------------------------------------------------------------------------------------
def _qkv(gen, device, dtype, length, hq=4, hkv=2, d=64):
    return (_randn(gen, device, dtype, length, h, d) for h in (hq, hkv, hkv))


def _varlen(subject: Subject):
    fn = subject.fn("attention_varlen")

    def varlen(q, k, v, cq, ck, scale, causal=True, q_positions=None):
        return fn(q, k, v, cq, ck, scale, causal, q_positions)
    return varlen


def _attention_prefill_chunked_decode(subject: Subject, device: str) -> Result:
    from rlk_core.testing.attention import check_prefill_chunked_decode

    fns = subject.need(ATTENTION_FORWARD)

    def one(dtype, gen):
        q, k, v = _qkv(gen, device, dtype, 150)
        return check_prefill_chunked_decode(q, k, v, 64**-0.5, page_sizes=(16,), chunk_sizes=(37,),
                                            random_chunkings=1, generator=gen, varlen=_varlen(subject),
                                            paged_prefill=fns["attention_paged_prefill"],
                                            decode=fns["attention_decode"])
    return _each_dtype(one)


def _attention_cp_sharding(subject: Subject, device: str) -> Result:
    from rlk_core.testing.attention import check_cp_sharding

    subject.need(ATTENTION_FORWARD)

    def one(dtype, gen):
        q, k, v = _qkv(gen, device, dtype, 150)
        return check_cp_sharding(q, k, v, 64**-0.5, cp_sizes=(2,), varlen=_varlen(subject))
    return _each_dtype(one)


def _attention_batch_composition(subject: Subject, device: str) -> Result:
    from rlk_core.testing.attention import cu_seqlens

    subject.need(ATTENTION_FORWARD)
    varlen = _varlen(subject)

    def one(dtype, gen):
        q, k, v = _qkv(gen, device, dtype, 150)
        oq, ok_, ov = _qkv(gen, device, dtype, 77)
        alone = varlen(q, k, v, cu_seqlens([150], device), cu_seqlens([150], device), 64**-0.5)
        cu = cu_seqlens([33, 150, 44], device)
        packed = varlen(*(torch.cat([o[:33], t, o[33:]]) for o, t in ((oq, q), (ok_, k), (ov, v))), cu, cu,
                        64**-0.5)[33:183]
        report = bitwise_diff_report(packed, alone, "a sequence packed between others vs alone")
        return report is None, report or "a sequence packed between two others equals the sequence alone"
    return _each_dtype(one)


def _attention_run_to_run(subject: Subject, device: str) -> Result:
    from rlk_core.testing.attention import cu_seqlens

    subject.need(ATTENTION_FORWARD)
    varlen = _varlen(subject)

    def one(dtype, gen):
        q, k, v = _qkv(gen, device, dtype, 150)
        cu = cu_seqlens([150], device)
        return check_run_to_run(lambda: varlen(q, k, v, cu, cu, 64**-0.5), repeats=3)
    return _each_dtype(one)


def _attention_matches_reference(subject: Subject, device: str) -> Result:
    from rlk_core.testing.attention import cu_seqlens

    subject.need(ATTENTION_FORWARD)
    varlen, ref = _varlen(subject), _reference("attention_varlen")

    def one(dtype, gen):
        q, k, v = _qkv(gen, device, dtype, 150)
        cu = cu_seqlens([150], device)
        return _close(varlen(q, k, v, cu, cu, 64**-0.5), ref(q, k, v, cu, cu, 64**-0.5, True, None),
                      "attention_varlen")
    return _each_dtype(one)


def _attention_backward_through_autograd(subject: Subject, device: str) -> Result:
    import rlk_core.ops as ops
    from rlk_core.testing.attention import cu_seqlens

    def one(dtype, gen):
        q, k, v = _qkv(gen, device, dtype, 150)
        grad, cu = _randn(gen, device, dtype, 150, 4, 64), cu_seqlens([150], device)

        def grads():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            return torch.autograd.grad(ops.attention_varlen(*leaves, cu, cu, 64**-0.5), leaves, grad)
        return check_run_to_run(grads, repeats=3)
    return _each_dtype(one)


_ATTENTION = [
    Check("prefill_chunked_decode", _attention_prefill_chunked_decode),
    Check("cp_sharding", _attention_cp_sharding),
    Check("batch_composition", _attention_batch_composition),
    Check("run_to_run", _attention_run_to_run),
    Check("matches_reference", _attention_matches_reference),
    Check("backward_run_to_run", _attention_backward_through_autograd, dispatched_only=True),
]


def _kv_cache_write_exact(subject: Subject, device: str) -> Result:
    from rlk_core.testing.attention import vllm_kv_cache

    write = subject.fn()

    def one(dtype, gen):
        k, v = _randn(gen, device, dtype, 20, 2, 64), _randn(gen, device, dtype, 20, 2, 64)
        slots = torch.randperm(8 * 16, generator=gen)[:20].to(device)
        slots[3] = -1
        caches = []
        for fn in (write, None):
            kc, vc = vllm_kv_cache(8, 16, 2, 64, dtype, device=device)  # views covering one NaN-filled buffer
            if fn is None:  # the exact expectation, by indexing
                for i in (slots >= 0).nonzero()[:, 0].tolist():
                    page, off = divmod(int(slots[i]), 16)
                    kc[page, off], vc[page, off] = k[i], v[i]
            else:
                fn(k, v, kc, vc, slots)
            caches.append(torch.cat([kc, vc], -1).nan_to_num(7.0))
        if not torch.equal(caches[0], caches[1]):
            return False, "the cache buffer differs from an exact write of the slots"
        return True, "exact writes (slot -1 skipped, nothing else touched)"
    return _each_dtype(one)


def _backward_inputs(gen, device, dtype):
    from rlk_core.testing.attention import cu_seqlens

    q, k, v, do = (_randn(gen, device, dtype, 89, h, 64) for h in (4, 2, 2, 4))
    cu = cu_seqlens([19, 70], device)
    return (do, q, k, v, cu, cu, 64**-0.5, True, None)


def _attention_backward_run_to_run(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        args = _backward_inputs(gen, device, dtype)
        return check_run_to_run(lambda: subject.fn()(*args), repeats=3)
    return _each_dtype(one)


def _attention_backward_matches_reference(subject: Subject, device: str) -> Result:
    def one(dtype, gen):
        args = _backward_inputs(gen, device, dtype)
        for name, got, want in zip(("dq", "dk", "dv"), subject.fn()(*args), _reference(subject.op)(*args),
                                   strict=True):
            ok, detail = _close(got, want, name)
            if not ok:
                return False, detail
        return True, "dq, dk, dv within tolerance (norm-relative) of the reference backward"
    return _each_dtype(one)


# -- log-probs ------------------------------------------------------------------------------------
def _logp_targets(gen, device, t: int, v: int):
    return torch.randint(0, v, (t,), generator=gen).to(device), (0.5 + torch.rand(t, generator=gen)).to(device)


def _token_public(subject: Subject, op: str = "token_logprobs"):
    from rlk_core.ops import _logp_tree as L

    fn = subject.fn(op)

    def public(logits, target, temperature):
        shards = [logits] if isinstance(logits, torch.Tensor) else list(logits)
        return fn(shards, target, L.as_temperature("token_logprobs", temperature, target.shape[0], target.device))
    return public


def _linear_logp_public(subject: Subject):
    from rlk_core.ops import _logp_tree as L

    fn = subject.fn("linear_logprobs")

    def public(hidden, weight, target, temperature):
        weights = [weight] if isinstance(weight, torch.Tensor) else list(weight)
        return fn(hidden, weights, target,
                  L.as_temperature("linear_logprobs", temperature, target.shape[0], target.device))
    return public


def _token_inputs(gen, device, dtype):
    logits = _randn(gen, device, dtype, 24, 1024, scale=3.0)
    return (logits, *_logp_targets(gen, device, 24, 1024))


def _fused_inputs(gen, device, dtype):
    hidden, weight = _randn(gen, device, dtype, 24, 64), _randn(gen, device, dtype, 1024, 64, scale=0.3)
    return (hidden, weight, *_logp_targets(gen, device, 24, 1024))


def _token_batch_invariance(subject: Subject, device: str) -> Result:
    public = _token_public(subject)

    def one(dtype, gen):
        logits, target, temp = _token_inputs(gen, device, dtype)
        return check_batch_invariance(lambda x, y, t: torch.stack(public(x, y, t), -1), (logits, target, temp),
                                      batch_sizes=(1, 3, 16))
    return _each_dtype(one)


def _token_vocab_shards(subject: Subject, device: str) -> Result:
    from rlk_core.testing.logp import check_vocab_shard_merge

    public = _token_public(subject)

    def one(dtype, gen):
        logits, target, temp = _token_inputs(gen, device, dtype)
        # the partials path always runs rlk's ops: only where rlk's ops are the subject
        return check_vocab_shard_merge(logits, target, temp, shard_counts=(1, 2, 4, 8), token_fn=public,
                                       partials=subject.dispatched)
    return _each_dtype(one)


def _token_run_to_run(subject: Subject, device: str) -> Result:
    public = _token_public(subject)

    def one(dtype, gen):
        args = _token_inputs(gen, device, dtype)
        return check_run_to_run(lambda: public(*args), repeats=3)
    return _each_dtype(one)


def _token_matches_reference(subject: Subject, device: str) -> Result:
    public = _token_public(subject)
    ref = _reference("token_logprobs")

    def one(dtype, gen):
        logits, target, temp = _token_inputs(gen, device, dtype)
        return _close(public(logits, target, temp)[0], ref([logits], target, temp)[0], "token_logprobs")
    return _each_dtype(one)


def _fused_batch_invariance(subject: Subject, device: str) -> Result:
    public = _linear_logp_public(subject)

    def one(dtype, gen):
        hidden, weight, target, temp = _fused_inputs(gen, device, dtype)
        return check_batch_invariance(lambda h, y, t: torch.stack(public(h, weight, y, t), -1),
                                      (hidden, target, temp), batch_sizes=(1, 3, 16))
    return _each_dtype(one)


def _fused_vocab_shards(subject: Subject, device: str) -> Result:
    from rlk_core.testing.logp import check_linear_vocab_shard_merge

    public = _linear_logp_public(subject)

    def one(dtype, gen):
        hidden, weight, target, temp = _fused_inputs(gen, device, dtype)
        return check_linear_vocab_shard_merge(hidden, weight, target, temp, shard_counts=(1, 2, 4, 8),
                                              fused_fn=public, partials=subject.dispatched)
    return _each_dtype(one)


def _fused_equals_unfused(subject: Subject, device: str) -> Result:
    from rlk_core.testing.logp import check_fused_equals_unfused

    parts = subject.need(("linear", "token_logprobs"))
    public, token = _linear_logp_public(subject), _token_public(subject)

    def one(dtype, gen):
        hidden, weight, target, temp = _fused_inputs(gen, device, dtype)
        return check_fused_equals_unfused(hidden, weight, target, temp, fused_fn=public,
                                          linear_fn=lambda h, w: parts["linear"](h, w, None), token_fn=token)
    return _each_dtype(one)


def _fused_run_to_run(subject: Subject, device: str) -> Result:
    public = _linear_logp_public(subject)

    def one(dtype, gen):
        args = _fused_inputs(gen, device, dtype)
        return check_run_to_run(lambda: public(*args), repeats=3)
    return _each_dtype(one)


def _fused_matches_reference(subject: Subject, device: str) -> Result:
    public = _linear_logp_public(subject)
    ref = _reference("linear_logprobs")

    def one(dtype, gen):
        hidden, weight, target, temp = _fused_inputs(gen, device, dtype)
        return _close(public(hidden, weight, target, temp)[0], ref(hidden, [weight], target, temp)[0],
                      "linear_logprobs")
    return _each_dtype(one)


def _fused_backward_run_to_run(subject: Subject, device: str) -> Result:
    import rlk_core.ops as ops

    def one(dtype, gen):
        hidden, weight, target, _ = _fused_inputs(gen, device, dtype)

        def grads():
            h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
            logp, lse = ops.linear_logprobs(h, w, target, 0.7)
            return torch.autograd.grad(logp.sum() + 0.5 * lse.sum(), (h, w))
        return check_run_to_run(grads, repeats=3)
    return _each_dtype(one)


# -- the suite ------------------------------------------------------------------------------------
SUITES: dict[str, list[Check]] = {
    "linear": [*_ROWS, Check("every_tile_same_bits", _linear_every_tile_same_bits, applies=_runs_triton_gemm),
               Check("backward_run_to_run", _linear_backward_run_to_run, dispatched_only=True)],
    "rms_norm": list(_ROWS),
    "swiglu": list(_ROWS),
    "rope": [*_ROWS, Check("offset_invariance", _rope_offset_invariance)],
    **{f"{op}_backward": _backward_suite() for op in ("rms_norm", "swiglu", "rope")},
    **{op: _ATTENTION for op in ATTENTION_FORWARD},  # one family, one suite
    "kv_cache_write": [Check("exact_write", _kv_cache_write_exact)],
    "attention_varlen_backward": [Check("run_to_run", _attention_backward_run_to_run),
                                  Check("matches_reference", _attention_backward_matches_reference)],
    "token_logprobs": [Check("batch_invariance", _token_batch_invariance),
                       Check("vocab_shards_1_2_4_8", _token_vocab_shards),
                       Check("run_to_run", _token_run_to_run), Check("matches_reference", _token_matches_reference)],
    "linear_logprobs": [Check("batch_invariance", _fused_batch_invariance),
                        Check("vocab_shards_1_2_4_8", _fused_vocab_shards),
                        Check("fused_equals_unfused", _fused_equals_unfused),
                        Check("run_to_run", _fused_run_to_run), Check("matches_reference", _fused_matches_reference),
                        Check("backward_run_to_run", _fused_backward_run_to_run, dispatched_only=True)],
}
# the ops whose suite rlk-selfcheck runs (the attention family's suite once, under attention_varlen)
SELFCHECK_OPS = ("linear", "rms_norm", "swiglu", "rope", "rms_norm_backward", "swiglu_backward", "rope_backward",
                 "attention_varlen", "kv_cache_write", "attention_varlen_backward", "token_logprobs", "linear_logprobs")


def checks(subject: Subject, device: str) -> list[Check]:
    """The checks of ``subject.op`` that apply to the subject on ``device`` (``dispatched_only`` ones to
    dispatched ops); ``matches_reference`` is left out where the subject is the reference itself."""
    return [c for c in SUITES.get(subject.op, [])
            if (subject.dispatched or not c.dispatched_only)
            and (c.applies is None or c.applies(subject, device))
            and not (c.name == "matches_reference" and not _not_reference(subject, subject.op))]


def run_check(check: Check, subject: Subject, device: str) -> Result:
    """One check; an exception is a failed check with its reason, never hidden."""
    try:
        ok, detail = check.fn(subject, device)
    except Exception as exc:
        return False, f"raised {type(exc).__name__}: {exc}"
    return bool(ok), detail
