"""Configuration sweep for the rlk.triton GEMM and attention kernels: candidate tile configurations
timed against the native op in the same process, each one's output checked bit for bit against the
contract configuration's output for the same rows (a candidate that changes a bit is unusable).
``backward`` (attention dQ/dK/dV, where only run-to-run determinism and tolerance are required):
each candidate's relative error against the shipped configuration and a repeat-equality check.

    python benchmarks/sweep_kernels.py [--sections linear,linear_mid,linear_tail,linear_split,linear_pdl,
                                                  prefill,decode,backward]
                                       [--old-attention PATH] [--shapes 8b/qkv,...] [--repeats N]

Writes ``sweep_<section>.json`` to ``$RLK_BENCH_OUT``. Exploration only: what ships is the GEMM's tile rule
(``rlk_core/ops/linear/tiles.py``) and the attention modules' ``CONFIGS``. Every candidate is the op's own launch
plan (``rlk_core/ops/<op>/triton.py``) run by the GPU's JIT plan with the candidate's configuration in place of the
shipped one (the functions ``*_variants`` / ``split_cfgs`` build them for any plan: the CPU tests run them on the AOT
build's enumerating plan). ``--old-attention`` times a previous version of ``rlk_core/ops/attention/triton.py`` (a
file path) beside the current one: a launch-plan version (``attention_varlen(p, ...)``; the modules from before the
plans import ``rlk_core.ops._triton_common``, which is gone).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
from harness import copy_bandwidth, default_out_dir, environment, require_cuda, results_json, time_fns
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlk_core.ops._plan import jit_plan
from rlk_core.ops.attention import triton as at
from rlk_core.ops.attention import triton_backward as ab
from rlk_core.ops.attention.reference import kv_cache_write_reference
from rlk_core.ops.linear import tiles as rule
from rlk_core.ops.linear import triton as lt
from rlk_core.testing.attention import build_paged_kv, cu_seqlens

BF16 = torch.bfloat16
LINEAR_SHAPES = {  # name -> (N, K)
    "8b/qkv": (6144, 4096), "8b/o": (4096, 4096), "8b/gate_up": (24576, 4096), "8b/down": (4096, 12288),
    "8b-tp4/qkv": (1536, 4096), "8b-tp4/down": (4096, 3072), "0.6b/qkv": (4096, 1024), "0.6b/o": (1024, 2048),
    "0.6b/gate_up": (6144, 1024), "0.6b/down": (1024, 3072), "8b/lm_head": (151936, 4096),
}
SMALL_MS, LARGE_MS = (1, 16, 64, 128), (1024, 8192)


def _named(*tiles: tuple) -> dict[str, tuple]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages, TMA[, TAIL_M])`` tiles keyed like
    ``t128x256x64w8s3`` or ``t64+16x32x256w4s3`` (``t``: TMA kernel, ``p``: pointer kernel)."""
    return {("t" if t[6] else "p") + f"{t[0]}{f'+{t[7]}' if len(t) > 7 else ''}x{t[1]}x{t[2]}w{t[4]}s{t[5]}": t
            for t in tiles}


