"""Deterministic attention (``rlk.attention.v1``) vs torch SDPA, same process, Qwen3 head shapes, bf16.

    python benchmarks/bench_attention.py [--quick] [--sections prefill,decode,backward,chunked]
                                         [--repeats 20] [--budget-s 110]

Four sections, each written by ``harness.write_results`` to ``$RLK_BENCH_OUT`` as
``attention_<section>.json|md`` (GPU, driver, torch, Triton, commit, copy bandwidth of this run):

* ``prefill``  causal ``attention_varlen`` vs SDPA forced to FLASH_ATTENTION and to CUDNN_ATTENTION.
  TFLOP/s from ``FLOP = 4 * L * (L + 1) / 2 * Hq * D`` per sequence (two matmuls, 2 FLOP per
  multiply-add, over the L(L+1)/2 causal (query, key) pairs including the diagonal).
* ``decode``   ``attention_decode`` over a paged, shuffled vLLM-layout cache (page 16 and 64) vs SDPA
  flash on contiguous K/V (query ``[B, Hq, 1, D]``, keys ``[B, Hkv, L, D]``, non-causal). Effective
  KV-read bandwidth = ``2 * sum(seq_lens) * Hkv * D * 2 bytes`` (K and V of every position once; q,
  output and block table ignored) / time, also as a fraction of ``harness.copy_bandwidth`` (read +
  write bytes of a 2 GiB device copy, measured at the start of this run).
* ``backward`` dq, dk, dv of causal prefill: rlk vs SDPA flash (and cuDNN) backward. Only the backward
  is timed: the forward runs once outside the timed region with its graph retained, and each timed
  call is ``torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)`` for SDPA. The rlk kernel
  time calls the selected ``attention_varlen_backward`` backend directly with the tensors the
  autograd node saves; the rlk autograd path (same ``autograd.grad`` call as SDPA) is reported beside
  it. ``FLOP = 2.5 x forward = 10 * L * (L + 1) / 2 * Hq * D`` (five matmuls: S recompute, dP, dV,
  dK, dQ). Extra baseline ``flash_det``: SDPA flash backward under
  ``torch.use_deterministic_algorithms(True)`` (rlk's backward is deterministic; plain FA2's is not).
* ``chunked``  ``attention_paged_prefill`` (chunk of 512 new tokens over a 4096-token cached prefix)
  vs SDPA flash on contiguous K/V with a bottom-right causal mask
  (``torch.nn.attention.bias.causal_lower_right``, which SDPA runs as FA2's native causal mode), and
  vs rlk's own ``attention_varlen`` on the same contiguous K/V (the cost of paging).
  ``FLOP = 4 * Hq * D * sum over the chunk's queries of (t + 1)``.

Timing: ``harness.time_fns`` (CUDA events, 256 MB L2 flush and ~0.5 ms GPU sleep before each call,
median). ``ratio = native_ms / rlk_ms`` (>= 1: rlk faster). ``rlk_ms`` is the device time of the
selected backend's function called directly with the op's arguments (as bench_linear times the
launcher); ``rlk_op_ms`` is the public op (custom op + input validation, whose value checks read
``cu_seqlens`` / block tables back to the host, so host time after that sync lands inside the events)
and ``ratio_op`` the ratio on it. The backend each op selects
(``REGISTRY.select(op, "cuda", args, strict=False)``) is recorded per row; when it is
``rlk.reference`` the case is recorded as "reference backend selected; not timed". SDPA gets
``[B, H, L, D]`` views (``transpose(1, 2)``) of the same ``[B, L, H, D]`` memory rlk reads as
``[T, H, D]`` (last dim contiguous, what flash wants; no copies). GQA through ``enable_gqa=True``; a
backend that rejects it runs on K/V expanded by ``repeat_interleave`` outside the timed region, and
the row says so. A baseline that cannot run is recorded with its error text (and torch's reasons),
never replaced by another backend. Any rlk error makes the exit status 1; every case still runs.
Repeats adapt to a per-case time cap, and cases past ``--budget-s`` are recorded as skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
import torch.utils.deterministic  # fill_uninitialized_memory, toggled around the deterministic baseline
from _common import MODELS, randn
from harness import copy_bandwidth, default_out_dir, environment, time_fns, write_results
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

import rlk_core.ops.attention as attn
from rlk_core.backends import REGISTRY
from rlk_core.ops.attention.reference import kv_cache_write_reference
from rlk_core.testing.attention import build_paged_kv, cu_seqlens

DTYPE = torch.bfloat16
REFERENCE_ID = "rlk.reference"
NOT_TIMED = "reference backend selected; not timed"
TARGETS = {"prefill_vs_flash": 1.0, "prefill_vs_cudnn": 0.8, "decode_vs_flash_bw": 0.9, "decode_of_copy": 0.7,
           "backward_vs_flash": 0.8}
FLOPS_NOTE = {
    "prefill": "4 * L*(L+1)/2 * Hq * D per sequence (2 matmuls x 2 FLOP/MAC over causal pairs incl. diagonal)",
    "backward": "10 * L*(L+1)/2 * Hq * D per sequence (2.5 x forward: S recompute, dP, dV, dK, dQ)",
    "chunked": "4 * Hq * D * sum_{queries t} (t + 1) (causal pairs of the chunk against prefix + chunk)",
    "decode": "KV bytes = 2 (K,V) * sum(seq_lens) * Hkv * D * 2 B; bandwidth = KV bytes / median time",
}
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}

# cases; --quick takes the first QUICK[section] of each list
PREFILL = [("qwen3-8b", 1, 8192), ("qwen3-8b", 1, 2048), ("qwen3-8b", 4, 2048), ("qwen3-0.6b", 1, 2048)]  # B x L
DECODE = [(64, 4096), (256, 2048), (1, 32768), (8, 8192)]  # batch x context, Qwen3-8B heads
DECODE_PAGES = (16, 64)
BACKWARD = [2048, 8192]  # one sequence, Qwen3-8B heads
CHUNKED = [(1, 4096, 512), (8, 4096, 512)]  # batch, cached prefix, new tokens; page 16
CHUNKED_PAGE = 16
QUICK = {"prefill": 2, "decode": 2, "decode_pages": 1, "backward": 1, "chunked": 1}


class Run:
    """Per-run settings and bookkeeping: repeats, per-case time cap, global budget, rlk errors."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.repeats = args.repeats
        self.big_repeats = max(3, args.repeats // 2)
        self.case_cap_s = 0.75 if args.quick else 1.5
        self.budget_s = args.budget_s
        self.t0 = time.perf_counter()
        self.rlk_errors: list[str] = []
        self.not_timed: list[str] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over_budget(self) -> bool:
        return self.budget_s > 0 and self.elapsed() > self.budget_s


# -- small helpers -----------------------------------------------------------------------------------
def _err(exc: BaseException, caught: Sequence[warnings.WarningMessage] = ()) -> str:
    msg = f"{type(exc).__name__}: {exc}".strip()
    reasons = list(dict.fromkeys(str(w.message).strip() for w in caught))
    if reasons:
        msg += " | torch warnings: " + " / ".join(reasons)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()
    return msg


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(result, None)`` or ``(None, error text with torch's warnings)``; synchronizes."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            out = fn()
            torch.cuda.synchronize()
            return out, None
        except Exception as exc:
            return None, _err(exc, caught)


@contextlib.contextmanager
def sdpa_only(backend: SDPBackend, deterministic: bool = False):
    """Exactly one SDPA backend; optionally ``torch.use_deterministic_algorithms(True)``, without its NaN
    fill of fresh allocations (which would add kernels to the timed region); all restored after."""
    prev = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    with sdpa_kernel(backend):
        if deterministic:
            torch.use_deterministic_algorithms(True)
            torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev, warn_only=warn_only)
            torch.utils.deterministic.fill_uninitialized_memory = fill


def timed(run: Run, fn: Callable[[], Any], repeats: int, ctx: Callable[[], Any] = contextlib.nullcontext
          ) -> tuple[dict[str, float] | None, str | None]:
    """Median device time of ``fn`` (inside ``ctx()``). One call first (compile / cuDNN plan), one
    host-timed call to cap the repeats at ``run.case_cap_s`` per case."""

    def go() -> dict[str, float]:
        with ctx():
            fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            est = max(time.perf_counter() - t, 1e-6)
            n = max(3, min(repeats, int(run.case_cap_s / est)))
            return time_fns([fn], warmup=1, repeats=n)

    return attempt(go)


def _short(text: str, n: int = 140) -> str:
    text = " ".join(str(text).replace("|", "/").split())
    return text if len(text) <= n else text[: n - 3] + "..."


def _clean(row: dict[str, Any]) -> dict[str, Any]:
    notes = [_short(x) for x in row.pop("_notes", [])]
    out = {k: v for k, v in row.items() if v is not None}
    out["notes"] = "; ".join(notes)
    return out


def _maxdiff(a: torch.Tensor | None, b: torch.Tensor | None) -> float | None:
    if a is None or b is None:
        return None
    return float((a.float() - b.float()).abs().max().item())


def _free() -> None:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# -- rlk side ----------------------------------------------------------------------------------------
def select_backend(op: str, args: tuple) -> tuple[Any, str | None, str | None]:
    """``(backend, fallback_reason, error)`` as the op itself would select on CUDA."""
    try:
        sel = REGISTRY.select(op, "cuda", args, strict=False)
        return sel.backend, sel.fallback_reason, None
    except Exception as exc:
        return None, None, _err(exc)


def rlk_error(run: Run, row: dict[str, Any], what: str, err: str, prefix: str = "rlk") -> None:
    row[f"{prefix}_status"], row[f"{prefix}_error"] = "error", err
    row["_notes"].append(f"{prefix} ERROR ({what}): {err}")
    run.rlk_errors.append(f"{row['case']} [{what}]: {err}")
    print(f"  {prefix} ERROR ({what}): {_short(err, 300)}", flush=True)


def run_rlk(run: Run, row: dict[str, Any], op: str, args: tuple, op_fn: Callable[[], Any], repeats: int,
            prefix: str = "rlk") -> Any:
    """Select, run once (output for the sanity diff), time the backend function directly
    (``<prefix>_ms``) and the public op (``<prefix>_op_ms``). Returns the output or None."""
    backend, why, err = select_backend(op, args)
    row[f"{prefix}_backend"] = backend.id if backend is not None else "none"
    if why:
        row[f"{prefix}_fallback"] = why
        row["_notes"].append(f"{prefix} fallback: {why}")
    if err is None and backend.id == REFERENCE_ID:
        row[f"{prefix}_status"] = NOT_TIMED
        row["_notes"].append(f"{prefix}: {NOT_TIMED}")
        run.not_timed.append(f"{row['case']} [{op}]")
        return None
    out = None
    if err is None:
        kernel = lambda: backend.fn(*args)  # noqa: E731
        out, err = attempt(kernel)
        if err is None:
            t, err = timed(run, kernel, repeats)
            if t is not None:
                row[f"{prefix}_ms"], row[f"{prefix}_repeats"] = t["median_ms"], t["repeats"]
    if err is None:
        t, err = timed(run, op_fn, repeats)
        if t is not None:
            row[f"{prefix}_op_ms"] = t["median_ms"]
    if err is not None:
        rlk_error(run, row, op, err, prefix)
        return out
    row[f"{prefix}_status"] = "ok"
    return out


# -- native side -------------------------------------------------------------------------------------
def sdpa_forward(run: Run, row: dict[str, Any], name: str, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                 scale: float, repeats: int, causal: bool = False, lower_right: Any = None) -> torch.Tensor | None:
    """Time SDPA under exactly one backend (``BACKENDS[name]``); fills ``<name>_ms`` / ``<name>_gqa`` /
    ``<name>_error``. GQA: ``enable_gqa=True`` first, else K/V repeated outside the timed region."""
    backend = BACKENDS[name]
    group = q4.shape[1] // k4.shape[1]

    def make(k_: torch.Tensor, v_: torch.Tensor, gqa: bool) -> Callable[[], torch.Tensor]:
        if lower_right is not None:
            return lambda: F.scaled_dot_product_attention(q4, k_, v_, attn_mask=lower_right, scale=scale,
                                                          enable_gqa=gqa)
        return lambda: F.scaled_dot_product_attention(q4, k_, v_, is_causal=causal, scale=scale, enable_gqa=gqa)

    def once(fn: Callable[[], torch.Tensor]) -> tuple[Any, str | None]:
        def go():
            with sdpa_kernel(backend):
                return fn()
        return attempt(go)

    fn = make(k4, v4, group > 1)
    out, err = once(fn)
    gqa = "enable_gqa=True" if group > 1 else "MHA"
    if err is not None and group > 1:
        kr, vr = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
        fn2 = make(kr, vr, False)
        out, err2 = once(fn2)
        if err2 is None:
            gqa = f"K/V repeat_interleave x{group} outside timing (enable_gqa=True rejected: {err})"
            fn = fn2
            err = None
        else:
            err = f"enable_gqa=True: {err} || with repeat_interleave K/V: {err2}"
    if err is None:
        t, err = timed(run, fn, repeats, lambda: sdpa_only(backend))
        if t is not None:
            row[f"{name}_ms"], row[f"{name}_repeats"] = t["median_ms"], t["repeats"]
    row[f"{name}_gqa"] = gqa
    if gqa.startswith("K/V repeat"):
        row["_notes"].append(f"{name}: {gqa}")
    if err is not None:
        row[f"{name}_error"] = err
        row["_notes"].append(f"{name} failed: {err}")
        print(f"  SDPA {name} failed: {_short(err, 300)}", flush=True)
        return None
    return out


def sdpa_backward(run: Run, row: dict[str, Any], name: str, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor,
                  g4: torch.Tensor, scale: float, repeats: int, deterministic: bool = False
                  ) -> tuple[torch.Tensor, ...] | None:
    """Forward once (graph retained, outside the timed region), then time ``autograd.grad`` only.
    ``deterministic``: under ``torch.use_deterministic_algorithms(True)``, recorded as ``<name>_det``."""
    backend = BACKENDS[name]
    ctx = lambda: sdpa_only(backend, deterministic)  # noqa: E731
    key = f"{name}_det" if deterministic else name
    group = q4.shape[1] // k4.shape[1]

    def forward(k_: torch.Tensor, v_: torch.Tensor, gqa: bool):
        leaves = [t.detach().requires_grad_(True) for t in (q4, k_, v_)]

        def go():
            with ctx():
                out = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=gqa)
                grads = torch.autograd.grad(out, leaves, g4, retain_graph=True)
            return out, grads
        res, err = attempt(go)
        return (None, None, None, err) if err else (res[0], leaves, res[1], None)

    out, leaves, grads, err = forward(k4, v4, group > 1)
    gqa = "enable_gqa=True" if group > 1 else "MHA"
    if err is not None and group > 1:
        kr, vr = k4.repeat_interleave(group, dim=1), v4.repeat_interleave(group, dim=1)
        out, leaves, grads, err2 = forward(kr, vr, False)
        if err2 is None:
            gqa = (f"K/V repeat_interleave x{group} outside timing; dK/dV not reduced over the group "
                   f"(enable_gqa=True rejected: {err})")
            err = None
        else:
            err = f"enable_gqa=True: {err} || with repeat_interleave K/V: {err2}"
    if err is None:
        t, err = timed(run, lambda: torch.autograd.grad(out, leaves, g4, retain_graph=True), repeats, ctx)
        if t is not None:
            row[f"{key}_ms"], row[f"{key}_repeats"] = t["median_ms"], t["repeats"]
    row[f"{key}_gqa"] = gqa
    if gqa.startswith("K/V repeat"):
        row["_notes"].append(f"{key}: {gqa}")
    if err is not None:
        row[f"{key}_error"] = err
        row["_notes"].append(f"{key} failed: {err}")
        print(f"  SDPA {key} backward failed: {_short(err, 300)}", flush=True)
        return None
    return grads


