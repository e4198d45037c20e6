"""Host time per call of rlk's public paths, beside the native alternative (H200 only).

    python benchmarks/host_overhead.py [--profile] [--breakdown] [--sections rowwise,linear_eager]
    python benchmarks/host_overhead.py --op-layer      # the op layer alone, on the CPU (no GPU needed)

Sections: attention, decode, linear (M=1), rowwise (rms_norm / swiglu / rope at M=64, each backend —
``rlk.triton`` and, where built, ``rlk.cuda`` — the public op and the native torch expression),
linear_eager (issue 21's four shapes: the op, each backend, ``F.linear``), attention_step (the per-layer attention
calls of a vLLM step on vLLM's cache layout: kv_cache_write, decode, chunked prefill; each backend and the op),
logprobs (token_logprobs, logp_partials, merge_logp_partials; each backend and the op).

The device benches (harness.time_fns) hide up to ~0.5 ms of host time per call behind a sleep kernel;
this script measures that host time itself. For each path the GPU is first held busy by a long
``torch.cuda._sleep``, then the path is called ``N`` times back to back and the host wall time is
divided by ``N`` (the calls only enqueue work); the median of five such loops is reported. A path
that synchronises with the device shows up as ``syncs = True``: its loop cannot finish before the
sleep does (``syncs = launch queue``: ``N`` calls' launches fill CUDA's queue of pending launches behind the
sleep, while loops of a few calls finish first — their host time is reported). ``gpu_ms`` is the same path's device
time with the host far ahead (events around the call, after a 20 ms sleep), ``bench_ms`` the
harness's number (0.5 ms head start, L2 flushed): ``bench_ms`` well above ``gpu_ms`` means the call is
host-bound at that size. ``--profile`` adds a cProfile listing (top functions by own time) of the
autograd backward to the log; ``--breakdown`` times the pieces of each attention backend call (every
Triton launch, the TMA descriptors) by wrapping them, the rest is "other".

Each public op (path ``... op``) is measured twice: with the fast path (``rlk_core._C.fast``, on where the extension
is loaded) and, as ``... op (Python path)``, with it off (``rlk_core.ops._dispatch.fast_path(False)``); the row's
``fast_path`` says which.

``--op-layer`` times the public ops ``linear``, ``rms_norm``, ``swiglu`` and ``rope`` on small CPU tensors
with a null backend (it returns its first argument) registered above every other: what remains is the op
layer's own host time — argument checks, the path choice, backend selection, the readback report — the
part of an op call that is the same on every backend and device. Value checks are off for it
(``RLK_VALUE_CHECKS=never``: on a GPU, ``auto`` skips them too). Then the same ops (and ``attention_decode``)
through the PyTorch dispatcher, ``torch.ops.rlk.<op>.default`` as Inductor's generated code calls them, with
grad on, under ``no_grad`` and under ``inference_mode``, and eager autograd forward (+ backward) through the
public op and through the dispatcher (:func:`dispatch_us`), each with its Python calls per call. It only prints.

Writes ``host_overhead.json`` / ``.md`` to ``$RLK_BENCH_OUT`` (default ``benchmarks/results/h200``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import io
import pstats
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from _common import randn
from harness import best_host_us, copy_bandwidth, default_out_dir, environment, require_cuda, time_fns, write_results

from rlk_core.backends import REGISTRY
from rlk_core.ops import _dispatch as D
from rlk_core.ops import attention as attn
from rlk_core.ops import linear as rlk_linear

CALLS = 100
FEW_CALLS = 8  # calls per loop that tell a sync from a full launch queue (host_us)
BLOCK_CYCLES = 400_000_000  # ~200 ms at 1.98 GHz: far longer than CALLS calls of any path here


def _warm(fn: Callable[[], Any]) -> None:
    fn()
    torch.cuda.synchronize()


def _calls_while_busy(fn: Callable[[], Any], calls: int = CALLS) -> float:
    """Host seconds for ``calls`` calls of ``fn`` while a sleep holds the GPU (the caller synchronises)."""
    torch.cuda._sleep(BLOCK_CYCLES)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return time.perf_counter() - t0


def _loops(fn: Callable[[], Any], calls: int, loops: int) -> tuple[float, bool]:
    per_call, waited = [], False
    for _ in range(loops):
        per_call.append(_calls_while_busy(fn, calls) / calls * 1e6)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        # if the loop had waited for the sleep, nothing of it would be left when the loop ends
        waited |= time.perf_counter() - t1 < 0.02
    return statistics.median(per_call), waited


def host_us(fn: Callable[[], Any], loops: int = 5) -> tuple[float, bool | str]:
    """Host microseconds per call with the GPU busy (median over ``loops`` loops of ``CALLS`` calls: the host side
    of these machines is noisy), and whether a loop waited for the device: True (the call synchronises), or
    ``"launch queue"`` — ``CALLS`` calls' launches fill CUDA's queue of pending launches (about a thousand) behind
    the sleep, and the host waits for room, while loops of :data:`FEW_CALLS` do not wait (their time is reported)."""
    _warm(fn)
    us, waited = _loops(fn, CALLS, loops)
    if not waited:
        return us, False
    few, waited_few = _loops(fn, FEW_CALLS, loops)
    return (us, True) if waited_few else (few, "launch queue")


def gpu_ms(fn: Callable[[], Any], repeats: int = 10) -> float:
    """Device time of one call with the host far ahead (no host gap can show)."""
    _warm(fn)
    ms = []
    for _ in range(repeats):
        torch.cuda._sleep(40_000_000)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ms.append(s.elapsed_time(e))
    return statistics.median(ms)


def profile(fn: Callable[[], Any], top: int = 30) -> str:
    _warm(fn)
    prof = cProfile.Profile()
    prof.enable()
    _calls_while_busy(fn)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def breakdown(fn: Callable[[], Any]) -> dict[str, float]:
    """Host microseconds per call of each Triton launch (by kernel), of ``kv_descriptor`` and of
    everything else."""
    from triton.runtime.jit import JITFunction

    from rlk_core.ops.attention import triton as at
    from rlk_core.ops.attention import triton_backward as atb

    acc: dict[str, float] = collections.defaultdict(float)

    def timed(key: Callable[..., str], f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                acc[key(*a)] += time.perf_counter() - t
        return wrapper

    patches = [(JITFunction, "run", timed(lambda self, *a: f"launch {self.fn.__name__}", JITFunction.run))]
    patches += [(mod, name, timed(lambda *a, name=name: name, getattr(mod, name)))
                for mod in (at, atb) for name in ("kv_descriptor",)]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    _warm(fn)
    try:
        for obj, name, new in patches:
            setattr(obj, name, new)
        total = _calls_while_busy(fn)
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
    torch.cuda.synchronize()
    out = {k: v / CALLS * 1e6 for k, v in sorted(acc.items())}
    out["other"] = total / CALLS * 1e6 - sum(out.values())
    out["total"] = total / CALLS * 1e6
    return out


def backend_fn(op: str, args: tuple) -> Callable[..., Any]:
    return REGISTRY.select(op, "cuda", args, strict=True).backend.fn


def paths(n: int) -> list[tuple[str, str, Callable[[], Any]]]:
    """(case, path, fn) triples."""
    hq, hkv, d = 32, 8, 128
    scale = d ** -0.5
    q, k, v, g = (randn(s, seed=7000 + i) for i, s in enumerate([(n, hq, d), (n, hkv, d), (n, hkv, d), (n, hq, d)]))
    cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = attn.attention_varlen(*leaves, cu, cu, scale)
    fwd_args = (q, k, v, cu, cu, scale, True, None)
    bwd_args = (g, q, k, v, cu, cu, scale, True, None)
    fwd, bwd = backend_fn("attention_varlen", fwd_args), backend_fn("attention_varlen_backward", bwd_args)
    q4, k4, v4, g4 = (x.view(1, n, x.shape[1], d).transpose(1, 2) for x in (q, k, v, g))
    sl = [x.detach().requires_grad_(True) for x in (q4, k4, v4)]
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        sout = F.scaled_dot_product_attention(*sl, is_causal=True, scale=scale, enable_gqa=True)

    def sdpa_fwd():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)

    case = f"attention 1x{n} (8b heads)"
    out_paths = [
        (case, "forward backend", lambda: fwd(*fwd_args)),
        (case, "forward op", lambda: attn.attention_varlen(q, k, v, cu, cu, scale)),
        (case, "forward op + graph", lambda: attn.attention_varlen(*leaves, cu, cu, scale)),
        (case, "forward SDPA flash", sdpa_fwd),
        (case, "backward backend", lambda: bwd(*bwd_args)),
        (case, "backward op", lambda: torch.ops.rlk.attention_varlen_backward(*bwd_args)),
        (case, "backward autograd", lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)),
        (case, "backward SDPA flash autograd", lambda: torch.autograd.grad(sout, sl, g4, retain_graph=True)),
    ]
    return out_paths


def decode_paths(b: int, ctx: int) -> list[tuple[str, str, Callable[[], Any]]]:
    hq, hkv, d, page = 32, 8, 128, 16
    pages = b * ctx // page
    q = randn((b, hq, d), seed=1)
    kc = randn((pages, page, hkv, d), seed=2)
    vc = randn((pages, page, hkv, d), seed=3)
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, ctx // page)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    args = (q, kc, vc, table, lens, d ** -0.5)
    fn = backend_fn("attention_decode", args)
    case = f"decode {b}x{ctx} paged"
    return [(case, "decode backend", lambda: fn(*args)), (case, "decode op", lambda: attn.attention_decode(*args))]


def linear_paths() -> list[tuple[str, str, Callable[[], Any]]]:
    x, w = randn((1, 4096), seed=4), randn((4096, 4096), seed=5)
    fn = backend_fn("linear", (x, w, None))
    case = "linear M=1 4096x4096"
    return [(case, "linear backend", lambda: fn(x, w, None)), (case, "linear op", lambda: rlk_linear(x, w)),
            (case, "torch F.linear", lambda: F.linear(x, w))]


def _backend_or_none(op: str, backend_id: str, args: tuple) -> Callable[..., Any] | None:
    """``backend_id``'s implementation of ``op`` where it is available and takes ``args``, else None."""
    try:
        b = REGISTRY.get(op, backend_id)
    except Exception:
        return None
    if not (REGISTRY.is_available(b, "cuda")[0] and b.supports(*args)[0]):
        return None
    b.fn(*args)  # a first call: the decision made (and the module loaded) before the timing
    return b.fn