SMALL_CANDIDATES = _named(
    (128, 128, 64, 8, 8, 4, False), (16, 64, 128, 8, 4, 4, False), (16, 64, 256, 8, 4, 3, False),
    (16, 32, 256, 8, 4, 4, False), (16, 32, 128, 8, 4, 6, False), (32, 64, 128, 8, 4, 4, False),
    (64, 64, 128, 8, 4, 4, False), (64, 32, 128, 8, 4, 5, False), (16, 128, 128, 8, 4, 4, False),
    (64, 64, 128, 8, 4, 4, True), (64, 32, 256, 8, 4, 4, True), (64, 128, 64, 8, 4, 5, True),
)
LARGE_CANDIDATES = _named(
    (128, 128, 64, 8, 8, 4, False), (128, 128, 64, 8, 8, 3, False), (128, 256, 64, 8, 8, 3, False),
    (128, 128, 64, 8, 8, 3, True), (128, 128, 64, 8, 8, 4, True), (128, 256, 64, 8, 8, 3, True),
    (128, 128, 128, 8, 8, 3, True), (128, 256, 64, 8, 8, 4, True),
)
MID_SHAPES = ("8b/qkv", "8b/gate_up", "8b/down", "8b-tp4/qkv", "0.6b/o", "0.6b/gate_up", "0.6b/down", "8b/lm_head")
MID_MS = (65, 96, 128, 256, 512, 1000)
MID_CANDIDATES = _named(
    (64, 32, 256, 8, 4, 4, True), (64, 64, 128, 8, 4, 4, True), (64, 128, 64, 8, 4, 5, True),
    (64, 256, 64, 8, 4, 3, True), (128, 32, 128, 8, 8, 4, True), (128, 64, 128, 8, 8, 4, True),
    (128, 128, 64, 8, 8, 4, True), (128, 256, 64, 8, 8, 3, True),
)
# 64 < M <= 80: 64-row tiles with a 16-row tail (one row tile) against the 64- and 128-row tiles
TAIL_MS = (65, 72, 80)
TAIL_CANDIDATES = _named(
    (64, 128, 64, 8, 4, 5, True, 16), (64, 64, 128, 8, 4, 4, True, 16), (64, 32, 256, 8, 4, 3, True, 16),
    (64, 32, 128, 8, 4, 4, True, 16), (64, 64, 64, 8, 4, 5, True, 16),
    (64, 128, 64, 8, 4, 5, True), (64, 64, 128, 8, 4, 4, True), (64, 32, 256, 8, 4, 4, True),
    (128, 64, 128, 8, 8, 4, True), (128, 32, 128, 8, 8, 4, True),
)
# linear_split: (a) M <= 128: the shipped rule with and without the last row block's smaller TMA box (a box
# mostly past M is slow to zero-fill), and 64-row tiles with that box against the 64+16 tail tiles at 65..80;
# (b) M > 128: the shipped rule (a row split where estimated faster) against the best single tile, and
# with / without the smaller last box (which also turns off the persistent loop's flattening)
SPLIT_SHAPES = {**LINEAR_SHAPES, "8b-tp2/qkv": (3072, 4096), "8b-tp2/gate_up": (12288, 4096),
                "0.6b-tp2/qkv": (2048, 1024), "0.6b-tp2/down": (1024, 1536)}
SPLIT_SMALL_MS = (17, 20, 33, 40, 63, 65, 72, 80, 96, 100, 127)
SPLIT_LARGE_MS = (1000, 2048, 3000, 4000, 4096, 4136, 6000, 8192)
SPLIT_TAIL_CANDIDATES = _named((64, 32, 256, 8, 4, 4, True), (64, 64, 128, 8, 4, 4, True),
                               (64, 128, 64, 8, 4, 5, True), (128, 64, 128, 8, 8, 4, True))
# linear_pdl: wherever a row split is possible (split_candidate), whether the rule takes it or not: the split
# with its second launch by programmatic dependent launch (as shipped), the same two launches one after the
# other, and the best single tile — the data for SPLIT_GAP_K
# prefill: (BLOCK_M, warps, stages, KV_TMA) — KV_TMA: unmasked K/V blocks by TMA descriptor (varlen only)
PREFILL_CANDIDATES = {"128w8s3": (128, 8, 3, False), "128w8s3tma": (128, 8, 3, True), "128w4s3tma": (128, 4, 3, True),
                      "64w4s2tma": (64, 4, 2, True), "64w4s3tma": (64, 4, 3, True), "64w4s4tma": (64, 4, 4, True),
                      "256w8s2tma": (256, 8, 2, True), "256w8s3tma": (256, 8, 3, True),
                      "256w16s2tma": (256, 16, 2, True)}
# backward: kernel -> launch-argument overrides of ab.config(); kernels not named keep the shipped entry
def _bt(bm: int, bn: int, warps: int, stages: int, **extra) -> dict[str, int | bool]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, **extra}


