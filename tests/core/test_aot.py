"""The ahead-of-time build (issue 21, build-time half): the enumerator covers every launch ``rlk.triton``
can make, and the builder turns each variant into an sm_90 cubin plus a manifest, on this CPU machine,
deterministically. These tests check what can be checked without a GPU (the launches:
tests/gpu/test_cuda_backend_gpu.py)."""

from __future__ import annotations

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


def test_unknown_target_is_refused():
    from rlk_core.aot.build import parse_target

    with pytest.raises(ValueError, match="cuda:90"):
        parse_target("cuda:75")


@needs_triton
@pytest.mark.slow
def test_the_full_build_succeeds(tmp_path):
    """Every enumerated variant, through the CLI (two worker processes): no failure."""
    proc = subprocess.run([sys.executable, "-m", "rlk_core.aot", "build", "--target", "cuda:90", "--out",
                           str(tmp_path), "--jobs", "2"], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["kernels"]) == len(S.enumerate_specs()) and not manifest["failed"]