def rowwise_paths(m: int = 64) -> list[tuple[str, str, Callable[[], Any]]]:
    """rms_norm, swiglu and rope at decode-like M: each backend called directly (rlk.triton, rlk.cuda where
    built), the public op (the registry's choice) and the native torch expression."""
    from rlk_core.ops import rms_norm, rope, swiglu
    from rlk_core.ops.rope import reserve_tables

    hq, d, theta = 32, 128, 1e6
    x, w = randn((m, 4096), seed=11), randn((4096,), seed=12)
    xs = randn((m, 2 * 12288), seed=13)
    xr = randn((m, hq, d), seed=14)
    pos = torch.arange(m, device="cuda", dtype=torch.int64)
    reserve_tables(xr.device, d, theta, 4096)  # no host sync per call for the table size
    cases = [
        ("rms_norm", f"rms_norm {m}x4096", (x, w, 1e-6), lambda: rms_norm(x, w, 1e-6),
         ("torch F.rms_norm", lambda: F.rms_norm(x, (4096,), w, 1e-6))),
        ("swiglu", f"swiglu {m}x12288", (xs,), lambda: swiglu(xs),
         ("torch silu*mul", lambda: F.silu(xs[:, :12288]) * xs[:, 12288:])),
        ("rope", f"rope {m}x32x128", (xr, pos, theta, d), lambda: rope(xr, pos, theta, d), None),
    ]
    out = []
    for op, case, args, public, native in cases:
        for bid in ("rlk.triton", "rlk.cuda"):
            fn = _backend_or_none(op, bid, args)
            if fn is not None:
                out.append((case, f"{op} {bid} backend", lambda fn=fn, args=args: fn(*args)))
        out.append((case, f"{op} op", public))
        if native is not None:
            out.append((case, *native))
    return out