BACKWARD_CANDIDATES = {
    "pointer_loads": {"stats": {"KV_TMA": False}, "dq": {"KV_TMA": False}},
    "kvhead": {"dkdv": {"SPLIT_G": False}},
    "split64x64w4s3": {"dkdv": _bt(64, 64, 4, 3)},
    "split64x128w8s2": {"dkdv": _bt(64, 128, 8, 2)},
    "dq64x64w4s3": {"dq": _bt(64, 64, 4, 3)},
    "dq128x64w8s2": {"dq": _bt(128, 64, 8, 2)},
    "stats64x64w4s3": {"stats": _bt(64, 64, 4, 3)},
    "stats128x64w8s4": {"stats": _bt(128, 64, 8, 4)},
}
DECODE_CANDIDATES = {"64w4s2": (64, 4, 2), "64w4s3": (64, 4, 3), "16w4s3": (16, 4, 3), "16w4s4": (16, 4, 4),
                     "32w4s3": (32, 4, 3), "16w2s3": (16, 2, 3)}


def _try(fn):
    try:
        return fn(), None
    except Exception as exc:  # a candidate that does not compile is a result
        return None, f"{type(exc).__name__}: {str(exc)[:200]}"

def _run_variants(row: dict[str, Any], variants: dict[str, Any], ref: torch.Tensor, repeats: int, metrics) -> None:
    """Time each variant and check its bits against ``ref``; ``metrics(ms)`` adds the throughput fields.
    A variant that fails (e.g. does not compile) is recorded with its error."""
    for cname, fn in variants.items():
        y, err = _try(fn)
        if err:
            row[cname] = {"error": err}
            continue
        ms_ = time_fns([fn], repeats=repeats)["median_ms"]
        row[cname] = {"ms": ms_, **metrics(ms_), "bitwise": bool(torch.equal(y, ref))}


def _ratios(row: dict[str, Any], names) -> str:
    """``name=ratio`` per variant of a row (``!BITS`` where its output differed, ``ERR`` where it failed)."""
    return " ".join(f"{c}={row[c]['ratio']:.3f}{'' if row[c]['bitwise'] else '!BITS'}" if "ms" in row[c]
                    else f"{c}=ERR {row[c]['error'][:80]}" for c in names)


def gemm(p, x: torch.Tensor, w: torch.Tensor, cfg: dict[str, Any] | None = None) -> torch.Tensor:
    """``x [M, K] @ w[N, K]^T`` into a fresh ``[M, N]``: ``linear``'s launch plan (``lt.into``) run by ``p``, with the
    tile configuration ``cfg`` (None: the shipped rule)."""
    return lt.into(p, x, w, None, p.new((x.shape[0], w.shape[0]), x.dtype), cfg)


def tile_cfgs(candidates: dict[str, tuple], k: int) -> dict[str, dict[str, Any]]:
    """The launch configuration of each named candidate tile (``_named``) for reduction length ``k``."""
    return {cname: rule.tile_config(t[:6] + t[7:], k, tma=t[6]) for cname, t in candidates.items()}


