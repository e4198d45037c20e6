"""``rlk.cuda`` (the ops' launch plans served by AOT cubins, ``rlk_core._C``) against ``rlk.triton`` (the same plans
on Triton's JIT), bitwise, on the GPU — every variant of the build run.

Needs the extension and the cubins built (``setup.py build_ext --inplace``: also the build's Triton cache, which
rlk.triton's JIT is pointed at so that it runs the build's own compiles); the module fails, not skips, where rlk.cuda
is unavailable, so a missing build cannot pass as green. Each family's sweep (``tests/core/_cuda_cases.py``: the CPU
suite checks there that rlk.cuda launches exactly what rlk.triton launches) runs here on the device: every served
call ``torch.equal`` to rlk.triton's, twice (the decision, then the kept program); every declined call runs on
rlk.triton without a fallback; every JIT compile was a hit in the build's cache. Then the build's own calls for the
dense families run too, so that every variant the manifest holds has run (``test_every_built_variant_ran``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from rlk_core.aot import build as B
from rlk_core.backends import REGISTRY
from rlk_core.ops import _cuda, _plan, rms_norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
import _cuda_cases as K

pytestmark = pytest.mark.gpu
RAN: set[str] = set()  # the manifest keys of every variant launched in this module
FAMILY_OPS = B.FAMILY_OPS
SWEEPS = {  # family -> its sweep over the dtypes built
    "dense": lambda dts: K.rowwise_and_linear_cases("cuda", dts),
    "attention": lambda dts: (*K.attention_forward_cases("cuda", dts, page_sizes=(1, 16, 64, 256),
                                                         contexts=((5, 130, 64), (1, 1, 1), (2048, 64, 4097))),
                              *K.kv_cache_write_cases("cuda", dts)),
    "attention_backward": lambda dts: K.attention_backward_cases("cuda", dts),
    "token_logprobs": lambda dts: K.logprob_cases("cuda", dts),
    "linear_logprobs": lambda dts: (*K.linear_logprob_cases("cuda", dts), *K.linear_logprobs_backward_cases("cuda",
                                                                                                           dts)),
    "backward": lambda dts: [c for c in K.backward_cases("cuda") if _first_dtype(c[1]) in dts],
}
NEEDS = {"dense": {"linear", "rms_norm", "swiglu", "rope"}, "attention": {"attention"},
         "attention_backward": {"attention_backward"}, "token_logprobs": {"token_logprobs"},
         "linear_logprobs": {"linear_logprobs", "linear", "token_logprobs"},
         "backward": {"linear", "rms_norm", "swiglu", "rope"}}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _first_dtype(args: tuple) -> torch.dtype:
    """The dtype a case is built in: its first tensor's (the input or the gradient)."""
    return next(a.dtype for a in args if isinstance(a, torch.Tensor))


def _twin_served(what: str) -> bool:
    """A JIT compile of a kernel whose misaligned calls rlk.cuda serves from its generic twin (``GENERIC_BITWISE``:
    the same bits, compared in the sweep): rlk.triton's own specialisation of such a call, made here only by the
    comparison, is not one the build compiles (its pointer without the 16-byte divisibility, the rest with it)."""
    return what.split(" ", 1)[0] in _cuda.GENERIC_BITWISE and "(0,): []" in what


def _manifest() -> tuple[dict, dict]:
    return _cuda.manifest(_cuda.TARGETS[torch.cuda.get_device_capability()])[1:]


def _selection() -> tuple[set[str], tuple[torch.dtype, ...]]:
    sel = _manifest()[0].get("selection") or {}
    return set(sel.get("families") or FAMILY_OPS), tuple(DTYPES[d] for d in sel.get("dtypes") or DTYPES)


def _require(families: set[str]) -> None:
    built = _selection()[0]
    if not families <= built:
        pytest.skip(f"{sorted(families - built)}: not in this AOT build's selection {sorted(built)}")