def linear_eager_paths() -> list[tuple[str, str, Callable[[], Any]]]:
    """The four shapes of issue 21 (M, K -> N): the public op (registry's choice), each backend directly, and
    cuBLAS's F.linear; ``bench_ms`` (0.5 ms head start) is the per-call eager time compared there."""
    out = []
    for m, k, n in ((64, 4096, 12288), (64, 12288, 4096), (64, 1024, 3072), (4096, 1024, 3072)):
        x, w = randn((m, k), seed=20 + k), randn((n, k), seed=21 + n)
        case = f"linear M={m} {k}->{n}"
        for bid in ("rlk.triton", "rlk.cuda"):
            fn = _backend_or_none("linear", bid, (x, w, None))
            if fn is not None:
                out.append((case, f"linear {bid} backend", lambda fn=fn, x=x, w=w: fn(x, w, None)))
        out += [(case, "linear op", lambda x=x, w=w: rlk_linear(x, w)),
                (case, "torch F.linear", lambda x=x, w=w: F.linear(x, w))]
    return out


def _backends_and_op(op: str, case: str, args: tuple, public: Callable[[], Any]
                     ) -> list[tuple[str, str, Callable[[], Any]]]:
    """``op``'s backends called directly (rlk.triton, rlk.cuda where built and taking ``args``), then the public op."""
    out = []
    for bid in ("rlk.triton", "rlk.cuda"):
        fn = _backend_or_none(op, bid, args)
        if fn is not None:
            out.append((case, f"{op} {bid} backend", lambda fn=fn, args=args: fn(*args)))
    return [*out, (case, f"{op} op", public)]