def sweep_linear(p, repeats: int, mid: bool = False, tail: bool = False, shapes: set[str] | None = None
                 ) -> list[dict[str, Any]]:
    """All shapes (or ``shapes``) at decode-sized and training-sized M; ``mid``: the shapes and M between
    (65..1000); ``tail``: every shape at 64 < M <= 80, tail tiles against the 64- and 128-row ones."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name, (n, k) in LINEAR_SHAPES.items():
        if (mid and name not in MID_SHAPES) or (shapes and name not in shapes):
            continue
        ms = TAIL_MS if tail else (MID_MS if mid else SMALL_MS + LARGE_MS)
        if name.endswith("lm_head"):
            ms = tuple(m for m in ms if m <= 1024)
        cands = TAIL_CANDIDATES if tail else (MID_CANDIDATES if mid else None)
        rows += _linear_shape(p, name, n, k, g, repeats, ms, cands)
        torch.cuda.empty_cache()
    return rows


def _linear_shape(p, name: str, n: int, k: int, g: torch.Generator, repeats: int, ms: tuple[int, ...],
                  candidates: dict[str, tuple] | None) -> list[dict[str, Any]]:
    rows = []
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(BF16)
    x = torch.randn(max(ms), k, device="cuda", generator=g).to(BF16)
    big = gemm(p, x, w)  # the contract configuration at the largest M
    for m in ms:
        xs = x[:m].clone()
        row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k}
        row["native_ms"] = time_fns([lambda xs=xs: F.linear(xs, w)], repeats=repeats)["median_ms"]
        cands = candidates or (SMALL_CANDIDATES if m <= 128 else LARGE_CANDIDATES)
        variants = {cname: (lambda cfg=cfg, xs=xs: gemm(p, xs, w, cfg)) for cname, cfg in tile_cfgs(cands, k).items()}
        _run_variants(row, variants, big[:m], repeats, lambda ms_, row=row: {"ratio": row["native_ms"] / ms_})
        rows.append(row)
        best = max((c for c in cands if "ms" in row.get(c, {})), key=lambda c: row[c]["ratio"], default=None)
        print(f"linear {name} M={m}: native {row['native_ms']:.4f} ms; best {best} "
              + (f"{row[best]['ratio']:.3f}" if best else "-") + "; "
              + " ".join(f"{c}={row[c]['ratio']:.2f}{'' if row[c]['bitwise'] else '!BITS'}"
                         if "ms" in row[c] else f"{c}=ERR" for c in cands), flush=True)
    return rows


def sweep_linear_split(p, repeats: int, pdl: bool = False, shapes: set[str] | None = None) -> list[dict[str, Any]]:
    """``linear_split`` (``pdl``: ``linear_pdl``) over SPLIT_SHAPES (or ``shapes``)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows: list[dict[str, Any]] = []
    for name, (n, k) in SPLIT_SHAPES.items():
        if shapes and name not in shapes:
            continue
        rows += (_pdl_shape if pdl else _split_shape)(p, name, n, k, g, repeats)
        torch.cuda.empty_cache()
    return rows


def split_cfgs(p, x: torch.Tensor, w: torch.Tensor) -> dict[str, dict[str, Any]]:
    """``linear_split``'s configurations of ``x [M, K] @ w[N, K]^T`` on ``p``'s device: the shipped rule's
    (``shipped``, as ``linear`` decides it: ``lt._rule``); the same with the full last-row box where the rule shrinks
    it (``shipped_full_box``); the best single tile where the rule splits the rows (``single``); at 64 < M <= 80 the
    64-row tiles (with the smaller last box) and the 64+16 tail tiles."""
    m, k = x.shape
    n = w.shape[0]
    shipped = lt._rule(p, x, w, p.new((m, n), x.dtype))
    cfgs = {"shipped": shipped}
    if shipped["TMA"] and not shipped["TAIL_M"] and rule.rem_rows(m, shipped["BLOCK_M"]):
        cfgs["shipped_full_box"] = dict(shipped, REM_BOX=False)
    if "SPLIT_ROWS" in shipped:
        cfgs["single"] = rule.tile_config(rule.single_tile(m, n, k, p.sms)[0], k, tma=True)
    if 64 < m <= 80:
        cfgs.update({c: rule.tile_config(t[:6], k, tma=True) for c, t in SPLIT_TAIL_CANDIDATES.items()})
        cfgs.update(tile_cfgs({c: t for c, t in TAIL_CANDIDATES.items() if len(t) > 7}, k))
    return cfgs


