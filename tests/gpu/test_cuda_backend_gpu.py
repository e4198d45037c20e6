"""``rlk.cuda`` (AOT cubins launched by ``rlk_core._C``) against ``rlk.triton`` (the JIT), bitwise, on every
variant of the manifest.

Needs the extension built (``setup.py build_ext --inplace`` or an installed platform wheel) and the cubins
(package data or ``RLK_AOT_DIR``); the whole module requires ``rlk.cuda`` to be available on the GPU — a
GPU machine without them fails here rather than skipping, so a missing build cannot pass as green.

Each op's sizes sweep every config its rule can give, in both layout classes; the launches record which
cubin ran, and the test asserts that the set of cubins run is the manifest's whole set for the op (every
variant exercised) and that each result is ``torch.equal`` to ``rlk.triton``'s.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from rlk_core.aot import specs as S
from rlk_core.backends import REGISTRY
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops import rms_norm  # the public op (importing rlk_core.ops registers every backend)

pytestmark = pytest.mark.gpu

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _pow2(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length()) if 1 << i <= n]


@pytest.fixture(scope="module")
def ran(monkeypatch_module):
    """Records the cubin of every ``_C.launch`` and ``_C.run`` (a launch record: its handle is the first word)."""
    from rlk_core import _C

    seen: set[str] = set()
    launch, run = _C.launch, _C.run

    def recording(handle, *args):
        seen.add(next(c for (d, c), h in cc._HANDLES.items() if h == handle))
        return launch(handle, *args)

    def recording_run(packed, *inputs):
        out = run(packed, *inputs)
        if out is not None or not cc.record_has_output(packed):  # else nothing launched (the general code then
            # launches, through _C.launch); a record without an output (kv_cache_write) launches and returns None
            handle = cc.record_handle(packed)
            seen.add(next(c for (d, c), h in cc._HANDLES.items() if h == handle))
        return out

    monkeypatch_module.setattr(_C, "launch", recording)
    monkeypatch_module.setattr(_C, "run", recording_run)
    return seen


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _backends(op: str):
    return REGISTRY.get(op, "rlk.cuda"), REGISTRY.get(op, "rlk.triton")


def _selection() -> dict:
    """What this AOT build enumerated (its manifest's ``selection``: a device sitting may build some op families
    or dtypes only, ``RLK_BUILD_OPS`` / ``RLK_BUILD_DTYPES``); a manifest without one is a full build."""
    target = cc.TARGETS[torch.cuda.get_device_capability()]
    sel = cc._manifest(target)[1].get("selection") or {}
    return {"ops": sel.get("ops") or list(S.OPS), "dtypes": sel.get("dtypes") or [S.TRITON_TYPE[d] for d in DTYPES]}


def _built_dtypes() -> tuple[torch.dtype, ...]:
    names = _selection()["dtypes"]
    return tuple(d for d in DTYPES if S.TRITON_TYPE[d] in names)


def _require_built(family: str, dtype: torch.dtype | None = None) -> None:
    """Skip (named in the log) a family or dtype this build left out; every built one is checked in full."""
    sel = _selection()
    if family not in sel["ops"]:
        pytest.skip(f"{family}: not in this AOT build's selection {sel['ops']}")
    if dtype is not None and S.TRITON_TYPE[dtype] not in sel["dtypes"]:
        pytest.skip(f"{S.TRITON_TYPE[dtype]}: not in this AOT build's dtypes {sel['dtypes']}")


def _manifest_cubins(op: str, layouts: set[str], dtype: torch.dtype | None = None) -> set[str]:
    """The manifest's variants of ``op`` in ``layouts`` whose input dtype is ``dtype`` (all when None)."""
    target = cc.TARGETS[torch.cuda.get_device_capability()]
    _, _, idx = cc._manifest(target)
    want = None if dtype is None else S.TRITON_TYPE[dtype]
    return {
        e["cubin"]
        for e in idx.values()
        if e["op"] == op
        and e["layout"] in layouts
        and (want is None or e["dtype"].split(",")[0].split("->")[0] == want)
    }


def test_cuda_backend_is_available_and_preferred():
    for op in ("linear", "rms_norm", "swiglu", "rope", "attention_varlen", "attention_varlen_backward",
               "attention_paged_prefill", "attention_decode", "kv_cache_write", "token_logprobs",
               "token_logprobs_backward", "logp_partials", "merge_logp_partials", "linear_logprobs",
               "linear_logp_partials"):
        cuda, _ = _backends(op)
        ok, why = REGISTRY.is_available(cuda, "cuda")
        assert ok, why
        assert REGISTRY.candidates(op, "cuda")[0].id == "rlk.cuda"


def _served_layouts(op: str) -> set[str]:
    return {"aligned", "generic"} if op in cc.GENERIC_BITWISE else {"aligned"}


