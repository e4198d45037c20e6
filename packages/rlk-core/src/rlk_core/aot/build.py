"""The AOT build: the launches of every op's build calls, compiled to cubins with ``triton.compile``, and a manifest.

Each op's Triton module names the calls its plan is compiled for (``build_calls(dtype, sms)``: calls on meta
tensors covering its configurations, tiles and integer classes); :func:`enumerate_variants` runs them on a plan that
launches nothing and keeps, per distinct key of Triton's own specialisation (:func:`rlk_core.ops._plan.specialize`),
what ``JITFunction._pack_args`` would hand the compiler — the signature, constexprs, attributes and options. Adding a
kernel is its source and its plan (and the calls to build it for): nothing here changes.

Every variant is compiled from scratch (a private Triton cache per variant, so a stale cache can neither hide a
compile failure nor make two builds differ) through Triton's whole pipeline down to the cubin with the ptxas bundled
in the Triton wheel: no GPU, no CUDA toolkit. Output, in ``out_dir``: ``<kernel>-<hash>.cubin`` per variant (``hash``
of its key, the kernel's source hash, the target and the Triton version) and ``manifest.json``: per variant its key,
the function name, the launcher's parameter codes and descriptor encodings, dynamic shared memory, warps, PDL,
Triton's cache key of the compile; the failed variants with their error; no timestamps (two builds of one tree are
byte-identical). With ``triton_cache``, Triton's cache folder is that one (a JIT pointed at it, ``TRITON_CACHE_DIR``,
loads these compiles for the same launches: the compile key is the JIT's by construction).
"""

from __future__ import annotations

import base64
import concurrent.futures
import hashlib
import importlib
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

import torch

import rlk_core.ops  # noqa: F401  (registers every op: their kernel modules are the families)
from rlk_core.ops import _plan
from rlk_core.ops._backends import KERNEL_MODULES
from rlk_core.ops._cuda import GENERIC_BITWISE
from rlk_core.ops._cuda import TARGETS as SERVED_BY_CAPABILITY

MANIFEST = "manifest.json"
FORMAT = 2
TARGETS = {"cuda:90": ("cuda", 90, 32), "cuda:100": ("cuda", 100, 32), "hip:gfx942": ("hip", "gfx942", 64)}
SERVED = tuple(sorted(set(SERVED_BY_CAPABILITY.values())))  # the targets rlk.cuda launches; others built, checked
TARGET_SMS = {"cuda:90": 132, "cuda:100": 148}  # the persistent kernels' NUM_PROGRAMS: the H200's, the B200's


def family_name(module: str) -> str:
    """An AOT family's name (``RLK_BUILD_OPS``, ``--families``): the op package its Triton module is in, with the
    module's own suffix — ``rlk_core.ops.rms_norm.triton`` -> ``rms_norm``, ``...attention.triton_backward`` ->
    ``attention_backward``; a module of another name is its own family (``pkg.my_op`` -> ``my_op``)."""
    package, _, leaf = module.rpartition(".")
    if not leaf.startswith("triton") or not package:
        return leaf
    return package.rpartition(".")[2] + leaf.removeprefix("triton")


# family -> the Triton module whose build_calls it compiles: one per module an op registered its kernel backends from
# (rlk_core.ops._backends.register_kernel_backends), so a new op's module is a family without a line here
FAMILIES = {family_name(m): m for m in KERNEL_MODULES}
FAMILY_OPS = {family_name(m): tuple(ops) for m, ops in KERNEL_MODULES.items()}  # family -> the ops its kernels serve
# families whose kernels a hip target can take as they are: no TMA, no NVIDIA-only instruction, configurations that do
# not depend on the device (the GEMM, attention and log-prob rules are tuned for the H200 and use TMA / PDL)
HIP_FAMILIES = ("rms_norm", "swiglu", "rope")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ELF_MACHINE_AMDGPU = 224
ELF_MACHINE_CUDA = 190
ELF_OSABI_CUDA_V2 = 0x41  # the cubin ELF layout of CUDA 12.8+ (sm_100 and later): the SM in e_flags bits 8-15


def parse_target(target: str) -> tuple[str, Any, int]:
    if target not in TARGETS:
        raise ValueError(f"target {target!r}: the AOT build knows {sorted(TARGETS)}")
    return TARGETS[target]


