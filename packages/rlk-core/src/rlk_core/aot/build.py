"""Compile :func:`rlk_core.aot.specs.enumerate_specs` to cubins with ``triton.compile`` and write a manifest.

Every variant is compiled from scratch (a private Triton cache per variant, so a stale cache can neither
hide a compile failure nor make two builds differ) through Triton's whole pipeline down to the cubin,
with the ptxas bundled in the Triton wheel: no GPU, no CUDA toolkit. Output, in ``out_dir``:

- ``<kernel>-<hash>.cubin`` per variant, ``hash`` the first 16 hex digits of the SHA-256 of the variant's
  identity, the kernel's source hash, the target and the Triton version;
- ``manifest.json``: per variant what a launcher needs — the function name in the cubin, the Triton-level
  signature, the cubin's parameter list in order (TMA descriptors expanded into the ``CUtensorMap`` and
  their shape and strides, the two scratch pointers Triton appends), constexprs, divisibility
  assumptions, ``num_warps``, dynamic shared memory, the descriptors' encoding (``tensordesc_meta``),
  whether it is launched with PDL, the grid rule's name — plus the variants that failed (with the error)
  and the launches no variant serves (``not_built``). No timestamps: two builds of one tree are
  byte-identical (tested).

``rlk_core._C`` (``csrc/rlk_cuda.cpp``) launches them as the backend ``rlk.cuda`` (docs/compiled-ops.md).
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from rlk_core.aot.specs import DEFAULT_SMS, DTYPES, LAYOUTS, OPS, TRITON_TYPE, Spec, enumerate_specs, not_built
from rlk_core.ops._cuda_common import TARGETS as _RUNTIME_TARGETS

MANIFEST = "manifest.json"
FORMAT = 1
TARGETS = {"cuda:90": ("cuda", 90, 32), "cuda:100": ("cuda", 100, 32), "hip:gfx942": ("hip", "gfx942", 64)}
# targets rlk.cuda launches (their one home: rlk_core.ops._cuda_common.TARGETS): the others are built and checked, not
# served, until a device of that target has run the GPU suite on them (the CLI builds cuda:100 for 148 SMs, a B200)
SERVED = tuple(sorted(set(_RUNTIME_TARGETS.values())))
TARGET_SMS = {"cuda:90": DEFAULT_SMS, "cuda:100": 148}  # the CLI's default --sms: the H200's 132, the B200's 148
# families whose kernels a hip target can take as they are: no TMA, no NVIDIA-only instruction, configs that do
# not depend on the device (the GEMM, attention and log-prob rules are tuned for the H200 and use TMA / PDL)
HIP_OPS = ("rms_norm", "swiglu", "rope")
ELF_MACHINE_AMDGPU = 224
ELF_MACHINE_CUDA = 190
ELF_OSABI_CUDA_V2 = 0x41  # the cubin ELF layout of CUDA 12.8+ (sm_100 and later): the SM in e_flags bits 8-15


def cubin_sm(binary: bytes) -> int | None:
    """The SM architecture a cubin is for (90, 100, ...) from its ELF header, or None where it is not a CUDA ELF."""
    if binary[:4] != b"\x7fELF" or int.from_bytes(binary[18:20], "little") != ELF_MACHINE_CUDA:
        return None
    flags = int.from_bytes(binary[48:52], "little")
    return (flags >> 8) & 0xFF if binary[7] == ELF_OSABI_CUDA_V2 else flags & 0xFF


def check_cubin(binary: bytes, function: str, sm: int) -> str | None:
    """Why a cubin is not what the manifest says, or None: a CUDA ELF (``e_machine`` 190) for ``sm_<sm>`` holding the
    kernel's symbol (what ``cuModuleGetFunction`` looks up)."""
    got = cubin_sm(binary)
    if got is None:
        return "not a CUDA ELF file"
    if got != sm:
        return f"the cubin is for sm_{got}, not sm_{sm}"
    if function.encode() + b"\0" not in binary:
        return f"no symbol {function!r} in the cubin"
    return None