def _check(op: str, args: tuple, expect_served: bool | None = None) -> bool:
    cuda, triton = _backends(op)
    ok, why = cuda.supports(*args)
    if expect_served is not None:
        assert ok == expect_served, why
    if not ok:
        return False
    a, b = cuda.fn(*args), triton.fn(*args)
    assert torch.equal(a, b), f"{op}: rlk.cuda != rlk.triton for {[getattr(t, 'shape', t) for t in args]}"
    return True


def _misalign(t: torch.Tensor) -> torch.Tensor:
    """The same values at a storage offset of one element (not 16-byte aligned)."""
    buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    out = buf[1:].view(t.shape)
    out.copy_(t)
    return out


def _rms_norm_sweep(layouts: set[str], dtypes=DTYPES) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for dtype in dtypes:
        for wdtype in sorted({dtype, torch.float32}, key=str):
            for b in _pow2(65536):
                sizes = {b, b // 2 + 1} if b >= 4 else {b}
                for h in sorted(sizes):
                    m = 37 if h <= 4096 else 5
                    x = torch.randn((m, h), device="cuda", dtype=torch.float32, generator=g).to(dtype) * 3
                    w = torch.randn((h,), device="cuda", dtype=torch.float32, generator=g).to(wdtype)
                    aligned = h % 16 == 0
                    if "aligned" in layouts or not aligned:
                        _check("rms_norm", (x, w, 1e-6), aligned or "generic" in layouts)
                    if "generic" in layouts and aligned:
                        _check("rms_norm", (_misalign(x), w, 1e-6), True)


def _swiglu_sweep(layouts: set[str], dtypes=DTYPES) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    for dtype in dtypes:
        for b in _pow2(4096):
            for inter in sorted({b, b // 2 + 1} if b >= 4 else {b}):
                x = torch.randn((23, 2 * inter), device="cuda", dtype=torch.float32, generator=g).to(dtype) * 3
                aligned = inter % 16 == 0
                if "aligned" in layouts or not aligned:
                    _check("swiglu", (x,), aligned or "generic" in layouts)
                if "generic" in layouts and aligned:
                    _check("swiglu", (_misalign(x),), True)


def _rope_sweep(layouts: set[str], dtypes=DTYPES) -> None:
    from rlk_core.aot.specs import ROPE_SHAPES

    g = torch.Generator(device="cuda").manual_seed(2)
    for dtype in dtypes:
        for d, r in ROPE_SHAPES:
            for nh in _pow2(1 << 16):
                for pdt in (torch.int32, torch.int64):
                    t = 3 if nh <= 1024 else 1
                    x = torch.randn((t, nh, d), device="cuda", dtype=torch.float32, generator=g).to(dtype)
                    pos = torch.randint(0, 5000, (t,), device="cuda", dtype=pdt, generator=g)
                    aligned = nh % 16 == 0
                    if "aligned" in layouts or not aligned:
                        _check("rope", (x, pos, 10000.0, r), aligned or "generic" in layouts)
                    if "generic" in layouts and aligned:
                        _check("rope", (_misalign(x), pos, 10000.0, r), True)


# tests/core/test_aot.py's sweep (every tile, tail, last-row box and row split of the rule), K of an aligned launch
_MS = [*range(1, 161), 200, 256, 500, 1000, 1024, 2048, 3000, 4096, 6000, 8192]
_NS = (1024, 1536, 3072, 4096, 6144, 24576, 37984, 151936)
_KS = (1040, 1024, 4096, 12288)  # multiples of 16 (an aligned launch); 1040: not a multiple of BLOCK_K


@functools.cache
def linear_cases() -> tuple[list[tuple[torch.dtype, int, int, int, bool]], set[tuple]]:
    """For every variant the rule launches over the sweep (aligned operands: TMA where the launcher takes it),
    the cheapest shape that launches it; returns the shapes and the variants' manifest keys."""
    best: dict[tuple, tuple[int, tuple]] = {}
    for dtype in DTYPES:
        for m in _MS:
            for n in _NS:
                for k in _KS:
                    for bias in (False, True):
                        for spec in S.linear_launch_specs(dtype, m, n, k, True, bias=bias):
                            key = cc.variant_key(
                                spec.kernel,
                                spec.dtype,
                                spec.layout,
                                {**dict(spec.constexprs), **{o: 1 for o in spec.ones}},
                            )
                            cost = m * n * k
                            if key not in best or cost < best[key][0]:
                                best[key] = (cost, (dtype, m, n, k, bias))
    return sorted({c for _, c in best.values()}, key=str), set(best)


def _linear_sweep(layouts: set[str], dtypes=DTYPES) -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    shapes, _ = linear_cases()
    for dtype, m, n, k, bias in shapes:
        if dtype not in dtypes:
            continue
        x = torch.randn((m, k), device="cuda", dtype=torch.float32, generator=g).to(dtype)
        w = torch.randn((n, k), device="cuda", dtype=torch.float32, generator=g).to(dtype) / k**0.5
        b = torch.randn((n,), device="cuda", dtype=torch.float32, generator=g).to(dtype) if bias else None
        _check("linear", (x, w, b), True)
    # a layout the JIT compiles its own variant for (K = 1000, TMA-compatible but not a multiple of 16):
    # declined, rlk.triton runs it
    x, w = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in ((8, 1000), (64, 1000)))
    assert not REGISTRY.get("linear", "rlk.cuda").supports(x, w, None)[0]


SWEEPS = {"linear": _linear_sweep, "rms_norm": _rms_norm_sweep, "swiglu": _swiglu_sweep, "rope": _rope_sweep}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: S.TRITON_TYPE[d])
@pytest.mark.parametrize("op", sorted(SWEEPS))
def test_every_served_variant_is_bitwise_triton(op, dtype, ran):
    _require_built(op, dtype)
    layouts = _served_layouts(op)
    ran.clear()
    SWEEPS[op](layouts, (dtype,))
    want = _manifest_cubins(op, layouts, dtype) - _unreachable(op)
    assert want and ran == want, f"{op}: never run: {sorted(want - ran)[:5]}; unexpected: {sorted(ran - want)[:5]}"


def _unreachable(op: str) -> set[str]:
    """Variants no launch of ``rlk.cuda`` can take: ``aligned`` rope variants whose config only head counts
    below 16 give (an aligned launch needs a head count divisible by 16); linear variants the sweep's rule
    never launches with aligned operands (the fp32-output GEMMs of the log-prob backward, which rlk.cuda does
    not serve)."""
    target = cc.TARGETS[torch.cuda.get_device_capability()]
    if op == "linear":
        reached = linear_cases()[1]
        return {e["cubin"] for key, e in cc._manifest(target)[2].items() if e["op"] == "linear" and key not in reached}
    if op != "rope":
        return set()
    from rlk_core.ops.rope import triton as tr

    out = set()
    for e in cc._manifest(target)[2].values():
        if e["op"] == "rope" and e["layout"] == "aligned":
            c = e["constexprs"]
            reach = {(tr.config(nh, c["HALF"])["BLOCK_H"]) for nh in _pow2(1 << 16) if nh % 16 == 0}
            if c["BLOCK_H"] not in reach:
                out.add(e["cubin"])
    return out


def test_negative_control_another_specialisation_is_not_the_jits_bits(monkeypatch, request):
    """Why only the JIT's own specialisation is served for reducing kernels: rms_norm's ``generic`` binary
    (no alignment assumed), forced onto launches the JIT compiles a partly specialised variant for, gave
    other bits than ``rlk.triton`` on the H200 (measured: bf16 [37, 4096] at a misaligned address). The
    comparison therefore has teeth on real binary differences; should every launch ever match, rms_norm could
    join GENERIC_BITWISE and this test says so."""
    monkeypatch.setattr(cc, "GENERIC_BITWISE", cc.GENERIC_BITWISE | {"rms_norm"})
    cc.clear_records()  # the kept decisions read GENERIC_BITWISE
    request.addfinalizer(cc.clear_records)  # and those made under the patched set must not outlive it
    cuda, triton = _backends("rms_norm")
    g = torch.Generator(device="cuda").manual_seed(0)
    differ = 0
    for h in (1024, 4096, 8192):
        x = _misalign(torch.randn((37, h), device="cuda", generator=g).to(torch.bfloat16) * 3)
        w = torch.randn((h,), device="cuda", generator=g).to(torch.bfloat16)
        assert cuda.supports(x, w, 1e-6)[0]
        differ += not torch.equal(cuda.fn(x, w, 1e-6), triton.fn(x, w, 1e-6))
    assert differ, "generic rms_norm binaries matched the JIT's on every launch: rms_norm may join GENERIC_BITWISE"


def test_negative_control_a_different_eps_is_caught():
    cuda, triton = _backends("rms_norm")
    x = torch.randn((8, 4096), device="cuda", dtype=torch.bfloat16)
    w = torch.randn((4096,), device="cuda", dtype=torch.bfloat16)
    assert cuda.supports(x, w, 1e-6)[0]
    assert torch.equal(cuda.fn(x, w, 1e-6), triton.fn(x, w, 1e-6))
    assert not torch.equal(cuda.fn(x, w, 1e-2), triton.fn(x, w, 1e-6))


def test_declined_call_runs_triton_without_a_fallback():
    from rlk_core import readback

    x = torch.randn((4, 100), device="cuda", dtype=torch.bfloat16)  # H = 100: not a multiple of 16
    w = torch.ones((100,), device="cuda", dtype=torch.bfloat16)
    sel = REGISTRY.select("rms_norm", "cuda", (x, w, 1e-6), strict=True)
    assert sel.backend.id == "rlk.triton" and sel.fallback_reason is None and "rlk.cuda" in sel.route_reason
    assert readback.strict_now()  # the default mode: a fallback would raise in the op call below
    assert torch.equal(rms_norm(x, w), REGISTRY.get("rms_norm", "rlk.triton").fn(x, w, 1e-6))


def test_launch_on_a_side_stream_and_under_graph_capture():
    cuda, triton = _backends("swiglu")
    x = torch.randn((64, 2 * 3072), device="cuda", dtype=torch.bfloat16)
    ref = triton.fn(x)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = cuda.fn(x)
    s.synchronize()
    assert torch.equal(y, ref)
    cuda.fn(x)  # load before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda.fn(x)
    x.mul_(0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, triton.fn(x))


def test_launch_records_serve_leading_dims_and_row_slices_as_the_general_code():
    """The launch records (``_C.run``: output allocated and arguments packed in C++) on inputs with leading
    dims (a TMA operand viewed 2-D in C++) and row slices of wider buffers, twice (the decision, then a hit):
    bitwise ``rlk.triton`` and the general code (``forward_general``) alike."""
    import importlib

    g = torch.Generator(device="cuda").manual_seed(7)

    def rnd(*shape):
        return torch.randn(shape, device="cuda", generator=g).to(torch.bfloat16)

    wide = rnd(6, 64, 4096 + 64)
    cases = {
        "linear": [(rnd(2, 32, 1024), rnd(3072, 1024), None), (rnd(1, 64, 4096), rnd(12288, 4096), rnd(12288))],
        "rms_norm": [(rnd(2, 37, 4096), rnd(4096), 1e-6), (wide[:, :, :4096], rnd(4096), 1e-6)],
        "swiglu": [(rnd(2, 23, 6144),), (wide[..., :4096],)],
    }
    for op, calls in cases.items():
        cuda, triton = _backends(op)
        general = importlib.import_module(f"rlk_core.ops.{op}.cuda").forward_general
        for args in calls:
            assert cuda.supports(*args)[0], (op, [getattr(a, "shape", a) for a in args])
            ref = triton.fn(*args)
            for _ in range(2):
                out = cuda.fn(*args)
                assert out.shape == ref.shape and out.stride() == ref.stride()
                assert torch.equal(out, ref) and torch.equal(out, general(*args)), op


# -- the attention and log-prob ops ----------------------------------------------------------------------
# The sweeps are tests/core/_cuda_cases.py's (the CPU suite checks there that their served calls reach every
# variant the AOT enumeration builds for these families and that rlk.cuda launches what rlk.triton launches).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))
import _cuda_cases as K  # noqa: E402

from rlk_core.ops import _cuda_calls as cl  # noqa: E402

FAMILIES = {  # each sweep over the dtypes this build holds
    "attention": lambda dts: K.attention_forward_cases("cuda", dts, page_sizes=(1, 16, 64, 256),
                                                       contexts=((5, 130, 64), (1, 1, 1), (2048, 64, 4097))),
    "kv_cache_write": lambda dts: K.kv_cache_write_cases("cuda", dts),
    "attention_backward": lambda dts: K.attention_backward_cases("cuda", dts),
    "logp": lambda dts: (*K.logprob_cases("cuda", dts), *K.linear_logprob_cases("cuda", dts),
                         *K.linear_logprobs_backward_cases("cuda", dts)),
}


@pytest.fixture(scope="module")
def ran_programs(ran, monkeypatch_module):
    """:func:`ran`, and the cubins of every ``_C.run_program`` (each launch of the program)."""
    from rlk_core import _C

    run_program = _C.run_program

    def recording(packed, *inputs):
        out = run_program(packed, *inputs)
        if out is not None:
            for h in cl.program_handles(packed):
                ran.add(next(c for (d, c), hh in cc._HANDLES.items() if hh == h))
        return out

    monkeypatch_module.setattr(_C, "run_program", recording)
    return ran


def _cloned(op: str, args: tuple) -> tuple:
    """``kv_cache_write`` writes into its caches: the same call on copies of them (same sizes and strides)."""
    if op != "kv_cache_write":
        return args
    k, v, kc, vc, slots = args
    copies = []
    for c in (kc, vc):
        t = torch.empty_strided(c.shape, c.stride(), dtype=c.dtype, device=c.device)
        t.copy_(c)
        copies.append(t)
    return (k, v, *copies, slots)


def _outputs(op: str, args: tuple, out):
    if op == "kv_cache_write":
        assert out is None
        return [args[2], args[3]]
    if not isinstance(out, (tuple, list)):
        return [out]
    return [t for o in out for t in (o if isinstance(o, list) else [o])]  # (dhidden, [dW per shard]) flattened


def _same(op: str, args: tuple, cuda_fn, triton_fn) -> None:
    a_args, b_args = _cloned(op, args), _cloned(op, args)
    a = _outputs(op, a_args, cuda_fn(*a_args))
    try:  # a fault of rlk.cuda's launch named here, not at the next launch (whose load would report it)
        torch.cuda.synchronize()
    except Exception as exc:
        raise AssertionError(f"{op}: rlk.cuda's launch failed for {K.describe(args)}: {exc}") from exc
    b = _outputs(op, b_args, triton_fn(*b_args))
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype, op
        assert torch.equal(x, y), f"{op}: rlk.cuda != rlk.triton for {K.describe(args)}"


@pytest.fixture
def aot_triton_cache():
    """rlk.triton's JIT pointed at the Triton cache the in-place AOT build compiled through
    (``setup.py build_ext --inplace``: ``rlk_core/_aot/triton-cache``), and every compile it makes recorded
    (``cache_hit``). Each compile there has the key the JIT gives the same launch (checked on the CPU by
    tests/core/test_aot.py), so rlk.triton runs the AOT build's own compiles instead of ~1000 JIT compiles; a
    missing cache fails here (build in place) rather than taking an hour."""
    import triton

    folder = cc.aot_dir(cc.TARGETS[torch.cuda.get_device_capability()]).parent / "triton-cache"
    if not folder.is_dir():
        pytest.fail(f"no {folder}: build with `RLK_BUILD_EXT=1 python setup.py build_ext --inplace` in "
                    "packages/rlk-core (it writes the AOT build's Triton cache there)")
    compiles: list[tuple[bool, str]] = []  # (cache hit, what was compiled)
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(folder)
        triton.knobs.compilation.listener = lambda **kw: compiles.append(
            (bool(kw["cache_hit"]), f"{_compiled(kw['src'], kw['metadata'])} in {_CALL[0]} "
                                    f"(cache folder {_folder(kw['metadata_group'])})"))
        yield compiles


_CALL = [""]  # the sweep call being run, for the compiles it makes


def _compiled(src, metadata: dict) -> str:
    """A JIT compile named for a failure message: kernel, constexprs, the pointer and descriptor types, the
    arguments (or descriptor fields, ``name.i``) marked divisible by 16, and the compile options that differ."""
    names = list(src.signature)
    types = {n: t for n, t in src.signature.items() if str(t).startswith(("*", "tensordesc"))}
    divisible = sorted(f"{names[k[0]]}{''.join(f'.{i}' for i in k[1:])}" for k, v in src.attrs.items()
                       if ["tt.divisibility", 16] in v)
    opts = {o: metadata.get(o) for o in ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion",
                                          "launch_pdl")}
    return f"{src.name} {src.constants} types={types} D16={divisible} {opts}"


