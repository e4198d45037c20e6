"""rlk_collectives vs NCCL's own collectives, two GPUs, in the same processes.

Run under torchrun: ``python -m torch.distributed.run --nproc-per-node 2 benchmarks/bench_collectives.py``
(with ``NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1``). Rank 0 writes
``collectives.json`` / ``collectives.md`` into ``$RLK_BENCH_OUT``.

Rows (bf16, S = message bytes, W = 2):
- all-reduce, 8 KiB .. 256 MiB: NCCL ``all_reduce`` vs rlk's default path and each path; bus bandwidth
  ``2 (W-1)/W * S / t`` (nccl-tests' definition); device time by the shared harness (L2 flushed, the
  GPU held busy while the host enqueues, CUDA events, medians);
- the same under CUDA-graph replay for the small sizes (vLLM's decode), and host-inclusive wall time
  per eager call (a loop of calls, one synchronisation);
- reduce-scatter: NCCL ``reduce_scatter_tensor`` vs rlk; bus bandwidth ``(W-1)/W * S / t``.
``ratio`` is NCCL time / rlk time (>= 1: rlk as fast).
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time

import _common  # noqa: F401  (puts rlk-core on the path)
import torch
import torch.distributed as dist
from harness import copy_bandwidth, environment, require_cuda, time_fns, write_results

from rlk_collectives import all_reduce, reduce_scatter

KiB, MiB = 1 << 10, 1 << 20
LATENCY = (8 * KiB, 32 * KiB, 128 * KiB, 512 * KiB, 2 * MiB)
BANDWIDTH = (16 * MiB, 32 * MiB, 64 * MiB, 128 * MiB, 256 * MiB)
PATHS = ("gather", "a2a", "nccl2", "nccl2_raw")
REPEATS = 30


def inputs(nbytes: int, sets: int = 2) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(nbytes)
    return [torch.randn(nbytes // 2, device="cuda", generator=g).to(torch.bfloat16) for _ in range(sets)]


def ms(fns) -> float:
    return time_fns(fns, warmup=3, repeats=REPEATS)["median_ms"]


def graph_ms(fn) -> float:
    """Median device time of replaying a graph that holds 10 calls of ``fn``, per call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    return ms([graph.replay]) / 10


def wall_us(fn, calls: int = 200) -> float:
    """Host-inclusive microseconds per eager call: ``calls`` back to back, one synchronisation."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / calls * 1e6


def all_reduce_rows(world: int) -> list[dict]:
    rows = []
    for nbytes in LATENCY + BANDWIDTH:
        xs = inputs(nbytes)
        scratch = [x.clone() for x in xs]
        r = {"op": "all_reduce", "bytes": nbytes}
        r["nccl_ms"] = ms([lambda s=s: dist.all_reduce(s) for s in scratch])
        r["rlk_ms"] = ms([lambda x=x: all_reduce(x, check=False) for x in xs])
        for p in PATHS:
            r[f"{p}_ms"] = ms([lambda x=x, p=p: all_reduce(x, check=False, _path=p) for x in xs])
        if nbytes in LATENCY:
            r["rlk_checked_ms"] = ms([lambda x=x: all_reduce(x) for x in xs])
            r["nccl_graph_ms"] = graph_ms(lambda s=scratch[0]: dist.all_reduce(s))
            r["rlk_graph_ms"] = graph_ms(lambda x=xs[0]: all_reduce(x, check=False))
            r["nccl_wall_us"] = wall_us(lambda s=scratch[0]: dist.all_reduce(s))
            r["rlk_wall_us"] = wall_us(lambda x=xs[0]: all_reduce(x, check=False))
            r["graph_ratio"] = r["nccl_graph_ms"] / r["rlk_graph_ms"]
        _finish(rows, r, 2 * (world - 1) / world, nbytes)
        del xs, scratch
    return rows


def _finish(rows: list[dict], r: dict, factor: float, nbytes: int) -> None:
    """Bus bandwidths (``factor`` x bytes / time, NCCL's convention) and the ratio; keep and print the row."""
    r["nccl_busbw"] = factor * nbytes / r["nccl_ms"] / 1e6
    r["rlk_busbw"] = factor * nbytes / r["rlk_ms"] / 1e6
    r["ratio"] = r["nccl_ms"] / r["rlk_ms"]
    rows.append(r)
    if dist.get_rank() == 0:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}, flush=True)


def reduce_scatter_rows(world: int) -> list[dict]:
    rows = []
    for nbytes in LATENCY[-1:] + BANDWIDTH:
        xs = inputs(nbytes)
        outs = [torch.empty(x.numel() // world, dtype=x.dtype, device="cuda") for x in xs]
        r = {"op": "reduce_scatter", "bytes": nbytes}
        r["nccl_ms"] = ms([lambda x=x, o=o: dist.reduce_scatter_tensor(o, x) for x, o in zip(xs, outs)])
        r["rlk_ms"] = ms([lambda x=x: reduce_scatter(x, dim=0, check=False) for x in xs])
        _finish(rows, r, (world - 1) / world, nbytes)
    return rows


def main() -> None:
    require_cuda("bench_collectives")
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        print("bench_collectives: run under torchrun (python -m torch.distributed.run --nproc-per-node 2 ...)",
              file=sys.stderr)
        raise SystemExit(2)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", rank))
    quick = "--quick" in sys.argv
    global LATENCY, BANDWIDTH
    if quick:
        LATENCY, BANDWIDTH = LATENCY[:2], BANDWIDTH[:1]
    rows = all_reduce_rows(world) + reduce_scatter_rows(world)
    if rank == 0:
        env = environment()
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        env["world_size"] = world
        env["nvls"] = os.environ.get("NCCL_NVLS_ENABLE")
        meta = {"env": env, "copy": copy_bandwidth(), "repeats": REPEATS, "ratio": "nccl_ms / rlk_ms",
                "busbw": "GB/s; all-reduce 2(W-1)/W*S/t, reduce-scatter (W-1)/W*S/t (nccl-tests)",
                "paths": "rlk_ms is the default path (rlk_collectives._transport.all_reduce_path); *_ms each path",
                "graph": "*_graph_ms: per call, replaying a graph of 10 calls; *_wall_us: host-inclusive eager",
                "ratio_median_bw": statistics.median(r["ratio"] for r in rows
                                                     if r["op"] == "all_reduce" and r["bytes"] >= 16 * MiB)}
        cols = [("op", "op"), ("bytes", "bytes"), ("nccl_ms", "NCCL ms"), ("rlk_ms", "rlk ms"),
                ("nccl_busbw", "NCCL busbw GB/s"), ("rlk_busbw", "rlk busbw GB/s"), ("ratio", "NCCL/rlk"),
                ("gather_ms", "gather ms"), ("a2a_ms", "a2a ms"), ("nccl2_ms", "nccl2 ms"),
                ("rlk_checked_ms", "rlk check=True ms"), ("graph_ratio", "graph NCCL/rlk"),
                ("nccl_wall_us", "NCCL wall us"), ("rlk_wall_us", "rlk wall us")]
        write_results(os.environ.get("RLK_BENCH_OUT", "benchmarks/results/h200x2/collectives"), "collectives",
                      meta, rows, cols)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