def check_code_object(binary: bytes, function: str, arch: str) -> str | None:
    """Why an AMD GPU code object (``.hsaco``) is not what the manifest says, or None: an ELF for AMDGPU
    (``e_machine`` 224) holding the kernel's symbol and its kernel descriptor (``<name>.kd``, what
    ``hipModuleGetFunction`` looks up) and the target triple ``amdgcn-amd-amdhsa--<arch>``."""
    if binary[:4] != b"\x7fELF":
        return "not an ELF file"
    machine = int.from_bytes(binary[18:20], "little")
    if machine != ELF_MACHINE_AMDGPU:
        return f"ELF machine {machine}, not AMDGPU ({ELF_MACHINE_AMDGPU})"
    if function.encode() + b"\0" not in binary or function.encode() + b".kd\0" not in binary:
        return f"no symbol {function!r} and its kernel descriptor {function + '.kd'!r} in the code object"
    if f"amdgcn-amd-amdhsa--{arch}".encode() not in binary:
        return f"the code object's target is not amdgcn-amd-amdhsa--{arch}"
    return None


def parse_target(target: str) -> tuple[str, int, int]:
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: the AOT build knows {sorted(TARGETS)}")
    return TARGETS[target]


def _kernel(spec: Spec):
    import importlib

    return getattr(importlib.import_module(spec.module), spec.kernel)


def _dns(kernel) -> list[str]:
    """The kernel's ``do_not_specialize`` arguments, by name."""
    return [p.name for p in kernel.params if p.do_not_specialize]


def triton_signature(spec: Spec, kernel=None) -> tuple[dict[str, str], dict[str, Any], list[str]]:
    """``(signature, constexprs, divisible)`` as ``triton.compile`` takes them: every argument of the
    kernel in order with its Triton type (``constexpr`` for constexprs and the layout's unit strides),
    and the names marked divisible by 16 (``aligned`` layout: pointers and integers except the kernel's
    ``do_not_specialize`` and the variant's ``plain``)."""
    kernel = kernel or _kernel(spec)
    const = {**dict(spec.constexprs), **{n: 1 for n in spec.ones}}
    ptrs, boxes, loose = dict(spec.pointers), dict(spec.descriptors), {*_dns(kernel), *spec.plain}
    sig, divisible = {}, []
    dtype = spec.dtype.split("->")[0].split(",")[0]
    for name in kernel.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name in boxes:
            sig[name] = "tensordesc<{}[{}, {}]>".format(dtype, *boxes[name])
        else:
            if name.endswith("_ptr"):
                sig[name] = ptrs.get(name, "*" + dtype)
            else:
                sig[name] = "fp32" if name in spec.floats else "i32"
            if spec.layout == "aligned" and name not in spec.floats and name not in loose:
                divisible.append(name)
    return sig, const, divisible


def cubin_params(signature: dict[str, str], tensordesc_meta: list | None) -> list[dict[str, str]]:
    """The cubin's kernel parameters in order, as Triton 3.6's CUDA launcher passes them: constexprs
    dropped, a TMA descriptor lowered to a ``CUtensorMap`` (by value, 128 bytes) followed by its shape
    (i32 each) and strides (i64 each), then the global and profile scratch pointers."""
    params, d = [], 0
    for name, ty in signature.items():
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            ndim = ty.count(",") + 1
            assert tensordesc_meta and tensordesc_meta[d] is not None, f"{name}: descriptor not lowered to TMA"
            d += 1
            params.append({"name": name, "type": "CUtensorMap"})
            params += [{"name": f"{name}.shape[{i}]", "type": "i32"} for i in range(ndim)]
            params += [{"name": f"{name}.strides[{i}]", "type": "i64"} for i in range(ndim)]
        else:
            params.append({"name": name, "type": ty})
    return params + [{"name": "global_scratch", "type": "*i8"}, {"name": "profile_scratch", "type": "*i8"}]