def _folder(group: dict) -> str:
    """The Triton cache folder (base32 of the compile key) a compile's files are in."""
    return Path(next(iter(group.values()))).parent.name if group else "?"


def _missed(compiles: list[tuple[bool, str]]) -> str:
    """The misses, each with whether the build compiled that key (a manifest entry's ``triton_key``), and the build's
    own check of its cache (``aot.build.cache_report``)."""
    from rlk_core.aot.build import cache_folder

    _, manifest, idx = cc._manifest(cc.TARGETS[torch.cuda.get_device_capability()])
    built = {cache_folder(e["triton_key"]): e["variant"]
             for e in idx.values() if e.get("triton_key")}
    missed = [f"{what}: {'built as ' + built[f] if (f := what.rsplit(' ', 1)[-1].rstrip(')')) in built else 'no build'}"
              for hit, what in compiles if not hit]
    return (f"{len(missed)} of {len(compiles)} JIT compiles missed the AOT build's cache: {missed[:4]}; "
            f"build: {manifest.get('triton_cache')}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_served_attention_and_logp_variant_is_bitwise_triton(family, ran_programs, monkeypatch,
                                                                   aot_triton_cache):
    """Every call of the family's sweep: rlk.cuda takes exactly the calls meant to be served — their results
    ``torch.equal`` to rlk.triton's (twice: the decision, then the kept record or program) — and declines the others,
    which the registry then runs on rlk.triton without a fallback; the cubins launched are the manifest's whole set
    for the family (every variant run); every compile rlk.triton's JIT made for it was found in the AOT build's
    Triton cache (the JIT's binary for each launch is the build's; test_an_independent_jit_compile_... compiles
    some afresh)."""
    from rlk_core.ops.linear_logprobs import triton as llt

    _require_built(family)
    if family == "logp":  # linear_logprobs' chunk GEMMs are the linear family's variants, its dW linear_backward's
        _require_built("linear")
        _require_built("linear_backward")
    monkeypatch.setattr(llt, "CHUNK_BYTES", K.linear_chunk_bytes())
    ran_programs.clear()
    served = 0
    for op, args, want in FAMILIES[family](_built_dtypes()):
        cuda, triton = _backends(op)
        said = cuda.supports(*args)
        assert said[0] == want, (op, said, K.describe(args))
        if not said[0]:
            if triton.supports(*args)[0]:  # (else rlk.triton's own rule declines it too: rlk.reference's call)
                sel = REGISTRY.select(op, "cuda", args, strict=True)
                assert sel.backend.id == "rlk.triton" and sel.fallback_reason is None, (op, sel)
                assert "rlk.cuda" in sel.route_reason, (op, sel)
            continue
        _CALL[0] = f"{op} {K.describe(args)}"
        for _ in range(2):
            _same(op, args, cuda.fn, triton.fn)
        served += 1
    ops = {"attention": {"attention"}, "kv_cache_write": {"kv_cache_write"},
           "attention_backward": {"attention_backward"}, "logp": {"logp"}}[family]
    want = set().union(*(_manifest_cubins(op, {"aligned"}) for op in ops))
    # linear_logprobs' chunk logits come from the public linear op, which rlk.cuda serves with the linear family's
    # cubins, and its backward's dW products are the linear backward's dW variants (each checked by that family's own
    # test): they may run here, nothing else outside the family may
    also = (_manifest_cubins("linear", set(S.LAYOUTS)) | _manifest_cubins("linear_backward", {"aligned"})
            if family == "logp" else set())
    unexpected = ran_programs - want - also
    assert served and want <= ran_programs and not unexpected, (f"never run: {sorted(want - ran_programs)[:5]}; "
                                                                f"unexpected: {sorted(unexpected)[:5]}")
    assert all(hit for hit, _ in aot_triton_cache), _missed(aot_triton_cache)


