"""The ahead-of-time build (issue 21, build-time half): the enumerator covers every launch ``rlk.triton``
can make, and the builder turns each variant into an sm_90 cubin plus a manifest, on this CPU machine,
deterministically. These tests check what can be checked without a GPU (the launches:
tests/gpu/test_cuda_backend_gpu.py)."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlk_core.aot import specs as S
from rlk_core.ops.linear import tiles as rule

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

# M: every value up to 160 (every decode tile, tail, last-row box), then the large-M rule and row splits;
# N and K: the shapes of the rule's tests (wide, narrow, L2-resident, lm_head) and a K that is not even
_MS = [*range(1, 161), 200, 256, 500, 1000, 1024, 2048, 3000, 4096, 6000, 8192]
_NS = (1024, 1536, 3072, 4096, 6144, 24576, 37984, 151936)
_KS = (1000, 1024, 4096, 12288)


def _uncovered(dtype: torch.dtype) -> tuple[list[S.Spec], set[tuple[int, ...]]]:
    """The launches of a sweep of shapes (derived through ``tiles.config`` as the launcher does) that find
    no enumerated variant, and the tiles the sweep reached."""
    have = {s.key for s in S.linear_specs(dtype)}
    missing, reached = {}, set()
    outs = (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
    for layout in S.LAYOUTS:
        for m in _MS:
            for n in _NS:
                for k in _KS:
                    for tma in (False, True):
                        for out in outs:
                            for bias in (False, True) if out == dtype else (False,):
                                for s in S.linear_launch_specs(dtype, m, n, k, tma, bias=bias, out=out,
                                                               layout=layout):
                                    reached.add(s.tile)
                                    if s.key not in have:
                                        missing.setdefault(s.key, s)
    return list(missing.values()), reached


@pytest.mark.parametrize("dtype", S.DTYPES, ids=str)
def test_every_launch_of_the_tile_rule_finds_its_variant(dtype):
    """Every tile, box, split part and flag the rule gives over the sweep is among the enumerated variants;
    and the sweep reaches every tile ``shipped_tiles`` names (so the check below can fail for each)."""
    missing, reached = _uncovered(dtype)
    assert not missing, [s.name for s in missing[:10]]
    assert reached == set(rule.shipped_tiles(dtype))
    assert {s.tile for s in S.linear_specs(dtype)} == set(rule.shipped_tiles(dtype))


@pytest.mark.parametrize("drop", rule.shipped_tiles(torch.bfloat16))
def test_coverage_check_fails_when_the_enumerator_misses_a_tile(drop, monkeypatch):
    """Negative control: the rule's ``shipped_tiles`` minus one tile (the enumerator builds from it) must make
    the sweep find launches with no variant — for every tile."""
    real = rule.shipped_tiles
    monkeypatch.setattr(rule, "shipped_tiles", lambda dtype=torch.bfloat16: [t for t in real(dtype) if t != drop])
    missing, _ = _uncovered(torch.bfloat16)
    assert missing and {s.tile for s in missing} == {drop}


def test_a_tile_in_no_kernel_table_is_refused(monkeypatch):
    real = rule.shipped_tiles
    monkeypatch.setattr(rule, "shipped_tiles", lambda dtype=torch.bfloat16: [*real(dtype), (32, 32, 32, 8, 4, 3)])
    with pytest.raises(RuntimeError, match="in no kernel table"):
        S.linear_specs(torch.bfloat16)


def test_row_split_and_last_box_variants_are_enumerated():
    names = [s.name for s in S.linear_specs(torch.bfloat16)]
    assert any("PDL=2" in n and "BLOCK_N=128" in n for n in names)
    assert any("PDL=1" in n and "BLOCK_N=256" in n for n in names)
    assert {dict(s.constexprs)["REM_M"] for s in S.linear_specs(torch.bfloat16) if s.kernel == "_linear_tma_kernel"} \
        == {0, 16, 32}
    split = S.linear_launch_specs(torch.bfloat16, 4096, 1536, 4096, True)  # 8B qkv at TP 4: a row split
    assert [(dict(s.constexprs)["PDL"], s.launch_pdl) for s in split] == [(1, False), (2, True)]


@needs_triton
def test_row_wise_variants_cover_every_size():
    """rms_norm over every H up to MAX_H, swiglu over every I up to 2**17, rope over every head count up to
    1024 for each built (head_dim, rotary_dim): each launch's constexprs and warps are enumerated."""
    from rlk_core.ops.rms_norm import triton as rms
    from rlk_core.ops.rope import triton as rp
    from rlk_core.ops.swiglu import triton as sw

    assert rms.MAX_H == S.RMS_MAX_H
    have = {(s.kernel, s.constexprs, s.num_warps) for s in S.enumerate_specs(("rms_norm", "swiglu", "rope"),
                                                                             (torch.bfloat16,))}
    for h in range(1, rms.MAX_H + 1):
        c = rms.config(h)
        assert ("_rms_norm_fwd_kernel", (("BLOCK_H", c["BLOCK_H"]), ("ROWS", c["ROWS"])), c["num_warps"]) in have, h
    for inter in range(1, 1 << 17):
        c = sw.config(inter)
        assert ("_swiglu_fwd_kernel", (("BLOCK", c["BLOCK"]),), c["num_warps"]) in have, inter
    for d, r in S.ROPE_SHAPES:
        for nh in range(1, 1025):
            c = rp.config(nh, r // 2)
            const = dict(HALF=r // 2, D=d, R=r, BLOCK_H=c["BLOCK_H"], BLOCK_HALF=c["BLOCK_HALF"],
                         BLOCK_PASS=d - r)  # the shapes' pass-through widths are powers of two
            assert ("_rope_fwd_kernel", tuple(sorted(const.items())), c["num_warps"]) in have, (d, r, nh)


def test_importing_aot_imports_no_triton():
    code = "import sys, rlk_core.aot\nprint(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _sample() -> list[S.Spec]:
    """One variant of each kernel and of each special path: the 16-row tail, a last-row box, a row split's
    PDL launch, the pointer kernel both layouts and with an fp32 output, fp32 ieee, rms_norm with an fp32
    weight, swiglu, rope with a pass-through."""
    lin = S.linear_specs(torch.bfloat16)

    def pick(specs, kernel, layout="aligned", **want):
        return next(s for s in specs if s.kernel == kernel and s.layout == layout
                    and all(dict(s.constexprs).get(k) == v for k, v in want.items()))

    return [
        pick(lin, "_linear_tma_kernel", TAIL_M=16, HAS_BIAS=True),
        pick(lin, "_linear_tma_kernel", REM_M=16, BLOCK_N=128),
        pick(lin, "_linear_tma_kernel", PDL=2, BLOCK_N=128),
        pick(lin, "_linear_fwd_kernel", BLOCK_M=16, EVEN_K=True),
        next(s for s in lin if s.kernel == "_linear_fwd_kernel" and s.layout == "generic" and "->fp32" in s.dtype),
        pick(S.linear_specs(torch.float32), "_linear_fwd_kernel", IEEE=True),
        next(s for s in S.rms_norm_specs(torch.bfloat16)
             if "w=fp32" in s.dtype and dict(s.constexprs)["BLOCK_H"] == 4096),
        pick(S.swiglu_specs(torch.float16), "_swiglu_fwd_kernel", BLOCK=2048),
        pick(S.rope_specs(torch.bfloat16), "_rope_fwd_kernel", D=128, R=64),
    ]


@pytest.fixture(scope="module")
def sample_builds(tmp_path_factory):
    from rlk_core.aot.build import build

    a, b = tmp_path_factory.mktemp("aot-a"), tmp_path_factory.mktemp("aot-b")
    return (build("cuda:90", a, _sample(), jobs=1), a), (build("cuda:90", b, _sample(), jobs=1), b)


def _function_symbols(cubin: Path) -> set[str]:
    """Global FUNC symbols of a cubin: ``readelf -s`` where installed, else Triton's ``cuobjdump``."""
    readelf = shutil.which("readelf")
    if readelf:
        out = subprocess.run([readelf, "-sW", str(cubin)], capture_output=True, text=True, check=True).stdout
        return {f[-1] for f in (line.split() for line in out.splitlines()) if "FUNC" in f and "GLOBAL" in f}
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    out = subprocess.run([str(tool), "-elf", str(cubin)], capture_output=True, text=True, check=True).stdout
    return {f[-1] for f in (line.split() for line in out.splitlines()) if "STT_FUNC" in f and "STB_GLOBAL" in f}


@needs_triton
def test_manifest_fields(sample_builds):
    (manifest, out), _ = sample_builds
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["failed"] == [] and len(manifest["kernels"]) == len(_sample())
    assert manifest["target"] == "cuda:90" and manifest["triton_version"] and manifest["sms"] == 132
    assert any("NUM_PROGRAMS" in g["what"] for g in manifest["not_built"])
    for e in manifest["kernels"]:
        assert e["function"] == e["kernel"] and e["cubin"].startswith(e["kernel"] + "-")
        assert len(e["source_hash"]) == 64 and e["grid"] and e["num_warps"] >= 1
        assert 0 < e["shared_bytes"] <= 232448 or e["op"] != "linear"
        names = [a["name"] for a in e["signature"]]
        assert set(e["constexprs"]) <= set(names) and set(e["divisible_by_16"]) <= set(names)
        assert not set(e["do_not_specialize"]) & set(e["divisible_by_16"])
        runtime = [a["name"] for a in e["signature"] if a["type"] != "constexpr"]
        assert [p["name"] for p in e["params"] if "." not in p["name"]] == [*runtime, "global_scratch",
                                                                             "profile_scratch"]
        if e["kernel"] == "_linear_tma_kernel":
            assert [p["type"] for p in e["params"]][:5] == ["CUtensorMap", "i32", "i32", "i64", "i64"]
            assert len(e["tensordesc_meta"]) == sum(a["type"].startswith("tensordesc") for a in e["signature"])
            assert e["launch_pdl"] == (e["constexprs"]["PDL"] == 2)
    rope = next(e for e in manifest["kernels"] if e["op"] == "rope")
    assert rope["options"] == {"enable_fp_fusion": False}
    aligned = next(e for e in manifest["kernels"] if e["kernel"] == "_linear_fwd_kernel" and e["layout"] == "aligned")
    assert aligned["constexprs"]["stride_xk"] == 1 and "M" not in aligned["divisible_by_16"]


@needs_triton
def test_cubins_are_sm90_elf_with_the_named_function(sample_builds):
    (manifest, out), _ = sample_builds
    for e in manifest["kernels"]:
        data = (out / e["cubin"]).read_bytes()
        assert data[:4] == b"\x7fELF" and data[4] == 2  # ELF64
        assert int.from_bytes(data[18:20], "little") == 190  # e_machine EM_CUDA
        assert e["function"] in _function_symbols(out / e["cubin"])


@needs_triton
def test_a_rebuild_is_byte_identical(sample_builds):
    """Each variant compiles from scratch (a private Triton cache), so this is two full compiles."""
    (m1, a), (m2, b) = sample_builds
    assert (a / "manifest.json").read_bytes() == (b / "manifest.json").read_bytes()
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) == len(_sample()) + 1
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@needs_triton
def test_a_failing_variant_is_recorded_and_the_cli_exits_nonzero(tmp_path, monkeypatch, capsys):
    from rlk_core.aot import __main__ as cli

    bad = S.Spec("swiglu", "rlk_core.ops.swiglu.triton", "_swiglu_fwd_kernel", "bf16", "generic",
                 (("BLOCK", 3),), (("x_ptr", "*bf16"), ("y_ptr", "*bf16")), grid="swiglu.rows_x_blocks")
    good = S.swiglu_specs(torch.bfloat16, layouts=("aligned",))[:1]
    monkeypatch.setattr(S, "enumerate_specs", lambda *a, **k: [*good, bad])
    assert cli.main(["build", "--target", "cuda:90", "--out", str(tmp_path), "--jobs", "1"]) == 1
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [e["constexprs"]["BLOCK"] for e in manifest["failed"]] == [3] and manifest["failed"][0]["error"]
    assert len(manifest["kernels"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "[2/2" in err


@needs_triton
def test_a_build_through_a_triton_cache_reports_that_it_serves_each_variant(tmp_path):
    """A build with ``triton_cache`` (two worker processes) records each compile's Triton key and checks the cache
    under the key this process computes (the JIT's): every variant's group file and the files it lists. Negative
    controls: a group file removed, a child file removed, a key recorded wrong — each reported."""
    B = importlib.import_module("rlk_core.aot.build")
    specs = [s for s in S.enumerate_specs(("rms_norm",), (torch.bfloat16,)) if s.layout == "aligned"][:3]
    cache = tmp_path / "triton-cache"
    m = B.build("cuda:90", tmp_path / "out", specs, jobs=2, triton_cache=cache)
    assert m["triton_cache"] == {"variants": 3, "other_key": [], "incomplete": []}
    by_variant = {e["variant"]: e for e in m["kernels"]}
    entries = [by_variant[s.name] for s in specs]
    assert [e["triton_key"] for e in entries] == [B.compile_key(s) for s in specs]
    first, second = (cache / B.cache_folder(B.compile_key(s)) for s in specs[:2])
    (first / f"__grp__{specs[0].kernel}.json").unlink()
    next(p for p in second.iterdir() if p.suffix == ".cubin").unlink()
    entries[2] = {**entries[2], "triton_key": "0" * 64}
    report = B.cache_report(cache, specs, entries)
    assert report["incomplete"] == [specs[0].name, specs[1].name] and report["other_key"] == [specs[2].name]


_KEY_ORDER = """
import importlib, json, sys
import torch
from rlk_core.aot import specs as S
B = importlib.import_module("rlk_core.aot.build")
specs = S.enumerate_specs(S.OPS, (torch.bfloat16,))
order = specs[::-1] if sys.argv[1] == "reversed" else specs
print(json.dumps({repr(s.key): B.compile_key(s) for s in order}))  # (names repeat across unit strides)
"""


@needs_triton
def test_compile_keys_do_not_depend_on_which_kernel_a_process_hashes_first():
    """Triton's compile key of every variant is the same whichever kernels a process hashed before (enumeration
    order, or reversed: the backward attention kernels before the forward ones) — as a build worker, the main
    process and a run's JIT each hash them in their own order. Triton 3.6 folds a callee's global constexprs into a
    caller's key only when the callee was hashed first; a global constexpr in a shared helper (find_tile's scan
    width once) made the attention backward's keys depend on it, and the build's workers compiled some of them
    under the key no JIT computes (the GPU suite's cache misses)."""
    runs = {}
    for order in ("forward", "reversed"):
        proc = subprocess.run([sys.executable, "-c", _KEY_ORDER, order], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[order] = json.loads(proc.stdout)
    differ = [name for name, key in runs["forward"].items() if runs["reversed"][name] != key]
    assert not differ, (len(differ), differ[:3])


@needs_triton
def test_no_kernel_depends_on_a_global_constexpr():
    """After every rlk kernel is hashed, no @jit function has recorded a global constexpr (the order-dependent part
    of Triton's key, above): the constants a kernel needs are its constexpr arguments or locals."""
    from triton.language.core import constexpr
    from triton.runtime.jit import JITFunction

    modules = sorted({s.module for s in S.enumerate_specs(S.OPS, (torch.bfloat16,))})
    fns = []
    for name in modules:
        mod = importlib.import_module(name)
        fns += [v for v in vars(mod).values() if isinstance(v, JITFunction)]
    for fn in fns:
        assert fn.cache_key
    found = sorted({(fn.__name__, var) for fn in fns for (var, _), (val, _) in fn.used_global_vals.items()
                    if isinstance(val, constexpr)})
    assert not found, found


def test_unknown_target_is_refused():
    from rlk_core.aot.build import parse_target

    with pytest.raises(ValueError, match="cuda:90"):
        parse_target("cuda:75")


@needs_triton
@pytest.mark.slow
def test_the_full_build_succeeds(tmp_path):
    """Every enumerated variant of linear, rms_norm, swiglu and rope and of their backward kernels, through the CLI
    (two worker processes): no failure. The attention and log-prob families (~1000 variants, heavier kernels: about
    an hour on two cores) are built whole by ``setup.py`` on a CUDA build host, where a failed variant fails the
    build; here :func:`test_a_sample_of_the_attention_and_logp_variants_builds_for_sm90` compiles their extremes."""
    ops = ("linear", "rms_norm", "swiglu", "rope", *BACKWARD)
    proc = subprocess.run([sys.executable, "-m", "rlk_core.aot", "build", "--target", "cuda:90", "--out",
                           str(tmp_path), "--jobs", "2", "--ops", ",".join(ops)], capture_output=True, text=True,
                          timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["kernels"]) == len(S.enumerate_specs(ops)) and not manifest["failed"]


# -- attention and log-prob kernels -------------------------------------------------------------------------
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cuda_cases as K  # noqa: E402
import _cuda_fakes as F  # noqa: E402

FAMILIES = ("attention", "kv_cache_write", "attention_backward", "logp")


def test_int_class_is_the_jits_specialisation():
    """``specs.int_class`` (the AOT build's and rlk.cuda's reading of an integer argument) is what Triton's own
    ``native_specialize_impl`` does with it: the constant 1, divisible by 16, or neither."""
    pytest.importorskip("triton")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    for v in (*range(-40, 300), 4095, 4096, 65536 + 16, 2**31 - 16, 2**31 - 1):
        ty, key = native_specialize_impl(BaseBackend, v, False, True, True)
        jit = "1" if ty == "constexpr" else "16" if key == "D" else ""
        assert S.int_class(v) == jit, v


def _jit_keys_of_served(monkeypatch) -> tuple[list[tuple], list[tuple]]:
    """Triton's compile key of what the JIT compiles for every launch rlk.triton makes for the sweep's served calls
    (captured, not run), and for the declined calls' launches, with the call each came from."""
    from rlk_core.ops.linear_logprobs import triton as llt

    monkeypatch.setattr(llt, "CHUNK_BYTES", K.linear_chunk_bytes())
    K.triton_as_on_sm90(monkeypatch)  # linear_logprobs_backward's GEMMs as on an sm_90 device
    return _jit_keys([*K.all_cases("cpu"), *K.linear_logprob_cases("cpu"), *K.linear_logprobs_backward_cases("cpu")],
                     K.as_on_sm90)


def _jit_keys(cases, on_device=lambda launches: launches) -> tuple[list[tuple], list[tuple]]:
    """``(served, declined)``: ``(compile key, op, call, the call's dtype)`` of each launch rlk.triton makes (captured,
    not run; ``on_device`` adjusts them to the GPU's) for the cases ``rlk.cuda`` must serve, and for those it must
    decline."""
    from rlk_core.backends import REGISTRY

    served, declined = [], []
    for op, args, want in cases:
        triton = REGISTRY.get(op, "rlk.triton")
        if not triton.supports(*args)[0]:
            assert not want, op
            continue
        with F.TritonLaunches() as cap:
            triton.fn(*args)
        for kernel, _, a, kw in on_device(cap.launches):
            (served if want else declined).append((F.jit_compile_key(kernel, a, kw), op, K.describe(args),
                                                   _call_dtype(args)))
    return served, declined


def _call_dtype(args) -> torch.dtype:
    """The dtype a build selection (``RLK_BUILD_DTYPES``) serves a call by: its first floating-point tensor's."""
    for a in args:
        for t in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return t.dtype
    raise AssertionError("a call without a floating-point tensor")


@pytest.fixture(scope="module")
def family_launches():
    pytest.importorskip("triton")
    mp = pytest.MonkeyPatch()
    try:
        yield _jit_keys_of_served(mp)
    finally:
        mp.undo()


def _built(ops=FAMILIES, dtypes=S.DTYPES) -> dict[str, S.Spec]:
    """The enumerated variants by Triton's compile key (``aot.build.compile_key``)."""
    build = importlib.import_module("rlk_core.aot.build")
    return {build.compile_key(s): s for s in S.enumerate_specs(ops, dtypes)}


@needs_triton
@pytest.mark.parametrize("dtype", S.DTYPES, ids=str)
def test_a_build_of_one_dtype_has_every_variant_its_calls_launch(family_launches, backward_launches, dtype):
    """``RLK_BUILD_DTYPES=<one dtype>`` (what a GPU sitting builds): every launch of a served call of that dtype —
    the fp32 log-prob merges of bf16 logits, the fp32 outputs of bf16 GEMMs — is in that build. (A bf16 build once
    lacked the merges, and rlk.cuda declined every bf16 token_logprobs call.)"""
    missing = []
    built = _built((*FAMILIES, *BACKWARD), (dtype,))
    for launches in (family_launches, backward_launches):
        missing += [(op, call) for key, op, call, dt in launches[0] if dt == dtype and key not in built]
    assert not missing, missing[:5]


@needs_triton
def test_every_launch_of_the_attention_and_logp_rules_finds_its_variant(family_launches):
    """Every launch rlk.triton makes for the served calls of the sweep (tests/core/_cuda_cases.py: every dtype,
    built head size, GQA group, form, page-size and head-count class, masking mode, vocabulary split, chunk
    class) is a variant the enumeration builds — by Triton's own compile key: the JIT's compile of the launch is
    the AOT build's compile of the variant (so a Triton cache the build writes serves rlk.triton unchanged) — and
    the sweep reaches every variant of these families, so that dropping any one makes this check fail."""
    served, declined = family_launches
    built = _built()
    # (linear_logprobs_backward's dW products are the linear backward's dW variants)
    also = _built(("linear_backward",))
    missing = [(op, call) for key, op, call, _ in served if key not in built and key not in also]
    assert not missing, missing[:5]
    unreached = {s.name for key, s in built.items() if key not in {k for k, *_ in served}}
    assert not unreached, sorted(unreached)[:10]
    # the declined calls (head sizes, groups, layouts not built) each have a launch no variant is
    assert declined and all(any(k not in built for k, o, c, _ in declined if c == call) for _, _, call, _ in declined)


@needs_triton
def test_the_coverage_check_fails_when_the_enumerator_misses_a_case(family_launches, monkeypatch):
    """Negative control: the enumeration with one head size fewer, one GQA group fewer or no kv_cache_write head
    count past 64 leaves served launches without a variant."""
    from rlk_core.aot import specs_attention as A

    served, _ = family_launches
    for name, value in (("HEAD_DIMS", (64, 256)), ("BACKWARD_GROUPS", (1, 2, 4, 5, 6, 8)), ("KV_HEADS_MAX", 64)):
        with monkeypatch.context() as m:
            m.setattr(A, name, value)
            built = _built()
            assert any(key not in built for key, *_ in served), name


def test_variant_keys_are_unique():
    """No two enumerated variants share the key rlk.cuda looks them up by (kernel, dtype, layout, constexprs,
    unmarked integers): a lookup can only find the one the launch's specialisation names."""
    pytest.importorskip("triton")
    from rlk_core.ops import _cuda_common as cc

    seen: dict[tuple, str] = {}
    for s in S.enumerate_specs():
        key = cc.variant_key(s.kernel, s.dtype, s.layout, {**dict(s.constexprs), **{o: 1 for o in s.ones}}, s.plain)
        assert key not in seen, (s.name, seen.get(key))
        seen[key] = s.name


def _family_sample() -> list[S.Spec]:
    """One variant of each new kernel at its extremes: the largest head size and GQA tile, the TMA varlen
    prefill, decode's tile, kv_cache_write with unmarked head count and a unit page size, every backward kernel at
    the largest group with int64 positions, the leaf-block partials with an unmarked first slot, the widest group
    merge, the final merge, the gradient."""
    from rlk_core.aot import specs_attention as A
    from rlk_core.aot import specs_logp as P

    def pick(specs, kernel, **want):
        return next(s for s in specs if s.kernel == kernel
                    and all((dict(s.constexprs).get(k) if k not in ("plain", "ones", "dtype") else getattr(s, k)) == v
                            for k, v in want.items()))

    fwd, bwd = A.forward_specs(torch.bfloat16), A.backward_specs(torch.float16)
    return [
        pick(fwd, A.FORWARD, HEAD_D=256, G_PAD=64),
        pick(fwd, A.FORWARD, HEAD_D=128, KV_TMA=True, G_PAD=8),
        pick(A.forward_specs(torch.float32), A.FORWARD, HEAD_D=128, PAGED=True, G_PAD=4),
        pick(A.kv_write_specs(torch.float16), A.KV_WRITE, HEAD_D=64, H_PAD=8, plain=("H",)),
        pick(bwd, "_attn_bwd_stats_kernel", G=8, MODE=2, BLOCK_D=128, dtype="fp16,pos=i64"),
        pick(bwd, "_attn_bwd_dq_kernel", G=8, MODE=2, BLOCK_D=128, dtype="fp16,pos=i64"),
        pick(bwd, "_attn_bwd_dkdv_kernel", G=8, MODE=2, BLOCK_D=128, dtype="fp16,pos=i64"),
        pick(bwd, "_attn_bwd_group_sum_kernel", G=8, BLOCK_D=128),
        pick(A.backward_specs(torch.float32), "_attn_bwd_dkdv_kernel", G=4, MODE=0, BLOCK_D=64),
        pick(P.logp_specs(torch.bfloat16), "_logp_block_fwd_kernel", plain=("slot0",)),
        pick(P.logp_specs(torch.float32), "_merge_blocks_kernel", P=4096, ones=("stride_gt",)),
        pick(P.logp_specs(torch.float32), "_merge_groups_kernel"),
        pick(P.logp_specs(torch.float16), "_logp_grad_kernel"),
    ]


@pytest.fixture(scope="module")
def family_build(tmp_path_factory):
    pytest.importorskip("triton")
    from rlk_core.aot.build import build

    out = tmp_path_factory.mktemp("aot-families")
    return build("cuda:90", out, _family_sample(), jobs=2), out


@needs_triton
def test_a_sample_of_the_attention_and_logp_variants_builds_for_sm90(family_build):
    """The sample compiles to sm_90 cubins on this CPU machine: ELF64 EM_CUDA with the named function, shared
    memory within sm_90's limit, the parameter list as rlk.cuda's launcher passes it (descriptors expanded for the
    TMA variants), the layout's unit and unmarked integers where the manifest says."""
    manifest, out = family_build
    assert manifest["failed"] == [] and len(manifest["kernels"]) == len(_family_sample())
    assert any("GQA groups" in g["what"] for g in manifest["not_built"])
    from rlk_core.ops import _cuda_common as cc

    for e in manifest["kernels"]:
        data = (out / e["cubin"]).read_bytes()
        assert data[:4] == b"\x7fELF" and data[4] == 2 and int.from_bytes(data[18:20], "little") == 190
        assert e["function"] in _function_symbols(out / e["cubin"])
        assert e["shared_bytes"] <= 232448, (e["variant"], e["shared_bytes"])
        codes, descs = cc.param_codes(e)  # the launcher's codes match the cubin's parameter list
        assert codes.count("D") == len(descs) == sum(a["type"].startswith("tensordesc") for a in e["signature"])
        assert not set(e["plain"]) & set(e["divisible_by_16"])
        assert all(e["constexprs"][o] == 1 for o in e["constexprs"] if o.startswith("stride") and o.endswith("d"))
    # the K/V boxes [BLOCK_N, D_PAD] = [64, 128] 16-bit: the encoded box is one 128-byte swizzle span wide (the
    # kernel issues two loads per box), as Triton's launcher would encode it from the same metadata
    tma = [e for e in manifest["kernels"] if e["constexprs"].get("KV_TMA")]
    assert len(tma) == 3 and all(len(e["tensordesc_meta"]) == 2 for e in tma)
    assert all(m["block_size"] == [64, 64] and m["swizzle"] == 3 for e in tma for m in e["tensordesc_meta"])


# -- the backward kernels of the row-wise ops and linear's stored-layout GEMMs --------------------------------------
BACKWARD = ("rms_norm_backward", "swiglu_backward", "rope_backward", "linear_backward")


def _backward_jit_keys(monkeypatch) -> tuple[list[tuple], list[tuple]]:
    """Triton's compile key of every launch rlk.triton makes for the served calls of ``K.backward_cases`` (captured,
    not run; as on an sm_90 device of 132 SMs: ``K.as_on_sm90``), and for the declined calls', with the call."""
    K.triton_as_on_sm90(monkeypatch)
    return _jit_keys(K.backward_cases("cpu"), K.as_on_sm90)


@pytest.fixture(scope="module")
def backward_launches():
    pytest.importorskip("triton")
    mp = pytest.MonkeyPatch()
    try:
        yield _backward_jit_keys(mp)
    finally:
        mp.undo()


@needs_triton
def test_every_backward_launch_finds_its_variant(backward_launches):
    """Every launch rlk.triton makes for the served backward calls (rms_norm / swiglu / rope backward at every config
    and class, linear's dx / dW / db through the stored-layout kernels at every tile) is a variant the enumeration
    builds, by Triton's own compile key; every built variant is reached by the sweep (dropping one makes the check
    fail); each declined call has a launch no variant is."""
    served, declined = backward_launches
    built = _built(BACKWARD)
    missing = [(op, call) for key, op, call, _ in served if key not in built]
    assert not missing, missing[:5]
    unreached = {s.name for key, s in built.items() if key not in {k for k, *_ in served}}
    assert not unreached, sorted(unreached)[:10]
    assert declined and all(any(k not in built for k, o, c, _ in declined if c == call) for _, _, call, _ in declined)
    assert {op for _, op, *_ in served} == {"rms_norm_backward", "swiglu_backward", "rope_backward", "linear"}


def _drop_rms_h(m):
    from rlk_core.aot import specs_backward as BW

    m.setattr(BW, "RMS_MAX_H", S.RMS_MAX_H // 2)  # no BLOCK_H = 65536


def _drop_swiglu_block(m):
    from rlk_core.ops.swiglu import triton as sw

    real = sw.config
    m.setattr(sw, "config", lambda inter: {**real(inter), "BLOCK": min(1024, real(inter)["BLOCK"])})


def _drop_rope_plain(m):
    from rlk_core.aot import specs_backward as BW

    real = BW._classes
    m.setattr(BW, "_classes", lambda values: (real(values)[0], ()))  # no head count that is unmarked


def _drop_stored_tile(m):
    m.setattr(rule, "_STORED_TMA", tuple(e for e in rule._STORED_TMA if e[0][1] != 128))


def _drop_db_unit_n(m):
    from rlk_core.aot import specs_backward as BW

    calls = {**BW.STORED_CALLS, "db": {**BW.STORED_CALLS["db"], "ones": BW.STORED_CALLS["dx"]["ones"]}}
    m.setattr(BW, "STORED_CALLS", calls)


@needs_triton
@pytest.mark.parametrize("drop", [_drop_rms_h, _drop_swiglu_block, _drop_rope_plain, _drop_stored_tile,
                                  _drop_db_unit_n], ids=lambda f: f.__name__[6:])
def test_the_backward_coverage_check_fails_when_the_enumerator_misses_a_case(backward_launches, monkeypatch, drop):
    """Negative control: the enumeration without rms_norm's largest row config, swiglu's widest block, rope's
    unmarked head counts, the stored rule's 128x128 tile or db's unit column count leaves served launches without a
    variant (the launches were captured from the unchanged rules)."""
    served, _ = backward_launches
    drop(monkeypatch)
    built = _built(BACKWARD)
    assert any(key not in built for key, *_ in served)


def test_rope_backward_enumerates_every_head_count():
    """The enumerator's representative head counts give every (config, class) pair of 1..65536 heads."""
    pytest.importorskip("triton")
    from rlk_core.aot import specs_backward as BW
    from rlk_core.ops.rope import triton as rp

    for d, r in S.ROPE_SHAPES:
        want = {(tuple(sorted(rp.config(nh, r // 2).items())), S.int_class(nh)) for nh in range(1, (1 << 16) + 1)}
        have = set()
        for s in BW.rope_backward_specs(torch.bfloat16, shapes=((d, r),)):
            c = dict(s.constexprs)
            cls = "1" if "NH" in s.ones else "" if "NH" in s.plain else "16"
            have.add((tuple(sorted({"BLOCK_H": c["BLOCK_H"], "BLOCK_HALF": c["BLOCK_HALF"],
                                    "num_warps": s.num_warps}.items())), cls))
        assert have == want, (d, r)


def _backward_sample() -> list[S.Spec]:
    """One variant of each backward kernel at its extremes: rms_norm's widest row with an fp32 weight and its merge,
    swiglu's widest block, rope with a pass-through and a unit head count, the stored TMA kernel for dW (both operands
    transposed, the 128x256 tile) and for dx, the pointer kernel for db and fp32's dW."""
    from rlk_core.aot import specs_backward as BW

    def pick(specs, kernel, **want):
        return next(s for s in specs if s.kernel == kernel
                    and all((dict(s.constexprs).get(k) if k not in ("ones", "dtype") else getattr(s, k)) == v
                            for k, v in want.items()))

    rms, lin = BW.rms_norm_backward_specs(torch.bfloat16), BW.linear_backward_specs(torch.bfloat16)
    return [
        pick(rms, "_rms_norm_bwd_kernel", BLOCK_H=65536, dtype="bf16,w=fp32"),
        pick(rms, "_rms_norm_bwd_dw_kernel", dtype="dw=bf16"),
        pick(BW.swiglu_backward_specs(torch.float16), "_swiglu_bwd_kernel", BLOCK=2048),
        pick(BW.rope_backward_specs(torch.bfloat16), "_rope_bwd_kernel", D=128, R=64, ones=("NH",)),
        pick(lin, "_linear_bwd_tma_kernel", A_KM=True, BLOCK_N=256),
        pick(BW.linear_backward_specs(torch.float16), "_linear_bwd_tma_kernel", A_KM=False, BLOCK_N=64),
        pick(lin, "_linear_bwd_kernel", ones=("N", "stride_am", "stride_bn", "stride_ym", "stride_yn")),
        pick(BW.linear_backward_specs(torch.float32), "_linear_bwd_kernel", BLOCK_N=64,
             ones=("stride_am", "stride_bn", "stride_yn")),
    ]


@pytest.fixture(scope="module")
def backward_build(tmp_path_factory):
    pytest.importorskip("triton")
    from rlk_core.aot.build import build

    out = tmp_path_factory.mktemp("aot-backward")
    return build("cuda:90", out, _backward_sample(), jobs=2), out


@needs_triton
def test_a_sample_of_the_backward_variants_builds_for_sm90(backward_build):
    """The sample compiles to sm_90 cubins on this CPU machine: ELF64 EM_CUDA with the named function, shared memory
    within sm_90's limit, the parameter list as rlk.cuda's launcher passes it (the TMA variants' three descriptors
    expanded), the unit integers constants, the do-not-specialise sizes unmarked."""
    from rlk_core.ops import _cuda_common as cc

    manifest, out = backward_build
    assert manifest["failed"] == [] and len(manifest["kernels"]) == len(_backward_sample())
    assert any("_linear_bwd_tma_kernel" in g["kernel"] for g in manifest["not_built"])
    for e in manifest["kernels"]:
        data = (out / e["cubin"]).read_bytes()
        assert data[:4] == b"\x7fELF" and data[4] == 2 and int.from_bytes(data[18:20], "little") == 190
        assert e["function"] in _function_symbols(out / e["cubin"])
        assert e["shared_bytes"] <= 232448, (e["variant"], e["shared_bytes"])
        codes, descs = cc.param_codes(e)
        assert codes.count("D") == len(descs) == sum(a["type"].startswith("tensordesc") for a in e["signature"])
        assert not {"M", "K", "P", "T", "N_POS", "RPP"} & set(e["divisible_by_16"])
        if e["kernel"] == "_linear_bwd_tma_kernel":
            assert codes == "DDDpiiii" and e["constexprs"]["stride_yn"] == 1 and e["constexprs"]["NUM_PROGRAMS"] == 132
        if e["kernel"] == "_linear_bwd_kernel" and "N" in e["constexprs"]:
            assert codes == "pppiiii"  # db: N and four strides constant; M, K, stride_ak, stride_bk passed


# -- hip:gfx942: AMD code objects of the row-wise families (built on the CPU; no launcher yet, docs/rocm.md) ---------
def test_a_gfx942_build_writes_code_objects_whose_metadata_reads_back(tmp_path):
    """Triton's AMD backend, as installed, compiles rms_norm / swiglu / rope for gfx942 on this machine: each code
    object is an AMDGPU ELF with the kernel's symbol, its descriptor and the gfx942 target, and the manifest says so
    (warp size 64, the function name, shared memory); a corrupted one is refused; families whose rules use TMA / PDL
    are refused for the target."""
    pytest.importorskip("triton")
    import hashlib

    B = importlib.import_module("rlk_core.aot.build")
    specs = [next(s for s in S.enumerate_specs((op,), (torch.bfloat16,)) if s.layout == "aligned")
             for op in ("rms_norm", "swiglu", "rope")]
    m = B.build("hip:gfx942", tmp_path, specs, jobs=1)
    assert m["target"] == "hip:gfx942" and not m["failed"] and len(m["kernels"]) == 3
    for e in m["kernels"]:
        blob = (tmp_path / e["cubin"]).read_bytes()
        assert e["cubin"].endswith(".hsaco") and e["arch"] == "gfx942" and e["warp_size"] == 64
        assert e["function"] == e["kernel"] and e["shared_bytes"] >= 0
        assert B.check_code_object(blob, e["function"], "gfx942") is None
        assert hashlib.sha256(blob).hexdigest() == e["cubin_sha256"]
        assert B.check_code_object(blob, e["function"], "gfx90a") is not None  # another target's name
        assert B.check_code_object(blob.replace(e["function"].encode(), b"x" * len(e["function"])), e["function"],
                                   "gfx942") is not None
    with pytest.raises(ValueError, match="only"):
        B.build("hip:gfx942", tmp_path / "linear", S.enumerate_specs(("linear",), (torch.bfloat16,))[:1], jobs=1)


# -- cuda:100: sm_100 cubins (built and checked on the CPU; not served until a B200 runs the GPU suite) --------------
def test_an_sm100_build_writes_cubins_for_sm100_that_rlk_cuda_does_not_serve_yet(tmp_path):
    """Triton's bundled ptxas compiles the row-wise, GEMM (persistent TMA, 148 SMs as on a B200) and log-prob
    variants for sm_100 on this machine: each cubin is a CUDA ELF for sm_100 with its kernel's symbol, the check
    refuses it as sm_90 (and an sm_90 build's cubin as sm_100), and rlk.cuda maps no device to the target."""
    pytest.importorskip("triton")
    from rlk_core.ops import _cuda_common as cc

    B = importlib.import_module("rlk_core.aot.build")
    specs = [next(s for s in S.enumerate_specs(("rms_norm",), (torch.bfloat16,)) if s.layout == "aligned"),
             next(s for s in S.enumerate_specs(("linear",), (torch.bfloat16,), sms=148)
                  if s.kernel == "_linear_tma_kernel"),
             next(s for s in S.enumerate_specs(("logp",), (torch.bfloat16,)) if s.kernel == "_merge_groups_kernel")]
    m = B.build("cuda:100", tmp_path / "sm100", specs, sms=148, jobs=1)
    assert m["target"] == "cuda:100" and not m["failed"] and len(m["kernels"]) == 3 and "not launched" in m["note"]
    for e in m["kernels"]:
        blob = (tmp_path / "sm100" / e["cubin"]).read_bytes()
        assert B.cubin_sm(blob) == 100 and B.check_cubin(blob, e["function"], 100) is None
        assert B.check_cubin(blob, e["function"], 90) is not None
        assert B.check_cubin(blob, "_no_such_kernel", 100) is not None
    m90 = B.build("cuda:90", tmp_path / "sm90", specs[:1], jobs=1)
    blob90 = (tmp_path / "sm90" / m90["kernels"][0]["cubin"]).read_bytes()
    assert B.cubin_sm(blob90) == 90 and B.check_cubin(blob90, m90["kernels"][0]["function"], 100) is not None
    assert B.cubin_sm(b"\x7fELF" + bytes(60)) is None  # not a CUDA ELF
    assert "cuda:100" not in cc.TARGETS.values() and B.SERVED == ("cuda:90",)