def ptx_param_count(ptx: str, function: str) -> int:
    """Parameters of ``.entry function`` in the PTX (checks :func:`cubin_params` against the compiler)."""
    m = re.search(r"\.entry\s+" + re.escape(function) + r"\s*\((.*?)\)", ptx, re.S)
    assert m, f"no .entry {function} in the PTX"
    return m.group(1).count(".param")


def variant_hash(spec: Spec, source_hash: str, target: str, triton_version: str) -> str:
    ident = json.dumps([spec.identity(), source_hash, target, triton_version])
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def jit_source(spec: Spec, kernel=None):
    """``(ASTSource, options)`` of the variant exactly as Triton's JIT builds them for a launch with this
    specialisation (``JITFunction._pack_args``): the signature, the constexprs, an attribute list for every
    argument the JIT specialises (divisible by 16, or empty: an unmarked integer or pointer) and the launch's
    options (``launch_pdl`` included: the JIT takes it as an option). Triton's compile key of the pair is then the
    JIT's own, so a Triton cache the build writes (``triton_cache``) serves the JIT's launches unchanged."""
    from triton.compiler import ASTSource

    kernel = kernel or _kernel(spec)
    sig, const, divisible = triton_signature(spec, kernel)
    loose, floats = set(_dns(kernel)), set(spec.floats)
    attrs = {}
    for i, name in enumerate(kernel.arg_names):
        ty = sig[name]
        if ty == "constexpr" or ty.startswith("tensordesc") or name in floats or (name in loose and ty[0] != "*"):
            continue
        attrs[(i,)] = [["tt.divisibility", 16]] if name in divisible else []
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, **dict(spec.options)}
    if spec.launch_pdl:
        options["launch_pdl"] = True
    return ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs), options