def test_an_independent_jit_compile_gives_the_same_bits(tmp_path):
    """rlk.triton compiling afresh (an empty Triton cache, its in-memory kernels dropped) for a decode, a
    kv_cache_write, a backward and a token_logprobs call: rlk.cuda's AOT binaries give its bits."""
    import triton

    for family in ("attention", "kv_cache_write", "attention_backward", "logp"):
        _require_built(family, torch.bfloat16)  # bf16 calls

    from rlk_core.ops.attention import triton as at
    from rlk_core.ops.attention import triton_backward as ab
    from rlk_core.ops.token_logprobs import triton as tt

    calls = [(op, args) for op, args in _step_calls() if op in ("kv_cache_write", "attention_decode",
                                                                 "token_logprobs")]
    calls.append(next((op, a) for op, a, want in K.attention_backward_cases("cuda", (torch.bfloat16,)) if want))
    kernels = [at._attention_fwd_kernel, at._kv_cache_write_kernel, ab._attn_bwd_stats_kernel, ab._attn_bwd_dq_kernel,
               ab._attn_bwd_dkdv_kernel, ab._attn_bwd_group_sum_kernel, tt._logp_block_fwd_kernel,
               tt._merge_blocks_kernel, tt._merge_groups_kernel]
    hits: list[bool] = []
    with triton.knobs.cache.scope(), triton.knobs.compilation.scope():
        triton.knobs.cache.dir = str(tmp_path)
        triton.knobs.compilation.listener = lambda **kw: hits.append(bool(kw["cache_hit"]))
        for k in kernels:
            k.device_caches.clear()
        for op, args in calls:
            cuda, triton_backend = _backends(op)
            assert cuda.supports(*args)[0], op
            _same(op, args, cuda.fn, triton_backend.fn)
    assert hits and not any(hits)  # every one compiled here


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
    """One vLLM step's attention calls (kv_cache_write, decode, chunked prefill) and the sampler's log-probs."""
    q, kc, vc, table, lens, scale = _decode_call()
    g = torch.Generator(device="cuda").manual_seed(6)
    qkv = torch.randn((8, 48, 128), device="cuda", generator=g).to(torch.bfloat16)
    slots = torch.randperm(kc.shape[0] * kc.shape[1], device="cuda", generator=g)[:8]
    cq = torch.tensor([0, 1, 3, 8], dtype=torch.int32, device="cuda")
    logits = torch.randn((8, 151936), device="cuda", generator=g).to(torch.bfloat16)
    target = torch.randint(0, 151936, (8,), device="cuda", generator=g)
    return [("kv_cache_write", (qkv[:, 32:40], qkv[:, 40:], kc, vc, slots)),
            ("attention_decode", (q, kc, vc, table, lens, scale)),
            ("attention_paged_prefill", (qkv[:, :32], kc, vc, table[:3], cq, lens[:3], scale)),
            ("token_logprobs", ([logits], target, torch.full((8,), 0.8, device="cuda")))]