@pytest.fixture(scope="module", autouse=True)
def recording():
    """Every variant ``_C.launch`` / ``_C.run_program`` launches, by manifest key, into :data:`RAN`."""
    ok, why = REGISTRY.is_available(REGISTRY.get("linear", "rlk.cuda"), "cuda")
    assert ok, why
    from rlk_core import _C

    by_handle = {}

    def key(handle):
        if handle not in by_handle:
            by_handle.update({h: next(e["key"] for e in _manifest()[1].values() if e["cubin"] == c)
                              for (_, c), h in _cuda._HANDLES.items()})
        return by_handle[handle]

    launch, run_program = _C.launch, _C.run_program

    def rec_launch(handle, *args):
        RAN.add(key(handle))
        return launch(handle, *args)

    def rec_program(packed, *inputs):
        out = run_program(packed, *inputs)
        if out is not None:
            words, at = memoryview(packed).cast("q"), 2
            for _ in range(words[1]):
                at += 3 + words[at + 2]
            for _ in range(words[at]):
                RAN.add(key(words[at + 1]))
                at += 5 + 7 * words[at + 5]
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(_C, "launch", rec_launch)
    mp.setattr(_C, "run_program", rec_program)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def jit_compiles():
    """rlk.triton's JIT pointed at the Triton cache the in-place build compiled through (``rlk_core/_aot/
    triton-cache``), every compile it makes recorded: ``(cache hit, what)``. Each compile there has the key the JIT
    gives the same launch, so the JIT runs the build's own compiles; a miss is a variant the build compiled other
    than the JIT does."""
    import triton

    folder = _cuda.aot_dir(_cuda.TARGETS[torch.cuda.get_device_capability()]).parent / "triton-cache"
    if not folder.is_dir():
        pytest.fail(f"no {folder}: build with `RLK_BUILD_EXT=1 python setup.py build_ext --inplace` in "
                    "packages/rlk-core (it writes the AOT build's Triton cache there)")
    compiles: list[tuple[bool, str]] = []
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(folder)
        triton.knobs.compilation.listener = lambda **kw: compiles.append(
            (bool(kw["cache_hit"]), f"{kw['src'].name} {kw['src'].constants} {kw['src'].attrs}"))
        yield compiles


def _backends(op: str):
    return REGISTRY.get(op, "rlk.cuda"), REGISTRY.get(op, "rlk.triton")


def _cloned(op: str, args: tuple) -> tuple:
    """``kv_cache_write`` writes into its caches: the same call on copies of them (same sizes and strides)."""
    if op != "kv_cache_write":
        return args
    k, v, kc, vc, slots = args
    copies = []
    for c in (kc, vc):
        t = torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device=c.device)
        copies.append(t.copy_(c))
    return (k, v, *copies, slots)


def _outputs(op: str, args: tuple, out) -> list[torch.Tensor]:
    if op == "kv_cache_write":
        assert out is None
        return [args[2], args[3]]
    if not isinstance(out, (tuple, list)):
        return [out]
    return [t for o in out for t in (o if isinstance(o, list) else [o])]


def _same(op: str, args: tuple, cuda_fn, triton_fn) -> None:
    a_args, b_args = _cloned(op, args), _cloned(op, args)
    a = _outputs(op, a_args, cuda_fn(*a_args))
    try:  # a fault of rlk.cuda's launch named here, not at the next launch
        torch.cuda.synchronize()
    except Exception as exc:
        raise AssertionError(f"{op}: rlk.cuda's launch failed for {K.describe(args)}: {exc}") from exc
    b = _outputs(op, b_args, triton_fn(*b_args))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype, op
        assert torch.equal(x, y), f"{op}: rlk.cuda != rlk.triton for {K.describe(args)}"


def test_cuda_backend_is_available_and_preferred():
    built = _selection()[0]
    for family, ops in FAMILY_OPS.items():
        if family not in built:
            continue
        for op in ops:
            cuda, _ = _backends(op)
            ok, why = REGISTRY.is_available(cuda, "cuda")
            assert ok and REGISTRY.candidates(op, "cuda")[0].id == "rlk.cuda", (op, why)


@pytest.mark.parametrize("sweep", sorted(SWEEPS))
def test_every_served_call_is_bitwise_triton_and_every_declined_one_runs_triton(sweep, jit_compiles, monkeypatch):
    from rlk_core.ops.linear_logprobs import triton as llt

    _require(NEEDS[sweep])
    monkeypatch.setattr(llt, "CHUNK_BYTES", K.linear_chunk_bytes())  # chunks starting at every leaf slot
    served = 0
    for op, args, want in SWEEPS[sweep](_selection()[1]):
        cuda, triton = _backends(op)
        said = cuda.supports(*args)
        assert said[0] == want, (op, said, K.describe(args))
        if not said[0]:
            if triton.supports(*args)[0]:  # (else rlk.triton's own rule declines it too: rlk.reference's call)
                sel = REGISTRY.select(op, "cuda", args, strict=True)
                assert sel.backend.id == "rlk.triton" and sel.fallback_reason is None and "rlk.cuda" in sel.route_reason
            continue
        for _ in range(2):
            _same(op, args, cuda.fn, triton.fn)
        served += 1
    assert served
    missed = [what for hit, what in jit_compiles if not hit and not _twin_served(what)]
    assert not missed, f"{len(missed)} of {len(jit_compiles)} JIT compiles missed the build's cache: {missed[:3]}"