# -- enumerating: the build calls' launches -------------------------------------------------------------------------
class Enumerate(_plan.Plan):
    """A plan on meta tensors that launches nothing: each launch's specialisation (and, for the kernels of
    ``GENERIC_BITWISE``, the one that assumes nothing) kept in ``variants`` by key."""

    def __init__(self, target: _plan.Target, family: str, sms: int, variants: dict[str, dict[str, Any]]) -> None:
        self.target, self.family, self.sms, self.variants = target, family, sms, variants
        self.tma = target.gpu_target.backend == "cuda"
        self.device = torch.device("meta")

    def new(self, shape, dtype, fill="empty"):
        return torch.empty(shape, dtype=dtype, device="meta")

    def contiguous(self, x, dtype=None):
        return x if (dtype or x.dtype) == x.dtype and x.is_contiguous() else torch.empty(
            x.shape, dtype=dtype or x.dtype, device="meta")

    def host(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)  # on meta tensors: shapes only

    def launch(self, kernel, grid, *args, **kwargs):
        for generic in (False, True) if kernel.__name__ in GENERIC_BITWISE else (False,):
            key, bound, spec, options = _plan.specialize(self.target, kernel, args, kwargs, generic)
            if key not in self.variants:
                opts, signature, constexprs, attrs = kernel._pack_args(self.target.backend, kwargs | {
                    "debug": options["debug"], "instrumentation_mode": options["instrumentation_mode"]},
                    bound, spec, options)
                self.variants[key] = {"key": key, "family": self.family, "module": kernel.module,
                                      "kernel": kernel.__name__, "spec": _plan.describe(spec), "signature": signature,
                                      "constexprs": constexprs, "attrs": attrs, "options": opts.__dict__,
                                      "generic": generic}


def enumerate_variants(families: Iterable[str], dtypes: Iterable[str], target: str = "cuda:90",
                       sms: int | None = None) -> list[dict[str, Any]]:
    """Every variant the build calls of ``families`` for ``dtypes`` launch on ``target`` (distinct keys, in the order
    first launched)."""
    backend, arch, warp = parse_target(target)
    tgt = _plan.Target(backend, arch, warp)
    sms = sms or TARGET_SMS.get(target, 132)
    variants: dict[str, dict[str, Any]] = {}
    for family in families:
        if family not in FAMILIES:
            raise ValueError(f"no AOT family {family!r}; known: {sorted(FAMILIES)}")
        module = importlib.import_module(FAMILIES[family])
        plan = Enumerate(tgt, family, sms, variants)
        for dtype in dtypes:
            for fn, args in module.build_calls(DTYPES[dtype], sms):
                fn(plan, *args)
    return list(variants.values())


# -- compiling one variant ------------------------------------------------------------------------------------------
def param_codes(signature: dict[str, str], metas: list | None) -> tuple[str, list[list[int]], list[str]]:
    """The launcher's codes of a signature (``p`` pointer, ``i`` int32, ``l`` int64, ``f`` fp32, ``D`` descriptor), the
    descriptors' encodings ``[box0, box1, swizzle, elem_size, elem_type]`` and the cubin's parameter types as Triton
    3.6's launcher passes them (a descriptor as a ``CUtensorMap`` and its shape and strides; the two scratch
    pointers last)."""
    codes, descs, params = [], [], []
    metas = iter(metas or [])
    for name, ty in signature.items():
        if ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            meta = next(metas)
            if meta is None or meta.get("fp4_padded") or len(meta["block_size"]) != 2:
                raise ValueError(f"descriptor {name} is not a plain 2-D TMA descriptor")
            codes.append("D")
            descs.append([*meta["block_size"], meta["swizzle"], meta["elem_size"], meta["elem_type"]])
            params += ["CUtensorMap", "i32", "i32", "i64", "i64"]
        elif ty.startswith("*") or ty in ("i32", "i64", "fp32"):
            codes.append("p" if ty.startswith("*") else {"i32": "i", "i64": "l", "fp32": "f"}[ty])
            params.append(ty)
        else:
            raise ValueError(f"argument {name} of type {ty} has no launcher code")
    return "".join(codes), descs, params + ["*i8", "*i8"]


def cubin_sm(binary: bytes) -> int | None:
    """The SM architecture a cubin is for (90, 100, ...) from its ELF header, or None where it is not a CUDA ELF."""
    if binary[:4] != b"\x7fELF" or int.from_bytes(binary[18:20], "little") != ELF_MACHINE_CUDA:
        return None
    flags = int.from_bytes(binary[48:52], "little")
    return (flags >> 8) & 0xFF if binary[7] == ELF_OSABI_CUDA_V2 else flags & 0xFF


def check_cubin(binary: bytes, function: str, sm: int) -> str | None:
    """Why a cubin is not what the manifest says, or None: a CUDA ELF for ``sm_<sm>`` holding the kernel's symbol."""
    got = cubin_sm(binary)
    if got is None:
        return "not a CUDA ELF file"
    if got != sm:
        return f"the cubin is for sm_{got}, not sm_{sm}"
    if function.encode() + b"\0" not in binary:
        return f"no symbol {function!r} in the cubin"
    return None