def test_attention_and_logp_under_graph_capture_and_replay():
    """Captured in a CUDA graph (after one eager call: loads and decisions happen before capture), replayed on
    new input values: ``torch.equal`` to rlk.triton run eagerly on those values; on a side stream too."""
    _require_built("attention", torch.bfloat16)  # the step's calls are bf16
    _require_built("logp", torch.bfloat16)
    for op, args in _step_calls()[1:]:  # kv_cache_write: the test below
        cuda, triton = _backends(op)
        assert cuda.supports(*args)[0], op
        run_args = _cloned(op, args)
        cuda.fn(*run_args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda.fn(*run_args)
        for t in run_args:  # new values in the same tensors
            for x in t if isinstance(t, list) else [t]:
                if isinstance(x, torch.Tensor) and x.is_floating_point():
                    x.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        ref = _outputs(op, run_args, triton.fn(*run_args))
        for a, b in zip(_outputs(op, run_args, out), ref):
            assert torch.equal(a, b), op
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            side = cuda.fn(*run_args)
        s.synchronize()
        for a, b in zip(_outputs(op, run_args, side), ref):
            assert torch.equal(a, b), op


def test_kv_cache_write_under_graph_capture_writes_the_replayed_values():
    _require_built("kv_cache_write", torch.bfloat16)
    cuda, triton = _backends("kv_cache_write")
    op, args = _step_calls()[0]
    k, v, kc, vc, slots = _cloned(op, args)
    cuda.fn(k, v, kc, vc, slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cuda.fn(k, v, kc, vc, slots)
    k.mul_(0.5)
    v.add_(1.0)
    ref = _cloned(op, (k, v, kc, vc, slots))
    triton.fn(*ref)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(kc, ref[2]) and torch.equal(vc, ref[3])


def test_decode_captured_before_any_offsets_exist_builds_its_own():
    """attention_decode under capture before its cached offsets exist (a graph captured first thing): the call
    builds ``arange(B + 1)`` itself, as rlk.triton does, and the replay is rlk.triton's bits."""
    from rlk_core.ops.attention import cuda as ac

    _require_built("attention", torch.bfloat16)
    args = _decode_call(b=5, seed=9)
    cuda, triton = _backends("attention_decode")
    cuda.fn(*args)  # the decision and the loads
    saved = dict(ac._OFFSETS)
    ac._OFFSETS.clear()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda.fn(*args)
        assert not ac._OFFSETS  # nothing cached under capture
        args[0].mul_(-1.0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, triton.fn(*args))
    finally:
        ac._OFFSETS.update(saved)


def test_negative_control_the_attention_comparison_can_fail():
    """A different scale through rlk.cuda is caught (the comparison above has teeth), and so is rlk.cuda's decode
    against rlk.triton's prefill of another token's position (a wrong row)."""
    _require_built("attention", torch.bfloat16)
    args = _decode_call(b=4, seed=3)
    cuda, triton = _backends("attention_decode")
    ref = triton.fn(*args)
    assert torch.equal(cuda.fn(*args), ref)
    assert not torch.equal(cuda.fn(*args[:5], args[5] * 1.001), ref)
    assert not torch.equal(cuda.fn(args[0].roll(1, 0), *args[1:]), ref)


# -- the backward kernels of the row-wise ops and linear's stored-layout GEMMs ------------------------------------
# The sweeps are tests/core/_cuda_cases.py's (the CPU suite checks that their served calls reach every backward
# variant the AOT enumeration builds, and that rlk.cuda launches what rlk.triton launches on an sm_90 device).
BACKWARD_FAMILIES = {"rms_norm_backward": K.rms_norm_backward_cases, "swiglu_backward": K.swiglu_backward_cases,
                     "rope_backward": K.rope_backward_cases, "linear_backward": K.linear_backward_cases}


def test_backward_ops_prefer_rlk_cuda():
    for op in ("rms_norm_backward", "swiglu_backward", "rope_backward"):
        cuda, _ = _backends(op)
        ok, why = REGISTRY.is_available(cuda, "cuda")
        assert ok, why
        assert REGISTRY.candidates(op, "cuda")[0].id == "rlk.cuda"


@pytest.mark.parametrize("family", sorted(BACKWARD_FAMILIES))
def test_every_served_backward_variant_is_bitwise_triton(family, ran_programs, aot_triton_cache):
    """Every call of the family's sweep: rlk.cuda takes exactly the calls meant to be served — ``torch.equal`` to
    rlk.triton's (twice: the decision, then the kept program or record) — and declines the others, which the
    registry runs on rlk.triton without a fallback; the cubins launched are the manifest's whole set for the family;
    every JIT compile rlk.triton made was the AOT build's (its Triton cache)."""
    _require_built(family)
    ran_programs.clear()
    served = 0
    for op, args, want in BACKWARD_FAMILIES[family]("cuda", _built_dtypes()):
        cuda, triton = _backends(op)
        said = cuda.supports(*args)
        assert said[0] == want, (op, said, K.describe(args))
        if not said[0]:
            sel = REGISTRY.select(op, "cuda", args, strict=True)
            assert sel.backend.id == "rlk.triton" and sel.fallback_reason is None, (op, sel)
            continue
        _CALL[0] = f"{op} {K.describe(args)}"
        for _ in range(2):
            _same(op, args, cuda.fn, triton.fn)
        served += 1
    want = _manifest_cubins(family, {"aligned"})
    assert served and ran_programs == want, (f"never run: {sorted(want - ran_programs)[:5]}; "
                                             f"unexpected: {sorted(ran_programs - want)[:5]}")
    assert all(hit for hit, _ in aot_triton_cache), _missed(aot_triton_cache)


def _train_step_backward_calls() -> list[tuple[str, tuple]]:
    """A layer's backward calls at a Qwen3-0.6B shape (T = 512): the norms' (hidden and q/k head view), SwiGLU's,
    RoPE's and the three GEMMs of the gate/up projection (dx, dW, db)."""
    g = torch.Generator(device="cuda").manual_seed(21)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, device="cuda", generator=g).to(dtype)

    t, hidden, inter, d = 512, 1024, 3072, 128
    qkv = rnd(t, 16 + 2 * 8, d)
    pos = torch.arange(t, device="cuda")
    x, w = rnd(t, hidden), rnd(2 * inter, hidden)
    dy = rnd(t, 2 * inter)
    return [("rms_norm_backward", (rnd(t, hidden), x, rnd(hidden), 1e-6)),
            ("rms_norm_backward", (rnd(t, 16, d), qkv[:, :16], rnd(d), 1e-6)),
            ("swiglu_backward", (rnd(t, inter), dy)),
            ("rope_backward", (rnd(t, 16, d), pos, 1e6, d)),
            ("linear", (dy, w.t(), None)), ("linear", (dy.t(), x.t(), None)),
            ("linear", (dy.t(), dy.new_ones(1).as_strided((1, t), (1, 0)), None))]


def test_backward_under_graph_capture_and_replay():
    """The backward calls captured in a CUDA graph (after one eager call), replayed on new input values:
    ``torch.equal`` to rlk.triton run eagerly on those values."""
    for op, args in _train_step_backward_calls():
        cuda, triton = _backends(op)
        assert cuda.supports(*args)[0], (op, K.describe(args))
        cuda.fn(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = cuda.fn(*args)
        for a in args:
            if isinstance(a, torch.Tensor) and a.is_floating_point() and a.stride(-1) != 0 and 0 not in a.stride():
                a.mul_(0.5)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(_outputs(op, args, out), _outputs(op, args, triton.fn(*args))):
            assert torch.equal(a, b), (op, K.describe(args))


def test_negative_control_the_backward_comparison_can_fail():
    """The comparison has teeth: rlk.cuda's rms_norm backward with another eps, its linear dW on a gradient with two
    tokens swapped (x not: another product) and its RoPE backward on shifted positions differ from rlk.triton's on
    the original call."""
    calls = dict((op, a) for op, a in _train_step_backward_calls()[::-1])  # the first of each op
    cuda, triton = _backends("rms_norm_backward")
    g, x, w, eps = calls["rms_norm_backward"]
    ref = triton.fn(g, x, w, eps)
    assert all(torch.equal(a, b) for a, b in zip(cuda.fn(g, x, w, eps), ref))
    assert not torch.equal(cuda.fn(g, x, w, eps * 4)[0], ref[0])
    dyt, xt = _train_step_backward_calls()[5][1][:2]  # dW = dy^T x: dy.t() and x.t() as the backward gives them
    cuda, triton = _backends("linear")
    ref = triton.fn(dyt, xt, None)
    assert torch.equal(cuda.fn(dyt, xt, None), ref)
    swapped = dyt.t()[[1, 0, *range(2, dyt.shape[1])]].t()
    assert not torch.equal(cuda.fn(swapped, xt, None), ref)
    cuda, triton = _backends("rope_backward")
    g, pos, theta, r = calls["rope_backward"]
    ref = triton.fn(g, pos, theta, r)
    assert torch.equal(cuda.fn(g, pos, theta, r), ref)
    assert not torch.equal(cuda.fn(g, pos + 1, theta, r), ref)