def _copy(a):
    """A copy of a call's argument with its shape, strides and 16-byte alignment class (``clone()`` would align a
    misaligned input and make an expanded one dense: another variant); an expanded input, read only, as it is."""
    if not isinstance(a, torch.Tensor) or 0 in a.stride():
        return a
    off = (a.data_ptr() % 16) // a.element_size()
    span = sum((n - 1) * s for n, s in zip(a.shape, a.stride(), strict=True)) + 1 if a.numel() else 0
    return torch.empty(span + off, dtype=a.dtype, device=a.device).as_strided(a.shape, a.stride(), off).copy_(a)


def _materialize(value, gen, misaligned=False):
    """A meta tensor of a build call as a CUDA tensor of its shape, strides and dtype (one element past a 16-byte
    boundary if ``misaligned``): floats in [0.5, 1.5) (no zero temperature, no NaN to compare), integers zero
    (positions, targets: valid everywhere)."""
    if isinstance(value, list):
        return [_materialize(v, gen) for v in value]
    if not isinstance(value, torch.Tensor):
        return value
    span = sum((n - 1) * s for n, s in zip(value.shape, value.stride(), strict=True)) + 1 if value.numel() else 0
    base = torch.empty(span + int(misaligned), dtype=value.dtype, device="cuda")
    t = base.as_strided(value.shape, value.stride(), int(misaligned))
    fill = base[int(misaligned):]  # every element the view reaches (an expanded view shares them)
    if t.is_floating_point():
        fill.copy_((torch.rand(fill.shape, device="cuda", generator=gen) + 0.5).to(t.dtype))
    else:
        fill.zero_()
    return t


def _valid(fn, args: tuple) -> tuple:
    """A materialised build call made a valid call where zeros are not: the grouped expert GEMM's offsets (zeros: no
    row belongs to an expert, so its output rows are never written) split the rows evenly over the experts."""
    if fn.__name__ in ("grouped_forward", "grouped_backward"):
        offsets, rows = args[-1], args[-3].shape[0]  # (x, weight, offsets) / (grad, x, weight, offsets)
        experts = offsets.numel() - 1
        even = torch.div(torch.arange(experts + 1, device="cuda") * rows, experts, rounding_mode="floor")
        return (*args[:-1], even.to(offsets.dtype))
    return args


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (a NaN equals the same NaN): float tensors compared as integers of their width."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        a, b = a.contiguous().view(ints[a.element_size()]), b.contiguous().view(ints[b.element_size()])
    return torch.equal(a, b)


# no index besides positions/targets
DENSE_BUILD = ("linear", "rms_norm", "swiglu", "rope", "token_logprobs", "linear_logprobs", "linear_tp", "moe")


def _build_calls(module, family: str, dtype: torch.dtype, device: torch.device):
    """The family's build calls as ``(plan function, meta args, misaligned first argument)``: each as built; for the
    families with variants that assume no alignment (swiglu, rope) also with its first tensor one element off; the
    linear_logprobs calls of 2**19 tokens left to the sweep (it reaches their leaf-slot classes with small chunks)."""
    for fn, args in module.build_calls(dtype, _plan.device_facts(device)[0]):
        if family == "linear_logprobs" and args[0].shape[0] > 65536:
            continue
        yield fn, args, False
        if family in ("swiglu", "rope") and fn.__name__ in ("forward", "launch") and (
                len(args) < 6 or args[5] is not module._rope_bwd_kernel):
            yield fn, args, True