def check_code_object(binary: bytes, function: str, arch: str) -> str | None:
    """Why an AMD GPU code object is not what the manifest says, or None: an ELF for AMDGPU holding the kernel's
    symbol, its kernel descriptor (``<name>.kd``) and the target triple ``amdgcn-amd-amdhsa--<arch>``."""
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


def _source(v: dict[str, Any]):
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(v["module"]), v["kernel"])
    return kernel, ASTSource(fn=kernel, signature=v["signature"], constexprs=v["constexprs"], attrs=v["attrs"])


def compile_key(v: dict[str, Any], target: str = "cuda:90") -> str:
    """Triton's compile (and cache) key of a variant: the hash its JIT cache directory is named by."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.runtime.cache import get_cache_key

    _, src = _source(v)
    backend = make_backend(GPUTarget(*parse_target(target)))
    opts = backend.parse_options(dict(v["options"], **src.parse_options()))
    key = get_cache_key(src, backend, opts, env_vars=get_cache_invalidating_env_vars())
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def compile_variant(v: dict[str, Any], target: str = "cuda:90",
                    triton_cache: str | None = None) -> tuple[dict[str, Any], bytes | None]:
    """Compile one variant: ``(manifest entry, cubin bytes)``, or ``(entry with "error", None)``."""
    import triton
    from triton.backends.compiler import GPUTarget

    kernel, src = _source(v)
    source_hash = kernel.cache_key  # the kernel's source and every @jit function it calls, Triton's own hash
    digest = hashlib.sha256(json.dumps([v["key"], source_hash, target, triton.__version__]).encode()).hexdigest()
    entry: dict[str, Any] = {k: v[k] for k in ("key", "family", "module", "kernel", "spec", "generic")}
    entry.update({"signature": v["signature"], "num_warps": v["options"]["num_warps"],
                  "num_stages": v["options"]["num_stages"], "launch_pdl": bool(v["options"].get("launch_pdl")),
                  "target": target, "triton_version": triton.__version__, "source_hash": source_hash})
    try:
        with triton.knobs.cache.scope(), tempfile.TemporaryDirectory(prefix="rlk-aot-") as cache:
            triton.knobs.cache.dir = triton_cache or cache
            compiled = triton.compile(src, target=GPUTarget(*parse_target(target)), options=v["options"])
        md = compiled.metadata
        if getattr(md, "global_scratch_size", 0) or md.profile_scratch_size or md.num_ctas != 1:
            raise ValueError("the variant needs scratch memory or several CTAs: no launcher passes them")
        metas = [dict(m) if m is not None else None for m in (md.tensordesc_meta or [])]
        codes, descs, params = param_codes(v["signature"], metas)
        backend, arch, _ = parse_target(target)
        if backend == "hip":  # an AMD GPU code object; nothing in rlk launches it yet (docs/rocm.md)
            binary, suffix, problem = compiled.asm["hsaco"], ".hsaco", check_code_object(compiled.asm["hsaco"], md.name,
                                                                                         str(arch))
        else:
            n_ptx = len(re.search(r"\.entry\s+" + re.escape(md.name) + r"\s*\((.*?)\)", compiled.asm["ptx"],
                                  re.S).group(1).split(".param")) - 1
            binary, suffix, problem = compiled.asm["cubin"], ".cubin", check_cubin(compiled.asm["cubin"], md.name, arch)
            if problem is None and n_ptx != len(params):
                problem = f"the cubin has {n_ptx} parameters, the launcher passes {len(params)}"
        if problem is not None:
            raise ValueError(problem)
    except Exception as exc:  # recorded in the manifest; the CLI exits non-zero
        entry["error"] = f"{type(exc).__name__}: {str(exc)[-2000:]}"
        return entry, None
    entry.update({"cubin": f"{v['kernel']}-{digest[:16]}{suffix}", "function": md.name, "codes": codes, "descs": descs,
                  "params": params, "shared_bytes": md.shared, "cubin_sha256": hashlib.sha256(binary).hexdigest(),
                  "triton_key": compiled.hash})
    return entry, binary


def _compile_many(variants: list[dict[str, Any]], target: str, cache: str | None) -> list[tuple[dict, bytes | None]]:
    return [compile_variant(v, target, cache) for v in variants]


def build(target: str = "cuda:90", out_dir: str | os.PathLike = "aot-build", families: Iterable[str] | None = None,
          dtypes: Iterable[str] = tuple(DTYPES), sms: int | None = None, jobs: int | None = None,
          progress: Callable[[int, int, dict[str, Any], float], None] | None = None,
          triton_cache: str | os.PathLike | None = None,
          variants: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Compile the variants of ``families`` (default: all, or :data:`HIP_FAMILIES` on a hip target) for ``dtypes`` into
    ``out_dir`` — or the given ``variants`` (:func:`enumerate_variants`' entries; tests build samples); returns the
    manifest (also written there). ``jobs`` worker processes (default: the CPU count); ``progress(done, total, entry,
    seconds)`` after each variant. Failures are recorded (``failed``), not raised."""
    import triton

    hip = parse_target(target)[0] == "hip"
    families = list(families or (HIP_FAMILIES if hip else FAMILIES))
    if variants is not None:
        families = sorted({v["family"] for v in variants})
    other = sorted(set(families) - set(HIP_FAMILIES)) if hip else []
    if other:
        raise ValueError(f"target {target}: the AOT build compiles only {HIP_FAMILIES} for it, not {other} "
                         "(their rules use TMA / PDL and H200 tiles; docs/rocm.md)")
    sms = sms or TARGET_SMS.get(target, 132)
    dtypes = list(dtypes)
    if variants is None:
        variants = enumerate_variants(families, dtypes, target, sms)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(variants) or 1))
    chunks = [variants[i:i + 4] for i in range(0, len(variants), 4)]
    cache = None if triton_cache is None else str(Path(triton_cache).resolve())
    results: dict[int, tuple[dict[str, Any], bytes | None]] = {}
    start = time.monotonic()

    def record(i0: int, res: list) -> None:
        for j, r in enumerate(res):
            results[i0 + j] = r
            if progress:
                progress(len(results), len(variants), r[0], time.monotonic() - start)

    if jobs == 1:
        for ci, chunk in enumerate(chunks):
            record(ci * 4, _compile_many(chunk, target, cache))
    else:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that has imported torch
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
            futures = {pool.submit(_compile_many, chunk, target, cache): ci * 4 for ci, chunk in enumerate(chunks)}
            for f in concurrent.futures.as_completed(futures):
                record(futures[f], f.result())
    kernels, failed, built = [], [], []
    for i, v in enumerate(variants):
        entry, binary = results[i]
        if binary is None:
            failed.append(entry)
            continue
        (out / entry["cubin"]).write_bytes(binary)
        kernels.append(entry)
        built.append(v)
    manifest = {
        "format": FORMAT, "target": target, "triton_version": triton.__version__, "sms": sms,
        "note": ("built ahead of time by rlk_core.aot; no launcher for this target yet (docs/rocm.md)" if hip else
                 "built ahead of time by rlk_core.aot; launched by rlk_core._C as the backend rlk.cuda"
                 if target in SERVED else
                 "built ahead of time by rlk_core.aot; not launched: rlk.cuda serves this target once a device of it "
                 "has run the GPU suite (docs/compiled-ops.md)"),
        "selection": {"families": families, "dtypes": dtypes},
        "kernels": sorted(kernels, key=lambda e: e["cubin"]),
        "failed": sorted(failed, key=lambda e: e["key"]),
        **({"triton_cache": cache_report(cache, built, kernels, target)} if cache is not None else {}),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def cache_report(cache: str | os.PathLike, variants: list[dict[str, Any]], entries: list[dict[str, Any]],
                 target: str = "cuda:90") -> dict[str, Any]:
    """Whether the Triton cache a build compiled through serves each variant to the JIT: its compile under the key
    this process computes for it (:func:`compile_key`, the JIT's for the same launch) — ``other_key`` where the
    worker's had another — with its group file and every file the group lists present (``incomplete`` where not)."""
    other, incomplete = [], []
    for v, e in zip(variants, entries, strict=True):
        key = compile_key(v, target)
        if e.get("triton_key") != key:
            other.append(e["key"])
        group = Path(cache) / cache_folder(key) / f"__grp__{v['kernel'][:150]}.json"
        try:
            complete = all(Path(p).is_file() for p in json.loads(group.read_text())["child_paths"].values())
        except (OSError, ValueError, KeyError):
            complete = False
        if not complete:
            incomplete.append(e["key"])
    return {"variants": len(entries), "other_key": other, "incomplete": incomplete}


def cache_folder(key: str) -> str:
    """The folder of a Triton cache that holds the compile with this key (hex): its base32 without padding."""
    return base64.b32encode(bytes.fromhex(key)).decode().rstrip("=")


def print_progress(done: int, total: int, entry: dict[str, Any], seconds: float) -> None:
    status = "FAILED " + entry["error"].splitlines()[0][:200] if "error" in entry else entry["cubin"]
    print(f"[{done}/{total} {seconds:6.1f}s] {entry['kernel']}{entry['spec'][:80]}: {status}", file=sys.stderr,
          flush=True)