def _ratios(row: dict[str, Any], work_key: str, work: float, scale_div: float) -> None:
    """``<x>_<work_key>`` throughput for every timed side, and rlk ratios against each native side."""
    for side in ("rlk", "rlk_op", "flash", "cudnn", "flash_det"):
        ms = row.get(f"{side}_ms")
        if ms:
            row[f"{side}_{work_key}"] = work / ms / scale_div
    for native in ("flash", "cudnn", "flash_det"):
        n = row.get(f"{native}_ms")
        if n and row.get("rlk_ms"):
            row[f"ratio_vs_{native}"] = n / row["rlk_ms"]
        if n and row.get("rlk_op_ms"):
            row[f"ratio_op_vs_{native}"] = n / row["rlk_op_ms"]


def _meets(row: dict[str, Any], checks: dict[str, tuple[str, float]]) -> None:
    """``meets_<name>`` booleans for the targets whose measured value exists (JSON only)."""
    for name, (key, target) in checks.items():
        if key in row:
            row[f"meets_{name}"] = row[key] >= target


def _skip(run: Run, rows: list[dict[str, Any]], case: str) -> bool:
    if run.over_budget():
        rows.append({"case": case, "rlk_status": f"skipped: time budget {run.budget_s:.0f} s reached",
                     "notes": "skipped (time budget)"})
        print(f"{case}: skipped (time budget)", flush=True)
        return True
    return False