def test_every_built_variant_ran(jit_compiles):
    """The build's own calls of the dense families, materialised, through rlk.cuda's plan machinery (decided, then the
    program or the Python path) and through rlk.triton (JitPlan), bitwise; then every variant of the manifest has run
    in this module (the attention families' through their sweeps above)."""
    import importlib

    from rlk_core.aot import build as B

    built, dtypes = _selection()
    gen = torch.Generator(device="cuda").manual_seed(0)
    device = torch.device("cuda", torch.cuda.current_device())
    names = {v: k for k, v in DTYPES.items()}
    for family in sorted(set(DENSE_BUILD) & built):
        module = importlib.import_module(B.FAMILIES[family])
        for dtype in dtypes:
            for fn, meta_args, misaligned in _build_calls(module, family, dtype, device):
                args = _valid(fn, tuple(_materialize(a, gen, misaligned and i == 0) for i, a in enumerate(meta_args)))
                outs = []
                for make in (lambda: _cuda.Run(device), lambda: _plan.JitPlan(device)):
                    run_args = tuple(_copy(a) for a in args)
                    out = fn(make(), *run_args)
                    outs.append([t for t in _outputs("", run_args, out) if isinstance(t, torch.Tensor)]
                                + [a for a in run_args if isinstance(a, torch.Tensor)])
                torch.cuda.synchronize()
                for a, b in zip(*outs, strict=True):  # bit patterns: random inputs can give NaN (same bits)
                    assert _same_bits(a, b), (family, names.get(dtype), fn.__name__)
    want = {e["key"] for e in _manifest()[1].values()}
    never = want - RAN
    assert not never, f"{len(never)} of {len(want)} variants never ran: {sorted(never)[:3]}"
    missed = [what for hit, what in jit_compiles if not hit and not _twin_served(what)]
    assert not missed, missed[:3]


def test_negative_control_another_specialisation_is_not_the_jits_bits(monkeypatch):
    """Why only the JIT's own specialisation is served for reducing kernels: rms_norm's launch with no alignment
    assumed, forced onto a misaligned input (the generic variant is not built for it, so the JIT compiles one here),
    gave other bits than rlk.triton's on the H200 (bf16 [37, 4096]). The comparison has teeth on real binary
    differences; should every launch match, rms_norm could join GENERIC_BITWISE, and this test says so."""
    import triton

    from rlk_core.ops.rms_norm import triton as rt

    g = torch.Generator(device="cuda").manual_seed(0)
    differ = 0
    for h in (1024, 4096, 8192):
        buf = torch.empty(37 * h + 1, device="cuda", dtype=torch.bfloat16)
        x = buf[1:].view(37, h).copy_(torch.randn((37, h), device="cuda", generator=g) * 3)
        w = torch.randn((h,), device="cuda", generator=g).to(torch.bfloat16)
        y = torch.empty_like(x)
        c = rt.config(h)
        # the generic specialisation: every argument unmarked (no alignment, no divisibility), through the JIT
        # (its do_not_specialize hook: every integer and pointer argument)
        generic = triton.jit(rt._rms_norm_fwd_kernel.fn, do_not_specialize=list(range(7)),
                             do_not_specialize_on_alignment=list(range(3)))
        generic[(triton.cdiv(37, c["ROWS"]),)](x, w, y, 37, h, h, h, 1e-6, **c)
        differ += not torch.equal(y, rms_norm(x, w, 1e-6))
    assert differ, "generic rms_norm binaries matched the JIT's on every launch: rms_norm may join GENERIC_BITWISE"


def test_negative_control_a_different_eps_is_caught():
    _require({"rms_norm"})
    cuda, triton = _backends("rms_norm")
    x = torch.randn((8, 4096), device="cuda", dtype=torch.bfloat16)
    w = torch.randn((4096,), device="cuda", dtype=torch.bfloat16)
    assert cuda.supports(x, w, 1e-6)[0]
    assert torch.equal(cuda.fn(x, w, 1e-6), triton.fn(x, w, 1e-6))
    assert not torch.equal(cuda.fn(x, w, 1e-2), triton.fn(x, w, 1e-6))


def _decode_call(page: int = 16, b: int = 8, seed: int = 5) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    hq, hkv, d = 32, 8, 128
    pages = 4096 // page
    cache = torch.randn((b * pages, page, hkv, 2 * d), device="cuda", generator=g).to(torch.bfloat16)
    table = torch.randperm(b * pages, device="cuda", dtype=torch.int32, generator=g).view(b, pages)
    lens = torch.randint(1, 4096, (b,), device="cuda", dtype=torch.int32, generator=g)
    q = torch.randn((b, hq, d), device="cuda", generator=g).to(torch.bfloat16)
    return q, cache[..., :d], cache[..., d:], table, lens, d ** -0.5