def compile_key(spec: Spec, target: str = "cuda:90") -> str:
    """Triton's compile (and cache) key of the variant: the hash its cache directory is named by."""
    import hashlib

    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key

    src, options = jit_source(spec)
    backend = make_backend(GPUTarget(*parse_target(target)))
    opts = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, opts, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def compile_spec(spec: Spec, target: str = "cuda:90",
                 triton_cache: str | None = None) -> tuple[dict[str, Any], bytes | None]:
    """Compile one variant; ``(manifest entry, cubin bytes)``, or ``(entry with "error", None)``. With
    ``triton_cache``, Triton's cache directory is that folder (shared, as a JIT's is) instead of a fresh private
    one: the JIT of a process pointed at it (``TRITON_CACHE_DIR``) then loads this compile for the same launch."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel = _kernel(spec)
    source_hash = kernel.cache_key  # the kernel's source and every @jit function it calls, Triton's own hash
    name = f"{spec.kernel}-{variant_hash(spec, source_hash, target, triton.__version__)}"
    sig, const, divisible = triton_signature(spec, kernel)
    entry: dict[str, Any] = {
        "op": spec.op, "kernel": spec.kernel, "module": spec.module, "variant": spec.name, "dtype": spec.dtype,
        "layout": spec.layout, "tile": list(spec.tile) if spec.tile else None,
        "signature": [{"name": k, "type": v} for k, v in sig.items()],
        "constexprs": {k: v for k, v in const.items()},
        "divisible_by_16": divisible,
        "plain": list(spec.plain),
        "do_not_specialize": _dns(kernel),
        "num_warps": spec.num_warps, "num_stages": spec.num_stages, "options": dict(spec.options),
        "grid": spec.grid, "launch_pdl": spec.launch_pdl, "target": target,
        "triton_version": triton.__version__, "source_hash": source_hash,
    }
    src, options = jit_source(spec, kernel)
    try:
        with triton.knobs.cache.scope(), tempfile.TemporaryDirectory(prefix="rlk-aot-") as cache:
            triton.knobs.cache.dir = triton_cache or cache
            compiled = triton.compile(src, target=GPUTarget(*parse_target(target)), options=options)
    except Exception as exc:  # recorded in the manifest; the CLI exits non-zero
        entry["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        return entry, None
    md = compiled.metadata
    meta = [dict(m) if m is not None else None for m in (md.tensordesc_meta or [])]
    params = cubin_params(sig, meta)
    backend, arch, _ = parse_target(target)
    if backend == "hip":  # an AMD GPU code object; nothing in rlk launches it yet (docs/rocm.md)
        cubin, suffix = compiled.asm["hsaco"], ".hsaco"
        problem = check_code_object(cubin, md.name, str(arch))
        if problem is not None:
            entry["error"] = problem
            return entry, None
        entry.update({"arch": md.arch, "warp_size": md.warp_size})
    else:
        n_ptx = ptx_param_count(compiled.asm["ptx"], md.name)
        if n_ptx != len(params):
            entry["error"] = f"cubin has {n_ptx} parameters, the manifest's list {len(params)}"
            return entry, None
        cubin, suffix = compiled.asm["cubin"], ".cubin"
        problem = check_cubin(cubin, md.name, arch)
        if problem is not None:
            entry["error"] = problem
            return entry, None
    entry.update({
        "cubin": name + suffix, "function": md.name, "params": params,
        "shared_bytes": md.shared, "num_ctas": md.num_ctas, "cluster_dims": list(getattr(md, "cluster_dims", ()) or ()),
        # (the hip backend's metadata has no global scratch fields: None there)
        "global_scratch_size": getattr(md, "global_scratch_size", None),
        "global_scratch_align": getattr(md, "global_scratch_align", None),
        "profile_scratch_size": md.profile_scratch_size, "tensordesc_meta": meta,
        "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
        "triton_key": compiled.hash,  # the compile's Triton cache directory (compile_key of the spec, as compiled)
    })
    return entry, cubin


def _compile_many(specs: list[Spec], target: str,
                  triton_cache: str | None = None) -> list[tuple[dict[str, Any], bytes | None]]:
    return [compile_spec(s, target, triton_cache) for s in specs]


def build(target: str = "cuda:90", out_dir: str | os.PathLike = "aot-build", specs: Iterable[Spec] | None = None,
          sms: int = DEFAULT_SMS, jobs: int | None = None,
          progress: Callable[[int, int, dict[str, Any], float], None] | None = None,
          triton_cache: str | os.PathLike | None = None, selection: dict[str, list[str]] | None = None
          ) -> dict[str, Any]:
    """Compile ``specs`` (default: :func:`enumerate_specs` with ``sms``) for ``target`` into ``out_dir``;
    returns the manifest (also written to ``out_dir/manifest.json``). ``jobs`` worker processes (default:
    the CPU count); ``progress(done, total, entry, seconds)`` after each variant; ``triton_cache``: see
    :func:`compile_spec` (not recorded in the manifest: the cubins are the same either way). Failures are
    recorded in the manifest's ``failed``, not raised. ``selection``: the ops / dtypes / layouts the specs were
    enumerated for (``python -m rlk_core.aot build``'s options), recorded as the manifest's ``selection`` so a reader
    knows a partial build from a full one (with ``specs`` None: the full enumeration; else None: unknown)."""
    import triton

    hip = parse_target(target)[0] == "hip"
    full = specs is None
    specs = list(specs) if specs is not None else enumerate_specs(HIP_OPS if hip else OPS, sms=sms)
    if hip:
        other = sorted({s.op for s in specs} - set(HIP_OPS))
        if other:
            raise ValueError(f"target {target}: the AOT build compiles only {HIP_OPS} for it, not {other} "
                             "(their rules use TMA / PDL and H200 tiles; docs/rocm.md)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(specs) or 1))
    chunks = [specs[i:i + 4] for i in range(0, len(specs), 4)]
    cache = None if triton_cache is None else str(Path(triton_cache).resolve())
    results: dict[int, tuple[dict[str, Any], bytes | None]] = {}
    start, done = time.monotonic(), 0

    def record(i0: int, res: list) -> None:
        nonlocal done
        for j, r in enumerate(res):
            results[i0 + j] = r
            done += 1
            if progress:
                progress(done, len(specs), r[0], time.monotonic() - start)

    if jobs == 1:
        for ci, chunk in enumerate(chunks):
            record(ci * 4, _compile_many(chunk, target, cache))
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that has imported torch
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_compile_many, chunk, target, cache): ci * 4 for ci, chunk in enumerate(chunks)}
            for f in concurrent.futures.as_completed(futures):
                record(futures[f], f.result())
    kernels, failed, built_specs = [], [], []
    for i in range(len(specs)):
        entry, cubin = results[i]
        if cubin is None:
            failed.append(entry)
            continue
        (out / entry["cubin"]).write_bytes(cubin)
        kernels.append(entry)
        built_specs.append(specs[i])
    manifest = {
        "format": FORMAT, "target": target, "triton_version": triton.__version__, "sms": sms,
        "note": ("built ahead of time by rlk_core.aot; no launcher for this target yet (docs/rocm.md)" if hip else
                 "built ahead of time by rlk_core.aot; launched by rlk_core._C as the backend rlk.cuda"
                 if target in SERVED else
                 "built ahead of time by rlk_core.aot; not launched: rlk.cuda serves this target once a device of it "
                 "has run the GPU suite (docs/compiled-ops.md)"),
        "kernels": sorted(kernels, key=lambda e: e["cubin"]),
        "failed": sorted(failed, key=lambda e: e["variant"]),
        "not_built": not_built(sms),
        **({"triton_cache": cache_report(cache, built_specs, kernels, target)} if cache is not None else {}),
        "selection": selection if selection is not None or not full else {
            "ops": list(HIP_OPS if hip else OPS), "dtypes": [TRITON_TYPE[d] for d in DTYPES], "layouts": list(LAYOUTS)},
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def cache_report(cache: str | os.PathLike, specs: list[Spec], entries: list[dict[str, Any]],
                 target: str = "cuda:90") -> dict[str, Any]:
    """Whether the Triton cache a build compiled through serves each variant to the JIT: its compile under the key
    this process computes for the variant (:func:`compile_key`, the JIT's for the same launch) — ``other_key``: the
    worker's compile had another key — with its group file (``<base32 of the key>/__grp__<kernel>.json``) and every
    file the group lists present — ``incomplete``: not. Either way the JIT compiles that launch again at first use
    (the same binary, a compile's time); the GPU suite's cache check fails on it."""
    other, incomplete = [], []
    for spec, e in zip(specs, entries, strict=True):
        key = compile_key(spec, target)
        if e.get("triton_key") != key:
            other.append(e["variant"])
        group = Path(cache) / cache_folder(key) / f"__grp__{spec.kernel[:150]}.json"
        try:
            children = json.loads(group.read_text())["child_paths"]
            complete = all(Path(p).is_file() for p in children.values())
        except (OSError, ValueError, KeyError):
            complete = False
        if not complete:
            incomplete.append(e["variant"])
    return {"variants": len(entries), "other_key": other, "incomplete": incomplete}


def cache_folder(key: str) -> str:
    """The folder of a Triton cache that holds the compile with this key (hex): triton.runtime.cache's name for it,
    the key's base32 without padding."""
    return base64.b32encode(bytes.fromhex(key)).decode().rstrip("=")


def print_progress(done: int, total: int, entry: dict[str, Any], seconds: float) -> None:
    status = "FAILED " + entry["error"].splitlines()[0][:200] if "error" in entry else entry["cubin"]
    print(f"[{done}/{total} {seconds:6.1f}s] {entry['variant']}: {status}", file=sys.stderr, flush=True)