def _heads(model: str) -> tuple[int, int, int]:
    c = MODELS[model]
    return c["q_heads"], c["kv_heads"], c["head_dim"]


# -- sections ----------------------------------------------------------------------------------------
def prefill(run: Run, quick: bool) -> list[dict[str, Any]]:
    cases = PREFILL[: QUICK["prefill"]] if quick else PREFILL
    rows = []
    for i, (model, b, n) in enumerate(cases):
        case = f"{model} {b}x{n} causal"
        if _skip(run, rows, case):
            continue
        hq, hkv, d = _heads(model)
        reps = run.big_repeats if b * n >= 8192 else run.repeats
        t = b * n
        q = randn((t, hq, d), seed=100 * i + 1)
        k = randn((t, hkv, d), seed=100 * i + 2)
        v = randn((t, hkv, d), seed=100 * i + 3)
        cu = cu_seqlens([n] * b, "cuda")
        scale = d ** -0.5
        flop = b * 4.0 * n * (n + 1) / 2 * hq * d
        row: dict[str, Any] = {"case": case, "model": model, "B": b, "L": n, "Hq": hq, "Hkv": hkv, "D": d,
                               "flop": flop, "_notes": []}
        args = (q, k, v, cu, cu, scale, True, None)
        out = run_rlk(run, row, "attention_varlen", args, lambda args=args: attn.attention_varlen(*args[:6]), reps)
        q4, k4, v4 = (x.view(b, n, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
        ref = sdpa_forward(run, row, "flash", q4, k4, v4, scale, reps, causal=True)
        sdpa_forward(run, row, "cudnn", q4, k4, v4, scale, reps, causal=True)
        if out is not None and ref is not None:
            row["max_abs_diff_vs_flash"] = _maxdiff(out, ref.transpose(1, 2).reshape(t, hq, d))
        _ratios(row, "tflops", flop, 1e9)
        _meets(row, {"vs_flash": ("ratio_vs_flash", TARGETS["prefill_vs_flash"]),
                     "vs_cudnn": ("ratio_vs_cudnn", TARGETS["prefill_vs_cudnn"])})
        rows.append(_clean(row))
        _print(rows[-1], "tflops", "TFLOP/s")
        del q, k, v, q4, k4, v4, out, ref
        _free()
    return rows


def decode(run: Run, quick: bool, copy_tbs: float) -> list[dict[str, Any]]:
    cases = DECODE[: QUICK["decode"]] if quick else DECODE
    pages = DECODE_PAGES[: QUICK["decode_pages"]] if quick else DECODE_PAGES
    hq, hkv, d = _heads("qwen3-8b")
    scale = d ** -0.5
    rows = []
    for i, (b, n) in enumerate(cases):
        case = f"qwen3-8b decode {b}x{n}"
        if _skip(run, rows, case):
            continue
        q = randn((b, hq, d), seed=1000 + 10 * i)
        kc = randn((b, n, hkv, d), seed=1001 + 10 * i)
        vc = randn((b, n, hkv, d), seed=1002 + 10 * i)
        kv_bytes = 2.0 * b * n * hkv * d * kc.element_size()
        native: dict[str, Any] = {"_notes": [], "case": case}
        ref = sdpa_forward(run, native, "flash", q.view(b, hq, 1, d), kc.transpose(1, 2), vc.transpose(1, 2), scale,
                           run.repeats)
        for page in pages:
            row: dict[str, Any] = {"case": case, "B": b, "context": n, "page_size": page, "Hq": hq, "Hkv": hkv,
                                   "D": d, "kv_bytes": kv_bytes, "_notes": list(native["_notes"])}
            row.update({key: val for key, val in native.items() if key.startswith("flash")})
            cache, err = attempt(lambda page=page, i=i, kc=kc, vc=vc: build_paged_kv(
                list(kc.unbind(0)), list(vc.unbind(0)), page,
                generator=torch.Generator().manual_seed(2000 + i), write=kv_cache_write_reference))
            if err is not None:
                rlk_error(run, row, f"building the paged cache (page {page})", err)
            else:
                args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, scale)
                out = run_rlk(run, row, "attention_decode", args,
                              lambda args=args: attn.attention_decode(*args), run.repeats)
                if out is not None and ref is not None:
                    row["max_abs_diff_vs_flash"] = _maxdiff(out, ref.view(b, hq, d))
                del cache, args, out
            _ratios(row, "tbs", kv_bytes, 1e9)
            for side in ("rlk", "rlk_op", "flash"):
                if f"{side}_tbs" in row:
                    row[f"{side}_of_copy"] = row[f"{side}_tbs"] / copy_tbs
            _meets(row, {"vs_flash_bw": ("ratio_vs_flash", TARGETS["decode_vs_flash_bw"]),
                         "of_copy": ("rlk_of_copy", TARGETS["decode_of_copy"])})
            rows.append(_clean(row))
            _print(rows[-1], "tbs", "TB/s KV read")
            _free()
        del q, kc, vc, ref
        _free()
    return rows


def backward(run: Run, quick: bool) -> list[dict[str, Any]]:
    cases = BACKWARD[: QUICK["backward"]] if quick else BACKWARD
    hq, hkv, d = _heads("qwen3-8b")
    scale = d ** -0.5
    rows = []
    for i, n in enumerate(cases):
        case = f"qwen3-8b 1x{n} causal backward"
        if _skip(run, rows, case):
            continue
        reps = run.big_repeats
        q = randn((n, hq, d), seed=3000 + 10 * i)
        k = randn((n, hkv, d), seed=3001 + 10 * i)
        v = randn((n, hkv, d), seed=3002 + 10 * i)
        g = randn((n, hq, d), seed=3003 + 10 * i)
        cu = cu_seqlens([n], "cuda")
        flop = 10.0 * n * (n + 1) / 2 * hq * d
        row: dict[str, Any] = {"case": case, "B": 1, "L": n, "Hq": hq, "Hkv": hkv, "D": d, "flop": flop,
                               "_notes": []}
        fwd_backend, _, fwd_err = select_backend("attention_varlen", (q, k, v, cu, cu, scale, True, None))
        row["rlk_forward_backend"] = fwd_backend.id if fwd_backend is not None else "none"
        grads = None
        if fwd_err is not None:
            rlk_error(run, row, "attention_varlen forward (graph for backward)", fwd_err)
        elif fwd_backend.id == REFERENCE_ID:
            row.update(rlk_backend=f"{REFERENCE_ID} (forward)", rlk_status=NOT_TIMED)
            row["_notes"].append(f"rlk: {NOT_TIMED} (forward)")
            run.not_timed.append(case)
        else:
            # the rlk graph: forward through the public op once, outside the timed region, retained
            leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
            out, err = attempt(lambda leaves=leaves, cu=cu: attn.attention_varlen(*leaves, cu, cu, scale))
            if err is not None:
                rlk_error(run, row, "attention_varlen forward (graph for backward)", err)
            else:
                grads = run_rlk(run, row, "attention_varlen_backward", (g, q, k, v, cu, cu, scale, True, None),
                                lambda out=out, leaves=leaves, g=g: torch.autograd.grad(out, leaves, g,
                                                                                       retain_graph=True), reps)
            del leaves, out
        if "rlk_op_ms" in row:  # the op path of this section is the autograd call
            row["rlk_autograd_ms"] = row["rlk_op_ms"]
        q4, k4, v4, g4 = (x.view(1, n, x.shape[1], d).transpose(1, 2) for x in (q, k, v, g))
        ref = sdpa_backward(run, row, "flash", q4, k4, v4, g4, scale, reps)
        sdpa_backward(run, row, "cudnn", q4, k4, v4, g4, scale, reps)
        sdpa_backward(run, row, "flash", q4, k4, v4, g4, scale, reps, deterministic=True)
        if grads is not None and ref is not None and ref[1].shape[1] == hkv:
            row["max_abs_diff_vs_flash"] = max(
                _maxdiff(a, r.transpose(1, 2).reshape(a.shape)) for a, r in zip(grads, ref, strict=True))
        _ratios(row, "tflops", flop, 1e9)
        _meets(row, {"vs_flash": ("ratio_vs_flash", TARGETS["backward_vs_flash"])})
        rows.append(_clean(row))
        _print(rows[-1], "tflops", "TFLOP/s")
        del q, k, v, g, q4, k4, v4, g4, grads, ref
        _free()
    return rows


def chunked(run: Run, quick: bool) -> list[dict[str, Any]]:
    cases = CHUNKED[: QUICK["chunked"]] if quick else CHUNKED
    page = CHUNKED_PAGE
    hq, hkv, d = _heads("qwen3-8b")
    scale = d ** -0.5
    rows = []
    for i, (b, prefix, c) in enumerate(cases):
        case = f"qwen3-8b chunk {b}x{c} over prefix {prefix}"
        if _skip(run, rows, case):
            continue
        n = prefix + c
        q = randn((b * c, hq, d), seed=4000 + 10 * i)
        kc = randn((b, n, hkv, d), seed=4001 + 10 * i)
        vc = randn((b, n, hkv, d), seed=4002 + 10 * i)
        pairs = c * prefix + c * (c + 1) / 2
        flop = 4.0 * hq * d * b * pairs
        row: dict[str, Any] = {"case": case, "B": b, "prefix": prefix, "chunk": c, "page_size": page, "Hq": hq,
                               "Hkv": hkv, "D": d, "flop": flop, "_notes": []}
        cu_q = cu_seqlens([c] * b, "cuda")
        cache, err = attempt(lambda i=i, kc=kc, vc=vc: build_paged_kv(
            list(kc.unbind(0)), list(vc.unbind(0)), page,
            generator=torch.Generator().manual_seed(5000 + i), write=kv_cache_write_reference))
        out = None
        if err is not None:
            rlk_error(run, row, "building the paged cache", err)
        else:
            args = (q, cache.k_cache, cache.v_cache, cache.block_table, cu_q, cache.seq_lens, scale)
            out = run_rlk(run, row, "attention_paged_prefill", args,
                          lambda args=args: attn.attention_paged_prefill(*args), run.repeats)
        # rlk varlen on contiguous K/V (bottom-right aligned by default): the cost of paging
        kp, vp = kc.view(b * n, hkv, d), vc.view(b * n, hkv, d)
        cu_k = cu_seqlens([n] * b, "cuda")
        vargs = (q, kp, vp, cu_q, cu_k, scale, True, None)
        run_rlk(run, row, "attention_varlen", vargs, lambda vargs=vargs: attn.attention_varlen(*vargs[:6]),
                run.repeats, prefix="rlk_varlen")
        mask = causal_lower_right(c, n)
        ref = sdpa_forward(run, row, "flash", q.view(b, c, hq, d).transpose(1, 2), kc.transpose(1, 2),
                           vc.transpose(1, 2), scale, run.repeats, lower_right=mask)
        if out is not None and ref is not None:
            row["max_abs_diff_vs_flash"] = _maxdiff(out, ref.transpose(1, 2).reshape(b * c, hq, d))
        _ratios(row, "tflops", flop, 1e9)
        if row.get("rlk_varlen_ms"):
            row["rlk_varlen_tflops"] = flop / row["rlk_varlen_ms"] / 1e9
            if row.get("rlk_ms"):
                row["paged_over_varlen"] = row["rlk_ms"] / row["rlk_varlen_ms"]
        rows.append(_clean(row))
        _print(rows[-1], "tflops", "TFLOP/s")
        del q, kc, vc, kp, vp, cache, out, ref
        _free()
    return rows


def _print(r: dict[str, Any], key: str, unit: str) -> None:
    def f(side: str) -> str:
        ms = r.get(f"{side}_ms")
        return f"{ms:.4f} ms ({r.get(f'{side}_{key}', 0.0):.1f} {unit})" if ms else "-"

    extra = f" page {r['page_size']}" if "page_size" in r else ""
    print(f"{r['case']}{extra}: rlk[{r.get('rlk_backend', '?')}] {f('rlk')} op {f('rlk_op')} | flash {f('flash')} "
          f"| cudnn {f('cudnn')} | ratio vs flash {r.get('ratio_vs_flash', float('nan')):.2f} "
          f"vs cudnn {r.get('ratio_vs_cudnn', float('nan')):.2f}"
          + (f" | {r['notes']}" if r.get("notes") else ""), flush=True)


COMMON_META = {
    "ratio": "native_ms / rlk_ms (>= 1: rlk faster); ratio_op_* uses rlk_op_ms (public op, incl. validation)",
    "rlk_ms": "selected backend's function called directly with the op's arguments (device time)",
    "rlk_op_ms": "public rlk_core.ops.attention op; its value checks sync to the host inside the events",
    "layout": "SDPA gets [B,H,L,D] transpose(1,2) views of the [B,L,H,D] memory rlk reads as [T,H,D]",
    "gqa": "enable_gqa=True; a backend rejecting it gets K/V repeat_interleave'd outside timing (noted per row)",
    "baselines": "each SDPA baseline runs under sdpa_kernel(<that one backend>); failures recorded, not replaced",
    "dtype": "bfloat16, scale = D ** -0.5, inputs randn from torch.Generator seeds (tests/gpu/_shapes.randn)",
    "targets": TARGETS,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer cases and repeats (target < 40 s on an H200)")
    ap.add_argument("--sections", default="prefill,decode,backward,chunked",
                    help="comma-separated subset of prefill,decode,backward,chunked")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls per measurement (default 20, quick 10)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip (and record as skipped) cases starting after this many seconds; 0 = no limit "
                         "(default 105, quick 34)")
    args = ap.parse_args()
    if args.repeats is None:
        args.repeats = 10 if args.quick else 20
    if args.budget_s is None:
        args.budget_s = 34.0 if args.quick else 105.0
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"prefill", "decode", "backward", "chunked"}
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}")
    if not torch.cuda.is_available():
        print("bench_attention: no CUDA device", file=sys.stderr)
        return 2
    run = Run(args)
    env = environment()
    copy = copy_bandwidth()
    print(f"{env['gpu']} torch {env['torch']} triton {env['triton']}; copy {copy['tb_per_s']:.2f} TB/s", flush=True)
    out_dir = default_out_dir()
    reps_note = f"{args.repeats} ({run.big_repeats} for >= 8192 tokens and backward; fewer if a case hits its cap)"
    base = {"env": env, "copy": copy, "repeats": reps_note, "quick": args.quick, **COMMON_META}
    for section in sections:
        print(f"== {section} ({run.elapsed():.0f} s)", flush=True)
        try:
            if section == "prefill":
                rows = prefill(run, args.quick)
                cols = [("case", "case"), ("rlk_backend", "rlk backend"), ("rlk_ms", "rlk ms"),
                        ("rlk_op_ms", "rlk op ms"), ("flash_ms", "flash ms"), ("cudnn_ms", "cuDNN ms"),
                        ("rlk_tflops", "rlk TFLOP/s"), ("flash_tflops", "flash TFLOP/s"),
                        ("cudnn_tflops", "cuDNN TFLOP/s"), ("ratio_vs_flash", "vs flash"),
                        ("ratio_vs_cudnn", "vs cuDNN"), ("notes", "notes")]
                meta = {**base, "flop": FLOPS_NOTE["prefill"]}
            elif section == "decode":
                rows = decode(run, args.quick, copy["tb_per_s"])
                cols = [("case", "case"), ("page_size", "page"), ("rlk_backend", "rlk backend"), ("rlk_ms", "rlk ms"),
                        ("rlk_op_ms", "rlk op ms"), ("flash_ms", "flash ms"), ("rlk_tbs", "rlk TB/s"),
                        ("flash_tbs", "flash TB/s"), ("rlk_of_copy", "rlk / copy"), ("flash_of_copy", "flash / copy"),
                        ("ratio_vs_flash", "vs flash"), ("notes", "notes")]
                meta = {**base, "bandwidth": FLOPS_NOTE["decode"],
                        "native": "SDPA flash, q [B,Hq,1,D] vs contiguous K/V [B,Hkv,L,D] views, non-causal; "
                                  "measured once per case, repeated on each page-size row",
                        "cache": "build_paged_kv: vLLM-layout non-contiguous K/V views, shuffled pages, NaN spares"}
            elif section == "backward":
                rows = backward(run, args.quick)
                cols = [("case", "case"), ("rlk_backend", "rlk backend"), ("rlk_ms", "rlk ms"),
                        ("rlk_autograd_ms", "rlk autograd ms"), ("flash_ms", "flash ms"),
                        ("flash_det_ms", "flash det. ms"), ("cudnn_ms", "cuDNN ms"),
                        ("rlk_tflops", "rlk TFLOP/s"), ("flash_tflops", "flash TFLOP/s"),
                        ("ratio_vs_flash", "vs flash"), ("ratio_op_vs_flash", "autograd vs flash"),
                        ("ratio_vs_flash_det", "vs flash det."), ("ratio_vs_cudnn", "vs cuDNN"),
                        ("notes", "notes")]
                meta = {**base, "flop": FLOPS_NOTE["backward"],
                        "flash_det": "SDPA flash backward under torch.use_deterministic_algorithms(True) (extra "
                                     "baseline: FA2 without atomic dQ accumulation); target is vs plain flash",
                        "timing": "forward once outside the events with the graph retained; SDPA and the rlk "
                                  "autograd path time torch.autograd.grad(out, (q,k,v), grad, retain_graph=True); "
                                  "rlk_ms calls the attention_varlen_backward backend directly (what the "
                                  "autograd node runs, minus validation)"}
            else:
                rows = chunked(run, args.quick)
                cols = [("case", "case"), ("rlk_backend", "rlk backend"), ("rlk_ms", "rlk ms"),
                        ("rlk_op_ms", "rlk op ms"), ("rlk_varlen_ms", "rlk varlen (contig) ms"),
                        ("flash_ms", "flash ms"), ("rlk_tflops", "rlk TFLOP/s"), ("flash_tflops", "flash TFLOP/s"),
                        ("ratio_vs_flash", "vs flash"), ("paged_over_varlen", "paged / varlen"),
                        ("notes", "notes")]
                meta = {**base, "flop": FLOPS_NOTE["chunked"],
                        "native": "SDPA flash on contiguous K/V with attn_mask=causal_lower_right(Lq, Lk) "
                                  "(FA2's bottom-right causal mode); rlk_varlen = attention_varlen on the same "
                                  "contiguous K/V"}
        except Exception as exc:  # a bug in this script, not in rlk: record it and go on
            traceback.print_exc()
            rows, cols, meta = [{"case": section, "notes": _short(f"bench crashed: {_err(exc)}", 400)}], \
                [("case", "case"), ("notes", "notes")], dict(base)
            run.rlk_errors.append(f"{section}: bench crashed: {_err(exc)}")
        write_results(out_dir, f"attention_{section}", meta, rows, cols)
    print(f"done in {run.elapsed():.0f} s; results in {out_dir}", flush=True)
    if run.not_timed:
        print(f"{len(run.not_timed)} rlk case(s) not timed (reference backend selected):", *run.not_timed,
              sep="\n  ", flush=True)
    if run.rlk_errors:
        print(f"{len(run.rlk_errors)} rlk error(s):", *run.rlk_errors, sep="\n  ", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