def _step_calls() -> list[tuple[str, tuple]]:
    """One vLLM step's calls (kv_cache_write, decode, chunked prefill, the sampler's log-probs) and a training layer's
    (a GEMM's dW, rms_norm's and rope's backward) at the Qwen3-0.6B shape."""
    q, kc, vc, table, lens, scale = _decode_call()
    g = torch.Generator(device="cuda").manual_seed(6)

    def rnd(*shape):
        return torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)

    qkv = rnd(8, 48, 128)
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device="cuda", generator=g)[:8]
    cq = torch.tensor([0, 1, 3, 8], dtype=torch.int32, device="cuda")
    logits = rnd(8, 151936)
    target = torch.randint(0, 151936, (8,), device="cuda", generator=g)
    dy, x = rnd(512, 3072), rnd(512, 1024)
    return [("kv_cache_write", (qkv[:, 32:40], qkv[:, 40:], kc, vc, slots)),
            ("attention_decode", (q, kc, vc, table, lens, scale)),
            ("attention_paged_prefill", (qkv[:, :32], kc, vc, table[:3], cq, lens[:3], scale)),
            ("token_logprobs", ([logits], target, torch.full((8,), 0.8, device="cuda"))),
            ("linear", (dy.t(), x.t(), None)),
            ("rms_norm_backward", (rnd(512, 1024), x, rnd(1024), 1e-6)),
            ("rope_backward", (rnd(512, 16, 128), torch.arange(512, device="cuda"), 1e6, 128))]


def test_the_step_under_graph_capture_and_replay_and_on_a_side_stream():
    """Captured in a CUDA graph (after one eager call: loads and decisions happen before capture), replayed on new
    input values: ``torch.equal`` to rlk.triton run eagerly on those values; on a side stream too."""
    _require({"attention", "token_logprobs", "linear", "rms_norm", "rope"})
    for op, args in _step_calls():
        cuda, triton = _backends(op)
        assert cuda.supports(*args)[0], op
        run_args = _cloned(op, args)
        cuda.fn(*run_args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda.fn(*run_args)
        for t in run_args:  # new values in the same tensors
            for x in t if isinstance(t, list) else [t]:
                if isinstance(x, torch.Tensor) and x.is_floating_point() and 0 not in x.stride():
                    x.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        want = _cloned(op, run_args)
        ref = _outputs(op, want, triton.fn(*want))
        got = _outputs(op, run_args, out)
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b), op
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            side = _outputs(op, run_args, cuda.fn(*_cloned(op, run_args)))
        s.synchronize()
        if op != "kv_cache_write":
            for a, b in zip(side, ref, strict=True):
                assert torch.equal(a, b), op


def test_decode_captured_before_any_offsets_exist_builds_its_own():
    """attention_decode under capture before its cached offsets exist (a graph captured first thing): the call builds
    ``arange(B + 1)`` itself and runs from Python, and the replay is rlk.triton's bits."""
    from rlk_core.ops.attention import triton as at

    _require({"attention"})
    args = _decode_call(b=5, seed=9)
    cuda, triton = _backends("attention_decode")
    cuda.fn(*args)
    saved = dict(at._OFFSETS)
    at._OFFSETS.clear()
    _plan.invalidate()  # the kept program holds the cached offsets' address
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda.fn(*args)
        assert not at._OFFSETS  # nothing cached under capture
        args[0].mul_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, triton.fn(*args))
    finally:
        at._OFFSETS.update(saved)
        _plan.invalidate()


def test_negative_control_the_attention_comparison_can_fail():
    _require({"attention"})
    args = _decode_call(b=4, seed=3)
    cuda, triton = _backends("attention_decode")
    ref = triton.fn(*args)
    assert torch.equal(cuda.fn(*args), ref)
    assert not torch.equal(cuda.fn(*args[:5], args[5] * 1.001), ref)
    assert not torch.equal(cuda.fn(args[0].roll(1, 0), *args[1:]), ref)


def test_an_independent_jit_compile_gives_the_same_bits(tmp_path):
    """rlk.triton compiling afresh (an empty Triton cache, its in-memory kernels dropped) for the step's calls:
    rlk.cuda's AOT binaries give its bits."""
    import triton

    _require({"attention", "token_logprobs", "linear", "rms_norm", "rope"})
    hits: list[bool] = []
    calls = _step_calls()
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(tmp_path)
        triton.knobs.compilation.listener = lambda **kw: hits.append(bool(kw["cache_hit"]))
        import importlib

        from triton.runtime.jit import JITFunction

        from rlk_core.aot import build as B

        for name in B.FAMILIES.values():
            for v in vars(importlib.import_module(name)).values():
                if isinstance(v, JITFunction):
                    v.device_caches.clear()
        for op, args in calls:
            cuda, triton_backend = _backends(op)
            assert cuda.supports(*args)[0], op
            _same(op, args, cuda.fn, triton_backend.fn)
    assert hits and not any(hits)  # every one compiled here