def attention_step_paths(b: int = 64, ctx: int = 4096) -> list[tuple[str, str, Callable[[], Any]]]:
    """The attention calls vLLM's piecewise-graph mode runs eagerly per layer and step, on vLLM's layout (K/V the
    halves of one ``[blocks, page, Hkv, 2D]`` cache, q/k/v views of the QKV output): ``kv_cache_write`` of a decode
    step's ``b`` tokens, ``attention_decode`` (``b`` x ``ctx``), a chunked prefill (4 sequences x 32 new tokens at
    ``ctx``); each backend directly and the public op."""
    hq, hkv, d, page = 32, 8, 128, 16
    pages = b * ctx // page
    scale = d ** -0.5
    cache = randn((pages, page, hkv, 2 * d), seed=31)
    kc, vc = cache[..., :d], cache[..., d:]
    qkv = randn((b, hq + 2 * hkv, d), seed=32)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    table = torch.randperm(pages, device="cuda", dtype=torch.int32).view(b, ctx // page)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    slots = table[:, -1].long() * page + page - 1  # each sequence's last position
    qp = randn((128, hq, d), seed=33)
    cu = torch.arange(0, 129, 32, dtype=torch.int32, device="cuda")
    t4, l4 = table[:4], lens[:4]  # sliced once: a slice in the timed call would be timed with it
    calls = [("kv_cache_write", f"kv_cache_write {b} tokens", (k, v, kc, vc, slots),
              lambda: attn.kv_cache_write(k, v, kc, vc, slots)),
             ("attention_decode", f"decode {b}x{ctx} vLLM layout", (q, kc, vc, table, lens, scale),
              lambda: attn.attention_decode(q, kc, vc, table, lens, scale)),
             ("attention_paged_prefill", f"chunked prefill 4x32 at {ctx}", (qp, kc, vc, t4, cu, l4, scale),
              lambda: attn.attention_paged_prefill(qp, kc, vc, t4, cu, l4, scale))]
    return [p for op, case, args, public in calls for p in _backends_and_op(op, case, args, public)]


def logprob_paths(t: int = 64, vocab: int = 151936) -> list[tuple[str, str, Callable[[], Any]]]:
    """The sampler's ``token_logprobs`` on ``[t, vocab]`` bf16 logits (one temperature per row), and the
    vocab-parallel halves at TP 8 (``logp_partials`` of one shard, ``merge_logp_partials`` of the gathered
    partials): each backend directly and the public op."""
    from rlk_core import ops as tl  # the public functions (rlk_core.ops.token_logprobs is the function there)

    logits = randn((t, vocab), seed=41)
    target = torch.randint(0, vocab, (t,), device="cuda")
    temp = torch.full((t,), 0.7, device="cuda")
    shard = logits[:, : vocab // 8].contiguous()
    m, s, zt = tl.logp_partials(shard, target, temp, 0, vocab)
    gm, gs = m.repeat(1, 8).contiguous(), s.repeat(1, 8).contiguous()
    calls = [("token_logprobs", f"token_logprobs {t}x{vocab}", ([logits], target, temp),
              lambda: tl.token_logprobs(logits, target, temp)),
             ("logp_partials", f"logp_partials {t}x{vocab // 8} (TP 8)", (shard, target, temp, 0, vocab),
              lambda: tl.logp_partials(shard, target, temp, 0, vocab)),
             ("merge_logp_partials", f"merge_logp_partials {t}x8", (gm, gs, zt, vocab),
              lambda: tl.merge_logp_partials(gm, gs, zt, vocab))]
    return [p for op, case, args, public in calls for p in _backends_and_op(op, case, args, public)]


SECTIONS = ("attention", "decode", "linear", "rowwise", "linear_eager", "attention_step", "logprobs")
NULL_BACKEND = "bench.null"


@contextlib.contextmanager
def _null_served(nulls: dict[str, Callable[..., Any]]) -> Iterator[None]:
    """Each op of ``nulls`` served on the CPU by its function as :data:`NULL_BACKEND`, registered above every
    other, with value checks off; the registry and ``RLK_VALUE_CHECKS`` are restored afterwards."""
    import os

    from rlk_core.backends import Backend

    saved = os.environ.get("RLK_VALUE_CHECKS")
    os.environ["RLK_VALUE_CHECKS"] = "never"
    for op, fn in nulls.items():
        REGISTRY.register(Backend(NULL_BACKEND, op, fn, devices=("cpu",), priority=1 << 20, builtin=True),
                          replace=True)
    REGISTRY.refresh()
    try:
        for op in nulls:
            assert REGISTRY.candidates(op, "cpu")[0].id == NULL_BACKEND
        yield
    finally:
        for op in nulls:
            REGISTRY.unregister(op, NULL_BACKEND)
        REGISTRY.refresh()
        if saved is None:
            os.environ.pop("RLK_VALUE_CHECKS", None)
        else:
            os.environ["RLK_VALUE_CHECKS"] = saved


def _op_layer_args() -> dict[str, tuple]:
    """Small CPU arguments of the ops the op-layer sections time (``torch.ops.rlk.<op>``'s positional form)."""
    x, w, wl = torch.randn(4, 64), torch.randn(64), torch.randn(32, 64)
    xs, xr, pos = torch.randn(4, 128), torch.randn(4, 2, 64), torch.arange(4)
    q, cache = torch.randn(3, 4, 16), torch.randn(6, 16, 2, 16)
    table, lens = torch.arange(6, dtype=torch.int32).view(3, 2), torch.tensor([5, 17, 32], dtype=torch.int32)
    return {"linear": (x, wl, None), "rms_norm": (x, w, 1e-6), "swiglu": (xs,), "rope": (xr, pos, 1e4, 64),
            "attention_decode": (q, cache, cache, table, lens, 0.25)}


def op_layer_us(calls: int = 20000, loops: int = 5) -> list[tuple[str, float]]:
    """Host microseconds per call of each public op with :data:`NULL_BACKEND` (it returns its first argument)
    serving it on the CPU (best of ``loops`` loops of ``calls`` calls; see the module docstring)."""
    from rlk_core.ops import rms_norm, rope, swiglu

    a = _op_layer_args()
    ops = {"linear": lambda: rlk_linear(*a["linear"][:2]), "rms_norm": lambda: rms_norm(*a["rms_norm"]),
           "swiglu": lambda: swiglu(*a["swiglu"]), "rope": lambda: rope(*a["rope"])}
    with _null_served({op: lambda *args: args[0] for op in ops}):
        return [(op, best_host_us(fn, calls, loops, clock=time.thread_time)) for op, fn in ops.items()]


_SHAPES: dict[str, Callable[..., tuple]] = {  # the output shape of each op in _op_layer_args
    "linear": lambda x, w, b: (*x.shape[:-1], w.shape[0]), "rms_norm": lambda x, *a: tuple(x.shape),
    "swiglu": lambda x: (*x.shape[:-1], x.shape[-1] // 2), "rope": lambda x, *a: tuple(x.shape),
    "attention_decode": lambda q, *a: tuple(q.shape)}


def _null_outputs(op: str) -> Callable[..., torch.Tensor]:
    """A null backend for ``op`` that returns a cached tensor of the output's shape for these argument shapes,
    never an argument (the ops' schemas say their outputs alias no input; ``torch.library.custom_op``, which
    registered them before, refused such outputs on its dispatcher path)."""
    outs: dict[tuple, torch.Tensor] = {}
    shape_of = _SHAPES[op]

    def fn(*args: Any) -> torch.Tensor:
        key = (args[0].shape, args[1].shape if isinstance(args[1], torch.Tensor) else None) if len(args) > 1 \
            else args[0].shape
        out = outs.get(key)
        if out is None:
            out = outs[key] = args[0].new_zeros(shape_of(*args))
        return out
    return fn


def _python_calls(fn: Callable[[], Any]) -> int:
    """Python and builtin function calls one call of ``fn`` makes (``sys.setprofile``): a count that, unlike a
    time, does not move with the machine's load."""
    import sys

    fn()
    n = [0]

    def count(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            n[0] += 1
    sys.setprofile(count)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n[0] - 1  # less the profiler's own sys.setprofile(None)


def dispatch_us(calls: int = 5000, loops: int = 5) -> list[tuple[str, str, float, int]]:
    """(op, path, host microseconds per call, Python calls per call) of each op through the PyTorch dispatcher
    (``torch.ops.rlk.<op>.default``: what Inductor's generated code calls) with grad mode on, under
    ``torch.no_grad`` and under ``torch.inference_mode`` (vLLM's), beside the public op (the direct path);
    and, for the ops with a backward, on inputs that require grad: the forward, and forward + backward, through
    the public op (eager autograd: the op's ``autograd.Function``) and through the dispatcher (the op's
    autograd kernel). Null backends (:func:`_null_outputs`) serve the ops on the CPU: what is timed is the op
    layer and the dispatcher, not arithmetic (the elementwise ops' closed-form backwards still compute, on tiny
    tensors). Thread CPU time (best of ``loops`` loops of ``calls`` calls): other processes on the machine do
    not count; the call count (:func:`_python_calls`) does not depend on the machine at all."""
    from rlk_core import ops as rlk_ops

    def row(op: str, path: str, fn: Callable[[], Any], n: int = calls) -> tuple[str, str, float, int]:
        return op, path, best_host_us(fn, n, loops, clock=time.thread_time), _python_calls(fn)

    args = _op_layer_args()
    public = {"linear": rlk_ops.linear, "rms_norm": rlk_ops.rms_norm, "swiglu": rlk_ops.swiglu,
              "rope": rlk_ops.rope, "attention_decode": rlk_ops.attention_decode}
    out = []
    with _null_served({op: _null_outputs(op) for op in args}):
        for op, a in args.items():
            packet = getattr(torch.ops.rlk, op).default

            def dispatched(a=a, packet=packet):
                return packet(*a)
            out += [row(op, "public op", lambda a=a, f=public[op]: f(*a)), row(op, "torch.ops", dispatched)]
            with torch.no_grad():
                out.append(row(op, "torch.ops no_grad", dispatched))
            with torch.inference_mode():
                out.append(row(op, "torch.ops inference_mode", dispatched))
            if op == "attention_decode":
                continue
            leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor)
                      else t for t in a]
            inputs = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]
            grad = torch.ones(_SHAPES[op](*a))
            for name, f in (("public op", public[op]), ("torch.ops", packet)):
                def step(f=f, leaves=leaves, inputs=inputs, grad=grad):
                    return torch.autograd.grad(f(*leaves), inputs, grad)
                out += [row(op, f"{name} fwd (grad)", lambda f=f, leaves=leaves: f(*leaves)),
                        row(op, f"{name} fwd+bwd", step, calls // 5)]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", action="store_true", help="cProfile the autograd backward at L = 2048")
    ap.add_argument("--breakdown", action="store_true", help="host time of the pieces of each attention backend call")
    ap.add_argument("--lengths", default="2048,8192")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--op-layer", action="store_true",
                    help="only the op layer's host time per call (null backend, CPU tensors; no GPU needed)")
    args = ap.parse_args()
    if args.op_layer:
        for op, us in op_layer_us():
            print(f"op layer (null backend, CPU)  {op:10s} {us:6.2f} us / call", flush=True)
        for op, path, us, n in dispatch_us():
            print(f"op layer dispatch (null backend, CPU)  {op:16s} {path:26s} {us:7.2f} us / call  "
                  f"{n:4d} Python calls", flush=True)
        return 0
    sections = set(args.sections.split(","))
    unknown = sorted(sections - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {','.join(SECTIONS)}")
    require_cuda("host_overhead")
    env = environment()
    rows = []
    all_paths = [p for n in map(int, args.lengths.split(",")) for p in paths(n)] if "attention" in sections else []
    all_paths += decode_paths(64, 4096) if "decode" in sections else []
    all_paths += linear_paths() if "linear" in sections else []
    all_paths += rowwise_paths() if "rowwise" in sections else []
    all_paths += linear_eager_paths() if "linear_eager" in sections else []
    all_paths += attention_step_paths() if "attention_step" in sections else []
    all_paths += logprob_paths() if "logprobs" in sections else []
    # the public ops again with the fast path off (rlk_core.ops._dispatch.fast_path): the Python path's host time
    public = [(case, f"{path} (Python path)", fn) for case, path, fn in all_paths if path.endswith(" op")]
    for case, path, fn in [*all_paths, *public]:
        was = D.fast_path(not path.endswith("(Python path)"))
        us, syncs = host_us(fn)
        row = {"case": case, "path": path, "host_us": us, "syncs": syncs, "gpu_ms": gpu_ms(fn),
               "bench_ms": time_fns([fn], repeats=10)["median_ms"], "fast_path": D._FAST[0] is not None}
        D.fast_path(was)
        rows.append(row)
        print(f"{case:28s} {path:30s} host {us:8.1f} us  syncs={syncs!s:12s}  gpu {row['gpu_ms']:.4f} ms  "
              f"bench {row['bench_ms']:.4f} ms  fast path {'on' if row['fast_path'] else 'off'}", flush=True)
    if args.breakdown:
        for case, path, fn in all_paths:
            if path in ("forward backend", "backward backend", "decode backend"):
                parts = breakdown(fn)
                rows.append({"case": case, "path": path + " (breakdown)", "host_us": parts["total"], "parts_us": parts})
                print(f"{case:28s} {path:30s} " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()), flush=True)
    if args.profile:
        backward = next(fn for case, path, fn in all_paths if path == "backward autograd")
        print(profile(backward))
    meta = {"env": env, "copy": copy_bandwidth(), "repeats": 10, "calls": CALLS}
    write_results(default_out_dir(), "host_overhead", meta, rows,
                  [("case", "case"), ("path", "path"), ("host_us", "host us / call"), ("syncs", "syncs"),
                   ("gpu_ms", "device ms"), ("bench_ms", "bench ms (0.5 ms head start)")])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