def _split_shape(p, name: str, n: int, k: int, g: torch.Generator, repeats: int) -> list[dict[str, Any]]:
    ms = SPLIT_SMALL_MS + (() if name.endswith("lm_head") else SPLIT_LARGE_MS)
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(BF16)
    x = torch.randn(max(ms), k, device="cuda", generator=g).to(BF16)
    big = gemm(p, x, w)
    rows = []
    for m in ms:
        xs = x[:m].clone()
        cfgs = split_cfgs(p, xs, w)
        shipped = cfgs["shipped"]
        row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k, "shipped_cfg": {
            key: v for key, v in shipped.items() if key != "REST"}, "rest_cfg": shipped.get("REST")}
        row["native_ms"] = time_fns([lambda xs=xs: F.linear(xs, w)], repeats=repeats)["median_ms"]
        variants = {c: (lambda cfg=cfg, xs=xs: gemm(p, xs, w, cfg)) for c, cfg in cfgs.items()}
        _run_variants(row, variants, big[:m], repeats, lambda ms_, row=row: {"ratio": row["native_ms"] / ms_})
        rows.append(row)
        tile = "x".join(str(shipped[key]) for key in ("BLOCK_M", "BLOCK_N", "BLOCK_K")) + (
            f"|{shipped['SPLIT_ROWS']}|{shipped['REST']['BLOCK_N']}" if "SPLIT_ROWS" in shipped else "")
        print(f"linear_split {name} M={m} [{tile}]: native {row['native_ms']:.4f} ms; {_ratios(row, variants)}",
              flush=True)
    return rows


def pdl_variants(p, x: torch.Tensor, w: torch.Tensor, split_rows: int, rest_cfg: dict[str, Any]
                 ) -> dict[str, Callable[[], torch.Tensor]]:
    """``linear_pdl``'s three ways of one row split of ``x @ w^T`` (the first ``split_rows`` rows by 128x256 tiles,
    the rest by ``rest_cfg``) on ``p``: the plan's split, its second launch by programmatic dependent launch
    (``split_pdl``, as shipped); the same two launches one after the other (``split_serial``); the best single tile
    (``single``)."""
    m, k = x.shape
    n = w.shape[0]
    big = rule.tile_config(rule._LARGE_TMA[0][0], k, tma=True)
    single = rule.tile_config(rule.single_tile(m, n, k, p.sms)[0], k, tma=True)
    split = dict(big, SPLIT_ROWS=split_rows, REST=rest_cfg)

    def serial() -> torch.Tensor:
        y = p.new((m, n), x.dtype)
        lt._launch(p, x[:split_rows], w, None, y[:split_rows], big)
        lt._launch(p, x[split_rows:], w, None, y[split_rows:], rest_cfg)
        return y

    return {"split_pdl": lambda: gemm(p, x, w, split), "split_serial": serial, "single": lambda: gemm(p, x, w, single)}


def _pdl_shape(p, name: str, n: int, k: int, g: torch.Generator, repeats: int) -> list[dict[str, Any]]:
    if name.endswith("lm_head"):
        return []
    w = (torch.randn(n, k, device="cuda", generator=g) * k ** -0.5).to(BF16)
    rows = []
    for m in SPLIT_LARGE_MS:
        split_rows, rest = rule.split_candidate(m, n, k, p.sms)
        if not split_rows:
            continue
        x = torch.randn(m, k, device="cuda", generator=g).to(BF16)
        rest_cfg = rule.tile_config(rest[0], k, tma=True)
        splits = "SPLIT_ROWS" in rule.config(BF16, m, n, k, True, p.sms)
        row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k, "split_rows": split_rows,
                               "rest_cfg": rest_cfg, "shipped_splits": splits}
        row["native_ms"] = time_fns([lambda x=x: F.linear(x, w)], repeats=repeats)["median_ms"]
        variants = pdl_variants(p, x, w, split_rows, rest_cfg)
        _run_variants(row, variants, gemm(p, x, w), repeats,
                      lambda ms_, row=row: {"ratio": row["native_ms"] / ms_})
        rows.append(row)
        print(f"linear_pdl {name} M={m} split {split_rows}|{rest_cfg['BLOCK_N']} shipped_splits={splits}: "
              + _ratios(row, variants), flush=True)
    return rows


