"""The ahead-of-time build (``rlk_core.aot.build``): the launches of every op's build calls, specialised by Triton's
own binder, cover what ``rlk.triton`` launches (the GEMM's tile rule over a sweep of shapes here; the other ops'
sweeps in ``test_cuda_backend.py``), and each variant becomes an sm_90 cubin plus a manifest entry, on this CPU
machine, deterministically; the compile keys are the JIT's (the GPU suite checks every JIT compile is a hit in the
build's Triton cache)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlk_core.aot import build as B
from rlk_core.ops import _plan
from rlk_core.ops.linear import tiles as rule

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def test_importing_aot_and_the_ops_imports_no_triton():
    code = ("import sys, rlk_core.aot, rlk_core.ops\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'triton'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


# -- the GEMM's tile rule: every launch over a sweep of shapes finds its variant ----------------------------------
# M: every value up to 160 (every decode tile, tail, last-row box), then the large-M rule and row splits; N and K:
# the rule's model shapes (wide, narrow, L2-resident, lm_head), all multiples of 16 (the aligned variants built)
_MS = [*range(1, 161), 200, 256, 500, 1000, 1024, 2048, 3000, 4096, 6000, 8192]
_NS = (1024, 1536, 3072, 4096, 6144, 24576, 37984, 151936)
_KS = (1024, 4096, 12288)


def _sweep_keys(dtype: torch.dtype) -> tuple[dict[str, str], set[tuple]]:
    """The variant keys of the GEMM's launches over the sweep (meta tensors on an sm_90 of 132 SMs, the plan deciding
    each launch as on the GPU) and the tiles they reached."""
    from rlk_core.ops.linear import triton as lt

    seen: dict[str, dict] = {}
    plan = B.Enumerate(_plan.Target("cuda", 90, 32), "linear", 132, seen)
    tiles = set()
    real_launch = plan.launch

    def launch(kernel, grid, *args, **kw):
        tiles.add((kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw.get("TAIL_M", 0)))
        real_launch(kernel, grid, *args, **kw)

    plan.launch = launch
    outs = (dtype,) if dtype == torch.float32 else (dtype, torch.float32)
    for m in _MS:
        for n in _NS:
            for k in _KS:
                for out in outs:
                    for bias in (None, torch.empty((n,), dtype=dtype, device="meta")) if out == dtype else (None,):
                        x = torch.empty((m, k), dtype=dtype, device="meta")
                        w = torch.empty((n, k), dtype=dtype, device="meta")
                        lt.into(plan, x, w, bias, torch.empty((m, n), dtype=out, device="meta"))
    return {key: v["spec"] for key, v in seen.items()}, tiles


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_launch_of_the_tile_rule_finds_its_variant(dtype):
    """...and the sweep reaches every tile ``shipped_tiles`` names (so the check can fail for each: below)."""
    built = {v["key"] for v in B.enumerate_variants(["linear"], [dtype])}
    keys, tiles = _sweep_keys(DTYPES[dtype])
    missing = set(keys) - built
    assert not missing, [keys[k] for k in sorted(missing)][:5]
    assert {(t[0], t[1], t[2], t[6] if len(t) > 6 else 0) for t in rule.shipped_tiles(DTYPES[dtype])} <= tiles


def test_the_coverage_check_fails_when_the_build_misses_a_tile(monkeypatch):
    """Negative control: the build calls without one of the rule's 128-row tiles leave launches of the sweep
    without their variant."""
    from rlk_core.ops.linear import triton as lt

    real = lt.build_calls
    drop = rule._LARGE_TMA[1][0]

    def without(dtype, sms):
        for fn, args in real(dtype, sms):
            cfg = args[4]
            if (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]) != drop[:3] or not cfg["TMA"]:
                yield fn, args

    monkeypatch.setattr(lt, "build_calls", without)
    built = {v["key"] for v in B.enumerate_variants(["linear"], ["bf16"])}
    keys, _ = _sweep_keys(torch.bfloat16)
    assert set(keys) - built


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_every_launch_of_the_linear_tp_rule_finds_its_variant(dtype):
    """linear_tp_partials (rlk.gemm.tp.v1) over Qwen3's row-parallel shapes at TP 1/2/4/8 (G = 8) and M across the
    rule's variant switch, and linear_tp (TP 1: the store finished, without and with a bias): every launch of every
    variant the rule picks (the split's merge, the stash's persistent kernel) is built, so rlk.cuda serves the rule's
    plan; the sweep reaches every variant."""
    from rlk_core.ops.linear_tp import triton as tt

    built = {v["key"] for v in B.enumerate_variants(["linear_tp"], [dtype])}
    seen: dict[str, dict] = {}
    plan = B.Enumerate(_plan.Target("cuda", 90, 32), "linear_tp", 132, seen)
    variants = set()
    for m in (1, 7, 16, 17, 100, tt.SPLIT_MAX_M, tt.SPLIT_MAX_M + 1, 1000, 8192):
        for n, k in ((1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288)):
            for tp in (1, 2, 4, 8):
                x = torch.empty((m, k // tp), dtype=DTYPES[dtype], device="meta")
                w = torch.empty((n, k // tp), dtype=DTYPES[dtype], device="meta")
                tt.forward(plan, x, w, 8 // tp)
                variants.add(tt.variant(DTYPES[dtype], m, n, k // 8))
    partials = len(seen)
    for m in (1, 7, 16, 17, 100, tt.SPLIT_MAX_M, tt.SPLIT_MAX_M + 1, 1000, 8192):
        for n, k in ((1024, 2048), (1024, 3072), (4096, 4096), (4096, 12288)):  # TP 1: linear_tp
            x = torch.empty((m, k), dtype=DTYPES[dtype], device="meta")
            w = torch.empty((n, k), dtype=DTYPES[dtype], device="meta")
            for b in (None, torch.empty((n,), dtype=DTYPES[dtype], device="meta")):
                tt.forward_finished(plan, x, w, b, 8)
    missing = set(seen) - built
    assert not missing, [seen[key]["spec"] for key in sorted(missing)][:5]
    assert variants == ({"fused"} if dtype == "fp32" else {"split", "stash"})
    assert len(seen) > partials, "the finished stores are launches of their own"


def test_the_enumeration_is_deterministic_and_its_keys_name_their_kernels():
    a = B.enumerate_variants(B.FAMILIES, ["bf16"])
    b = B.enumerate_variants(B.FAMILIES, ["bf16"])
    assert [v["key"] for v in a] == [v["key"] for v in b] and len({v["key"] for v in a}) == len(a)
    for v in a:
        assert v["key"].startswith(f"('{v['module']}:{v['kernel']}'")
        assert v["family"] in B.FAMILIES and v["generic"] == (v["kernel"] in B.GENERIC_BITWISE and v["generic"])


# -- compiling ----------------------------------------------------------------------------------------------------
def _pick(variants, kernel, *needles):
    return next(v for v in variants if v["kernel"] == kernel and all(n in v["spec"] for n in needles))


def _sample() -> list[dict]:
    """One variant of each kernel family and special path: the GEMM's 16-row tail, a last-row box, a row split's PDL
    launch, the pointer kernel with an fp32 output, rms_norm with an fp32 weight, swiglu's no-alignment twin, rope
    with a pass-through."""
    lin = B.enumerate_variants(["linear"], ["bf16"])
    rows = B.enumerate_variants(["rms_norm", "swiglu", "rope"], ["bf16"])
    return [
        next(v for v in lin if v["kernel"] == "_linear_tma_kernel" and v["constexprs"].get((16,)) == 16),  # TAIL_M
        next(v for v in lin if v["kernel"] == "_linear_tma_kernel" and v["options"]["launch_pdl"]),
        _pick(lin, "_linear_fwd_kernel", "*fp32"),
        next(v for v in rows if v["kernel"] == "_rms_norm_fwd_kernel" and "*fp32" in v["spec"]),
        next(v for v in rows if v["kernel"] == "_swiglu_fwd_kernel" and v["generic"]),
        next(v for v in rows if v["kernel"] == "_rope_fwd_kernel" and v["constexprs"].get((17,)) == 64),  # PASS
    ]


@pytest.fixture(scope="module")
def sample_builds(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("aot-a"), tmp_path_factory.mktemp("aot-b")
    return (B.build("cuda:90", a, variants=_sample(), jobs=1), a), (B.build("cuda:90", b, variants=_sample(), jobs=1),
                                                                     b)


def test_manifest_fields(sample_builds):
    (manifest, out), _ = sample_builds
    assert json.loads((out / "manifest.json").read_text()) == manifest
    assert manifest["failed"] == [] and len(manifest["kernels"]) == len(_sample())
    assert manifest["target"] == "cuda:90" and manifest["triton_version"] and manifest["sms"] == 132
    for e in manifest["kernels"]:
        assert e["function"] == e["kernel"] and e["cubin"].startswith(e["kernel"] + "-")
        assert len(e["source_hash"]) == 64 and e["num_warps"] >= 1 and e["shared_bytes"] <= 232448
        runtime = [n for n, ty in e["signature"].items() if ty != "constexpr"]
        assert len(e["codes"]) == len(runtime) and e["codes"].count("D") == len(e["descs"])
        assert e["params"][-2:] == ["*i8", "*i8"]
        assert hashlib.sha256((out / e["cubin"]).read_bytes()).hexdigest() == e["cubin_sha256"]
    pdl = next(e for e in manifest["kernels"] if e["launch_pdl"])
    assert "'PDL'" not in pdl["key"] and "('launch_pdl', True)" in pdl["key"]


def test_cubins_are_sm90_elf_with_the_named_function(sample_builds):
    (manifest, out), _ = sample_builds
    for e in manifest["kernels"]:
        blob = (out / e["cubin"]).read_bytes()
        assert B.cubin_sm(blob) == 90 and B.check_cubin(blob, e["function"], 90) is None
        assert B.check_cubin(blob, "_no_such_kernel", 90) is not None


def test_a_rebuild_is_byte_identical(sample_builds):
    """Each variant compiles from scratch (a private Triton cache), so this is two full compiles."""
    (_, a), (_, b) = sample_builds
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir()) and len(files) == len(_sample()) + 1
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_failing_variant_is_recorded_and_the_cli_exits_nonzero(tmp_path, monkeypatch, capsys):
    from rlk_core.aot import __main__ as cli

    good = B.enumerate_variants(["swiglu"], ["bf16"])[:1]
    bad = {**good[0], "key": "bad", "constexprs": {**good[0]["constexprs"], (6,): 3}}  # BLOCK = 3: no arange
    monkeypatch.setattr(B, "enumerate_variants", lambda *a, **k: [*good, bad])
    assert cli.main(["build", "--target", "cuda:90", "--out", str(tmp_path), "--jobs", "1"]) == 1
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert [e["key"] for e in manifest["failed"]] == ["bad"] and manifest["failed"][0]["error"]
    assert len(manifest["kernels"]) == 1
    err = capsys.readouterr().err
    assert "FAILED" in err and "[2/2" in err


def test_the_cli_refuses_an_unknown_family_and_lists_the_variants(capsys):
    from rlk_core.aot import __main__ as cli

    with pytest.raises(SystemExit):
        cli.main(["list", "--families", "linea"])
    assert cli.main(["list", "--families", "swiglu", "--dtypes", "fp16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(B.enumerate_variants(["swiglu"], ["fp16"])) and all(ln.startswith("swiglu ") for ln in
                                                                                   lines)


def test_a_build_through_a_triton_cache_reports_that_it_serves_each_variant(tmp_path):
    """A build with ``triton_cache`` (two worker processes) records each compile's Triton key and checks the cache
    under the key this process computes (the JIT's): every variant's group file and the files it lists. Negative
    controls: a group file removed, a child file removed, a key recorded wrong — each reported."""
    variants = B.enumerate_variants(["rms_norm"], ["bf16"])[:3]
    cache = tmp_path / "triton-cache"
    m = B.build("cuda:90", tmp_path / "out", variants=variants, jobs=2, triton_cache=cache)
    assert m["triton_cache"] == {"variants": 3, "other_key": [], "incomplete": []}
    by_key = {e["key"]: e for e in m["kernels"]}
    entries = [by_key[v["key"]] for v in variants]
    assert [e["triton_key"] for e in entries] == [B.compile_key(v) for v in variants]
    first, second = (cache / B.cache_folder(B.compile_key(v)) for v in variants[:2])
    (first / f"__grp__{variants[0]['kernel']}.json").unlink()
    next(p for p in second.iterdir() if p.suffix == ".cubin").unlink()
    entries[2] = {**entries[2], "triton_key": "0" * 64}
    report = B.cache_report(cache, variants, entries)
    assert report["incomplete"] == [variants[0]["key"], variants[1]["key"]]
    assert report["other_key"] == [variants[2]["key"]]


_KEY_ORDER = """
import json, sys
from rlk_core.aot import build as B
vs = B.enumerate_variants(B.FAMILIES, ["bf16"])
order = vs[::-1] if sys.argv[1] == "reversed" else vs
print(json.dumps({v["key"]: B.compile_key(v) for v in order}))
"""


def test_compile_keys_do_not_depend_on_which_kernel_a_process_hashes_first():
    """Triton's compile key of every variant is the same whichever kernels a process hashed before (as a build worker,
    the main process and a run's JIT each hash them in their own order). Triton 3.6 folds a callee's global
    constexprs into a caller's key only when the callee was hashed first: a global constexpr in a shared helper
    would make the keys depend on the order (below: none has one)."""
    runs = {}
    for order in ("forward", "reversed"):
        proc = subprocess.run([sys.executable, "-c", _KEY_ORDER, order], capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[order] = json.loads(proc.stdout)
    assert runs["forward"] == runs["reversed"]


def test_no_kernel_depends_on_a_global_constexpr():
    import importlib

    from triton.language.core import constexpr
    from triton.runtime.jit import JITFunction

    fns = [v for name in B.FAMILIES.values() for v in vars(importlib.import_module(name)).values()
           if isinstance(v, JITFunction)]
    for fn in fns:
        assert fn.cache_key
    found = sorted({(fn.__name__, var) for fn in fns for (var, _), (val, _) in fn.used_global_vals.items()
                    if isinstance(val, constexpr)})
    assert not found, found


def test_unknown_target_is_refused():
    with pytest.raises(ValueError, match="cuda:90"):
        B.parse_target("cuda:75")


@pytest.mark.slow
def test_the_full_build_of_the_row_wise_and_gemm_families_succeeds(tmp_path):
    """Every variant of linear, rms_norm, swiglu and rope in bf16 through the CLI (two worker processes): no failure.
    The attention and log-prob families (heavier kernels: about an hour on two cores) are built whole by
    ``setup.py`` on a CUDA build host, where a failed variant fails the build."""
    families = ("linear", "rms_norm", "swiglu", "rope")
    proc = subprocess.run([sys.executable, "-m", "rlk_core.aot", "build", "--out", str(tmp_path), "--jobs", "2",
                           "--families", ",".join(families), "--dtypes", "bf16"], capture_output=True, text=True,
                          timeout=3000)
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert len(manifest["kernels"]) == len(B.enumerate_variants(families, ["bf16"])) and not manifest["failed"]


# -- other targets: built and checked on the CPU, not served ----------------------------------------------------------
def test_a_gfx942_build_writes_code_objects_whose_metadata_reads_back(tmp_path):
    """Triton's AMD backend compiles rms_norm / swiglu / rope for gfx942 on this machine: each code object is an
    AMDGPU ELF with the kernel's symbol, its descriptor and the gfx942 target; a corrupted one is refused; families
    whose rules use TMA / PDL are refused for the target."""
    variants = [B.enumerate_variants([f], ["bf16"], "hip:gfx942")[0] for f in B.HIP_FAMILIES]
    m = B.build("hip:gfx942", tmp_path, variants=variants, jobs=1)
    assert m["target"] == "hip:gfx942" and not m["failed"] and len(m["kernels"]) == 3
    for e in m["kernels"]:
        blob = (tmp_path / e["cubin"]).read_bytes()
        assert e["cubin"].endswith(".hsaco") and B.check_code_object(blob, e["function"], "gfx942") is None
        assert B.check_code_object(blob, e["function"], "gfx90a") is not None  # another target's name
    with pytest.raises(ValueError, match="only"):
        B.build("hip:gfx942", tmp_path / "linear", ["linear"], ["bf16"], jobs=1)


def test_an_sm100_build_writes_cubins_for_sm100_that_rlk_cuda_does_not_serve_yet(tmp_path):
    """Triton's bundled ptxas compiles the row-wise, GEMM (persistent TMA, 148 SMs as on a B200) and log-prob
    variants for sm_100 on this machine: each cubin is a CUDA ELF for sm_100, the check refuses it as sm_90, and
    rlk.cuda maps no device to the target."""
    from rlk_core.ops import _cuda

    variants = [B.enumerate_variants(["rms_norm"], ["bf16"], "cuda:100")[0],
                next(v for v in B.enumerate_variants(["linear"], ["bf16"], "cuda:100")
                     if v["kernel"] == "_linear_tma_kernel"),
                next(v for v in B.enumerate_variants(["token_logprobs"], ["bf16"], "cuda:100")
                     if v["kernel"] == "_merge_groups_kernel")]
    assert re.search(r"\('constexpr', 148\)", variants[1]["key"])  # NUM_PROGRAMS: the B200's SMs
    m = B.build("cuda:100", tmp_path, variants=variants, jobs=1)
    assert not m["failed"] and len(m["kernels"]) == 3 and "not launched" in m["note"]
    for e in m["kernels"]:
        blob = (tmp_path / e["cubin"]).read_bytes()
        assert B.cubin_sm(blob) == 100 and B.check_cubin(blob, e["function"], 90) is not None
    assert "cuda:100" not in _cuda.TARGETS.values() and B.SERVED == ("cuda:90",)
    assert B.cubin_sm(b"\x7fELF" + bytes(60)) is None  # not a CUDA ELF


def test_build_variables_are_declared_and_setup_reads_no_other():
    from rlk_core import envs

    setup = (Path(__file__).resolve().parents[2] / "packages" / "rlk-core" / "setup.py").read_text()
    names = {v.name for v in envs.ENV_VARS}
    read = set(re.findall(r"\b(RLK_[A-Z_]+)\b", setup))
    assert read and read <= names, read - names
    assert envs.get("RLK_BUILD_TARGETS", {"RLK_BUILD_TARGETS": "cuda:90, cuda:100"}) == ("cuda:90", "cuda:100")
    assert envs.get("RLK_BUILD_JOBS", {"RLK_BUILD_JOBS": "16"}) == 16
    for var, bad in (("RLK_BUILD_JOBS", "0"), ("RLK_BUILD_TARGETS", "sm90"), ("RLK_BUILD_EXT", "yes")):
        with pytest.raises(Exception, match=var):
            envs.get(var, {var: bad})
