"""One timing harness for every rlk benchmark (CUDA events, warm-up, median, L2 flush, rotation).

``time_fns(fns)`` times a list of zero-argument callables that each run the same operation on a
different input set (rotated, so repeats do not find their inputs in L2). Before every timed call a
256 MB buffer is written (more than the H200's 60 MB L2) and the GPU is held busy by a fixed
``torch.cuda._sleep`` (about 0.5 ms) so that the host has enqueued the call before the GPU reaches
it; then the call is bracketed by CUDA events and the median over ``repeats`` is reported. So the
numbers are device time: host launch overhead (Triton's launcher costs more host time than
cuBLAS's) is excluded for both sides and reported separately where it matters (bench_linear).

``step_times`` and ``wall_times`` time whole steps instead (a training step, an engine's ``generate``), where the
host's share is part of what is measured: no flush, no head start.

``write_results`` writes ``<name>.json`` (every number, plus GPU, driver, torch, Triton, commit)
and ``<name>.md`` (a table) into one directory.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

FLUSH_BYTES = 256 << 20
SLEEP_CYCLES = 1_000_000  # ~0.5 ms at 1.98 GHz: longer than any host-side launch path measured
_flush_buf: torch.Tensor | None = None


def require_cuda(name: str) -> None:
    """Refuse in one line, exit status 2, where there is no CUDA device (the GPU benchmarks' usage error)."""
    if not torch.cuda.is_available():
        print(f"{name}: needs a CUDA GPU", file=sys.stderr)
        raise SystemExit(2)


def flush_l2() -> None:
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    _flush_buf.fill_(1)


def time_fns(fns: Sequence[Callable[[], Any]], warmup: int = 3, repeats: int = 20) -> dict[str, float]:
    """Median / min / max milliseconds of one call, rotating through ``fns``."""
    for i in range(warmup):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
    for i in range(repeats):
        flush_l2()
        torch.cuda._sleep(SLEEP_CYCLES)
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    ms = [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]
    return {"median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "repeats": repeats}


def step_times(step: Callable[[], Any], warmup: int, repeats: int, cuda: bool) -> dict[str, Any]:
    """``repeats`` calls of ``step`` after ``warmup`` untimed ones, each timed alone: wall milliseconds (the GPU
    synchronised before and after) and, on CUDA, the device milliseconds between events recorded around it; the
    peak memory of the timed calls. ``median_ms`` is the events' median on CUDA, the wall clock's elsewhere."""
    t = time.monotonic()
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    out: dict[str, Any] = {"warmup_s": round(time.monotonic() - t, 2)}
    wall, events = [], []
    for _ in range(repeats):
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            w0 = time.perf_counter()
            e0.record()
            step()
            e1.record()
            torch.cuda.synchronize()
            events.append(e0.elapsed_time(e1))
        else:
            w0 = time.perf_counter()
            step()
        wall.append((time.perf_counter() - w0) * 1e3)
    out.update(wall_ms=[round(x, 2) for x in wall], median_wall_ms=round(statistics.median(wall), 2))
    if cuda:
        out.update(events_ms=[round(x, 2) for x in events], median_ms=round(statistics.median(events), 2),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    else:
        out["median_ms"] = out["median_wall_ms"]
    return out


def wall_times(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Wall seconds of ``repeats`` calls of ``fn`` (each call its own measurement; ``before()`` runs untimed ahead of
    each and its values are kept, e.g. a cache reset that returns the GPU clock). ``result``: the first call's."""
    seconds, befores, result = [], [], None
    for i in range(repeats):
        befores.append(before() if before is not None else None)
        t0 = time.perf_counter()
        got = fn()
        seconds.append(time.perf_counter() - t0)
        result = got if i == 0 else result
    return {"seconds_each": seconds, "median_s": statistics.median(seconds), "before_each": befores, "result": result}


def best_host_us(fn: Callable[[], Any], calls: int, loops: int, clock: Callable[[], float] = time.perf_counter,
                 warmup: int | None = None) -> float:
    """Host microseconds per call of ``fn`` (work the host does itself, no GPU wait): the best of ``loops``
    loops of ``calls`` back-to-back calls, after ``warmup`` calls (default ``calls // 10``), on ``clock``."""
    for _ in range(calls // 10 if warmup is None else warmup):
        fn()
    best = float("inf")
    for _ in range(loops):
        t0 = clock()
        for _ in range(calls):
            fn()
        best = min(best, (clock() - t0) / calls * 1e6)
    return best


def copy_bandwidth(nbytes: int = 2 << 30, repeats: int = 20) -> dict[str, float]:
    """Device-to-device copy, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 4, device="cuda")
    dst = torch.empty_like(src)
    t = time_fns([lambda: dst.copy_(src)], warmup=3, repeats=repeats)
    return {"bytes": 2 * nbytes, "median_ms": t["median_ms"], "tb_per_s": 2 * nbytes / t["median_ms"] / 1e9}


def same_size_copy_ms(nbytes: int, repeats: int = 20) -> float:
    """Median ms of a device-to-device copy moving ``nbytes`` in total (``nbytes / 2`` read, ``nbytes / 2``
    written): the copy a memory-bound op of that traffic is compared with at its own size."""
    src = torch.empty(max(nbytes // 2, 1), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_fns([lambda: dst.copy_(src)], repeats=repeats)["median_ms"]


def environment() -> dict[str, Any]:
    import triton

    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError) as exc:
        driver = f"unknown ({exc})"
    props = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "driver": driver,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "commit": os.environ.get("RLK_COMMIT", "unknown"),
    }


def results_json(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """``{"meta": ..., "rows": [...]}`` with the meta indented and one row per line (diffs stay readable,
    files stay short)."""
    body = ",\n".join(json.dumps(row) for row in rows)
    return f'{{"meta": {json.dumps(meta, indent=1)},\n "rows": [\n{body}\n]}}\n'


def write_results(out_dir: str | os.PathLike, name: str, meta: dict[str, Any], rows: list[dict[str, Any]],
                  columns: list[tuple[str, str]]) -> None:
    """``columns``: (key, header) pairs for the markdown table; floats printed with 3 significant digits."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(results_json(meta, rows))
    env = meta["env"]
    lines = [f"# {name}", "",
             f"{env['gpu']}, driver {env['driver']}, torch {env['torch']} (CUDA {env['cuda']}), "
             f"Triton {env['triton']}, commit `{env['commit']}`. Copy bandwidth in this run: "
             f"{meta['copy']['tb_per_s']:.2f} TB/s (read + write)."
             + (f" Medians of {meta['repeats']} CUDA-event timings, L2 flushed before each, inputs rotated."
                if "repeats" in meta else ""), "",
             "| " + " | ".join(h for _, h in columns) + " |",
             "|" + "---|" * len(columns)]
    for r in rows:
        cells = []
        for key, _ in columns:
            v = r.get(key, "")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        lines.append("| " + " | ".join(cells) + " |")
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def default_out_dir() -> str:
    return os.environ.get("RLK_BENCH_OUT", str(Path(__file__).resolve().parent / "results" / "h200"))


def bench_membound(name: str, cases, repeats: int = 20, quick: bool = False) -> None:
    """Memory-bound ops: ``cases`` yields ``(shape, M, bytes, rlk_fns, native_fns)``; ``bytes`` is the
    minimum traffic (each input read once, each output written once). Reports GB/s, the fraction of
    the (2 GiB) copy bandwidth measured in this run, the fraction of a copy moving the same bytes
    (``same_size_copy_ms / rlk_ms``: launch latency and wave tails count for both), and ratio = native
    time / rlk time."""
    require_cuda(f"bench_{name}")
    env, copy = environment(), copy_bandwidth()
    rows = []
    for shape, m, nbytes, rlk_fns, native_fns in cases:
        t_r = time_fns(rlk_fns, repeats=repeats)["median_ms"]
        t_n = time_fns(native_fns, repeats=repeats)["median_ms"]
        t_c = same_size_copy_ms(nbytes, repeats)
        r = {"shape": shape, "M": m, "bytes": nbytes, "rlk_ms": t_r, "native_ms": t_n, "copy_ms": t_c,
             "rlk_tbs": nbytes / t_r / 1e9, "native_tbs": nbytes / t_n / 1e9,
             "rlk_of_copy": nbytes / t_r / 1e9 / copy["tb_per_s"], "rlk_of_same_copy": t_c / t_r,
             "ratio": t_n / t_r}
        rows.append(r)
        print(f"{name} {shape:24s} M={m:5d} rlk {t_r:.4f} ms ({r['rlk_tbs']:.2f} TB/s, "
              f"{100 * r['rlk_of_copy']:.0f}% of copy, {100 * r['rlk_of_same_copy']:.0f}% of same-size copy) "
              f"native {t_n:.4f} ms ratio {r['ratio']:.2f}", flush=True)
    meta = {"env": env, "copy": copy, "repeats": repeats, "ratio": "native_ms / rlk_ms",
            "bytes": "minimum traffic: inputs read once, outputs written once",
            "rlk_of_same_copy": "same_size_copy_ms / rlk_ms: a uint8 copy moving the same bytes, same harness"}
    write_results(default_out_dir(), name, meta, rows,
                  [("shape", "shape"), ("M", "M"), ("rlk_ms", "rlk ms"), ("native_ms", "native ms"),
                   ("rlk_tbs", "rlk TB/s"), ("native_tbs", "native TB/s"), ("rlk_of_copy", "rlk / copy BW"),
                   ("copy_ms", "same-size copy ms"), ("rlk_of_same_copy", "rlk / same-size copy"), ("ratio", "ratio")])