def _old_module(path: str | None):
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("old_attention_triton", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prefill_variants(p, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, scale: float
                     ) -> dict[str, Callable[[], torch.Tensor]]:
    """``prefill``'s candidates on ``p``: ``attention_varlen``'s launch (causal, no positions, ``cu`` the cumulative
    lengths of queries and keys) with each PREFILL_CANDIDATES entry in place of the shipped configuration."""
    d = q.shape[-1]
    ks = (k.stride(0), k.stride(0), k.stride(1), k.stride(2))
    vs = (v.stride(0), v.stride(0), v.stride(1), v.stride(2))
    variants = {}
    for cname, (bm, w, s, tma) in PREFILL_CANDIDATES.items():
        cfg = dict(at.config(q.dtype, d), BLOCK_M=bm, num_warps=w, num_stages=s, KV_TMA=tma)
        variants[cname] = lambda cfg=cfg: at._launch(p, q, k, v, cu, 1, 0, ks, vs, cu, cu.shape[0] - 1, None, None,
                                                     True, scale, "prefill", cfg)
    return variants


def decode_variants(p, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, cu_q: torch.Tensor) -> dict[str, Callable[[], torch.Tensor]]:
    """``decode``'s candidates on ``p``: ``attention_decode``'s launch (paged, one query token per sequence, ``cu_q``
    its query offsets ``0..B``) with each DECODE_CANDIDATES entry in place of the shipped configuration."""
    b, d = q.shape[0], q.shape[-1]
    variants = {}
    for cname, (bm, w, s) in DECODE_CANDIDATES.items():
        cfg = dict(at.config(q.dtype, d, "decode"), BLOCK_M=bm, num_warps=w, num_stages=s)
        variants[cname] = lambda cfg=cfg: at._launch(
            p, q, k_cache, v_cache, block_table, block_table.stride(0), k_cache.shape[1], tuple(k_cache.stride()),
            tuple(v_cache.stride()), cu_q, b, seq_lens, None, True, scale, "decode", cfg)
    return variants


def sweep_prefill(p, repeats: int, old) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for b, n in ((1, 2048), (4, 2048), (1, 8192)):
        rows.append(_prefill_case(p, b, n, g, repeats, old))
        torch.cuda.empty_cache()
    return rows


def _prefill_case(p, b: int, n: int, g: torch.Generator, repeats: int, old) -> dict[str, Any]:
    hq, hkv, d = 32, 8, 128
    t = b * n
    q, k, v = (torch.randn(t, h, d, device="cuda", generator=g).to(BF16) for h in (hq, hkv, hkv))
    cu = cu_seqlens([n] * b, "cuda")
    scale = d ** -0.5
    flop = b * 4.0 * n * (n + 1) / 2 * hq * d
    row: dict[str, Any] = {"case": f"{b}x{n}", "flop": flop}
    q4, k4, v4 = (x.view(b, n, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
    for bname, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        def sd(backend=backend):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True)
        _, err = _try(sd)
        row[bname] = {"error": err} if err else {"ms": time_fns([sd], repeats=repeats)["median_ms"]}
    ref = at.attention_varlen(p, q, k, v, cu, cu, scale, True, None)
    variants = prefill_variants(p, q, k, v, cu, scale)
    if old is not None:
        variants["old"] = lambda: old.attention_varlen(p, q, k, v, cu, cu, scale, True, None)
    _run_variants(row, variants, ref, repeats, lambda ms_: {"tflops": flop / ms_ / 1e9})
    for cname in variants:
        for bname in ("flash", "cudnn"):
            if "ms" in row[cname] and "ms" in row[bname]:
                row[cname][f"vs_{bname}"] = row[bname]["ms"] / row[cname]["ms"]
    print(f"prefill {row['case']}: " + " ".join(
        f"{c}={row[c]['tflops']:.0f}TF{'' if row[c]['bitwise'] else '!BITS'}" if "ms" in row[c] else f"{c}=ERR"
        for c in variants) + " | " + " ".join(
        f"{bn}={flop / row[bn]['ms'] / 1e9:.0f}TF" if "ms" in row[bn] else f"{bn}=ERR"
        for bn in ("flash", "cudnn")),
        flush=True)
    return row


def sweep_decode(p, repeats: int, old, copy_tbs: float) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(2)
    rows = []
    for b, n, page in ((64, 4096, 16), (256, 2048, 16), (64, 4096, 64), (1, 4096, 16)):
        rows.append(_decode_case(p, b, n, page, g, repeats, old, copy_tbs))
        torch.cuda.empty_cache()
    return rows


def _decode_case(p, b: int, n: int, page: int, g: torch.Generator, repeats: int, old, copy_tbs: float
                 ) -> dict[str, Any]:
    hq, hkv, d = 32, 8, 128
    scale = d ** -0.5
    q = torch.randn(b, hq, d, device="cuda", generator=g).to(BF16)
    kc = torch.randn(b, n, hkv, d, device="cuda", generator=g).to(BF16)
    vc = torch.randn(b, n, hkv, d, device="cuda", generator=g).to(BF16)
    kv_bytes = 2.0 * b * n * hkv * d * 2
    row: dict[str, Any] = {"case": f"{b}x{n} page {page}", "kv_bytes": kv_bytes, "copy_tbs": copy_tbs}
    q4, k4, v4 = q.view(b, hq, 1, d), kc.transpose(1, 2), vc.transpose(1, 2)

    def sd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=True)
    _, err = _try(sd)
    row["flash"] = {"error": err} if err else {"ms": time_fns([sd], repeats=repeats)["median_ms"]}
    cache = build_paged_kv(list(kc.unbind(0)), list(vc.unbind(0)), page,
                           generator=torch.Generator().manual_seed(3), write=kv_cache_write_reference)
    args = (q, cache.k_cache, cache.v_cache, cache.block_table, cache.seq_lens, scale)
    ref = at.attention_decode(p, *args)
    variants = decode_variants(p, *args, torch.arange(b + 1, dtype=torch.int32, device="cuda"))
    if old is not None:
        variants["old"] = lambda: old.attention_decode(p, *args)
    flash_ms = row["flash"].get("ms")
    _run_variants(row, variants, ref, repeats, lambda ms_: {
        "tbs": kv_bytes / ms_ / 1e9, "of_copy": kv_bytes / ms_ / 1e9 / copy_tbs,
        **({"vs_flash": flash_ms / ms_} if flash_ms else {})})
    print(f"decode {row['case']}: " + " ".join(
        f"{c}={row[c]['tbs']:.2f}TB/s{'' if row[c]['bitwise'] else '!BITS'}" if "ms" in row[c] else f"{c}=ERR"
        for c in variants) + (f" | flash={kv_bytes / row['flash']['ms'] / 1e9:.2f}TB/s" if "ms" in row["flash"]
                              else " | flash=ERR"), flush=True)
    return row


def sweep_backward(p, repeats: int) -> list[dict[str, Any]]:
    g = torch.Generator(device="cuda").manual_seed(4)
    rows = []
    for b, n in ((1, 2048), (4, 2048), (1, 8192)):
        rows.append(_backward_case(p, b, n, g, repeats))
        torch.cuda.empty_cache()
    return rows


def _backward_cfg(overrides: dict[str, dict[str, int | bool]]) -> dict[str, dict[str, int | bool]]:
    cfg = ab.config(BF16, 128)
    for kernel, over in overrides.items():
        cfg[kernel].update(over)
    return cfg


def backward_variants(p, args: tuple) -> dict[str, Callable[[], tuple[torch.Tensor, ...]]]:
    """``backward``'s candidates on ``p``: ``attention_varlen_backward``'s plan on ``args`` (its arguments after the
    plan) with the shipped configuration (``shipped``) and with each BACKWARD_CANDIDATES override of it."""
    cfgs = {"shipped": None, **{c: _backward_cfg(over) for c, over in BACKWARD_CANDIDATES.items()}}
    return {c: (lambda cfg=cfg: ab.attention_varlen_backward(p, *args, cfg)) for c, cfg in cfgs.items()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def _backward_case(p, b: int, n: int, g: torch.Generator, repeats: int) -> dict[str, Any]:
    hq, hkv, d = 32, 8, 128
    t = b * n
    q, k, v, do = (torch.randn(t, h, d, device="cuda", generator=g).to(BF16) for h in (hq, hkv, hkv, hq))
    cu = cu_seqlens([n] * b, "cuda")
    scale = d ** -0.5
    flop = b * 10.0 * n * (n + 1) / 2 * hq * d
    row: dict[str, Any] = {"case": f"{b}x{n} backward", "flop": flop}
    q4, k4, v4, g4 = (x.view(b, n, x.shape[1], d).transpose(1, 2) for x in (q, k, v, do))
    leaves = [x.detach().requires_grad_(True) for x in (q4, k4, v4)]

    def fwd():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale, enable_gqa=True)
    out, err = _try(fwd)
    if err is None:
        row["flash"] = {"ms": time_fns([lambda: torch.autograd.grad(out, leaves, g4, retain_graph=True)],
                                       repeats=repeats)["median_ms"]}
    else:
        row["flash"] = {"error": err}
    out = leaves = None  # free SDPA's graph before the rlk variants
    variants = backward_variants(p, (do, q, k, v, cu, cu, scale, True, None))
    ref = variants["shipped"]()
    for cname, fn in variants.items():
        res, err = _try(fn)
        if err:
            row[cname] = {"error": err}
            continue
        again = fn()
        ms_ = time_fns([fn], repeats=repeats)["median_ms"]
        row[cname] = {"ms": ms_, "tflops": flop / ms_ / 1e9, "repeat_equal": all(map(torch.equal, res, again)),
                      "rel_vs_shipped": [_rel(x, y) for x, y in zip(res, ref, strict=True)]}
        if "ms" in row["flash"]:
            row[cname]["vs_flash"] = row["flash"]["ms"] / ms_
        del res, again
    print(f"backward {row['case']}: " + " ".join(
        f"{c}={row[c].get('vs_flash', 0):.2f}x{'' if row[c]['repeat_equal'] else '!NONDET'}"
        f"(rel {max(row[c]['rel_vs_shipped']):.1e})" if "ms" in row[c] else f"{c}=ERR" for c in variants)
        + (f" | flash={row['flash']['ms']:.3f}ms" if "ms" in row["flash"] else " | flash=ERR"), flush=True)
    return row


SECTIONS = ("linear", "linear_mid", "linear_tail", "linear_split", "linear_pdl", "prefill", "decode", "backward")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sections", default="linear,prefill,decode")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--old-attention", default=None)
    ap.add_argument("--shapes", default=None, help="the linear sections: only these shapes (comma-separated)")
    args = ap.parse_args()
    sections = args.sections.split(",")
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; known: {','.join(SECTIONS)}")
    shapes = set(args.shapes.split(",")) if args.shapes else None
    if shapes and shapes - set(SPLIT_SHAPES):
        ap.error(f"unknown shapes {sorted(shapes - set(SPLIT_SHAPES))}; known: {','.join(SPLIT_SHAPES)}")
    require_cuda("sweep_kernels")
    old = _old_module(args.old_attention)
    p = jit_plan(torch.device("cuda"))
    copy_tbs = copy_bandwidth()["tb_per_s"]
    t0 = time.time()
    for section in sections:
        if section in ("linear", "linear_mid", "linear_tail"):
            rows = sweep_linear(p, args.repeats, mid=section == "linear_mid", tail=section == "linear_tail",
                                shapes=shapes)
        elif section == "linear_split":
            rows = sweep_linear_split(p, args.repeats, shapes=shapes)
        elif section == "linear_pdl":
            rows = sweep_linear_split(p, args.repeats, pdl=True, shapes=shapes)
        elif section == "prefill":
            rows = sweep_prefill(p, args.repeats, old)
        elif section == "decode":
            rows = sweep_decode(p, args.repeats, old, copy_tbs)
        else:
            rows = sweep_backward(p, args.repeats)
        out = Path(default_out_dir())
        out.mkdir(parents=True, exist_ok=True)
        meta = {"env": environment(), "copy_tbs": copy_tbs, "repeats": args.repeats,
                "ratio": "native_ms / candidate_ms", "bitwise": "torch.equal with the contract configuration"}
        (out / f"sweep_{section}.json").write_text(results_json(meta, rows))
        print(f"=== {section} done at {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
