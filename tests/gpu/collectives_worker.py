"""One rank of the NCCL collective checks (tests/gpu/test_collectives_gpu.py starts two under torchrun).

Every check runs on both ranks in the same order and records ``{name: (ok, detail)}``; rank 0 writes
``<out>/collectives_gpu.json``. Inputs are built on the GPU from one seed on every rank (all ranks'
contributions), so each rank computes the reference ``reduce_reference`` itself; a moderate size is
also compared with the CPU reference (the GPU's arithmetic and NaN bits are the CPU specification's).
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from rlk_collectives import ZigzagLayout, all_gather, all_reduce, cp_all_gather, cp_reduce_scatter, reduce_reference
from rlk_collectives import reduce_scatter as rs
from rlk_core.testing.graphs import capture

_spec = importlib.util.spec_from_file_location("rlk_coll_inputs", Path(__file__).resolve().parents[1] / "collectives" /
                                               "_inputs.py")
inputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(inputs)

MiB = 1 << 20
# element counts from 1 element to 256 MiB of bf16 (128 Mi elements); odd ones pad the all-to-all path
SIZES = (1, 2, 3, 1023, 4099, 65539, 1 * MiB // 2 + 1, 4 * MiB, 16 * MiB + 5, 128 * MiB)
PATHS = ("gather", "a2a")
RESULTS: dict[str, tuple[bool, str]] = {}


def gpu_bits(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Random bit patterns on the GPU (all exponents, NaN payloads, infinities, signed zeros)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    it = torch.int16 if dtype.itemsize == 2 else torch.int32
    info = torch.iinfo(it)
    return [torch.randint(info.min, info.max, (n,), generator=g, device="cuda", dtype=it).view(dtype)
            for _ in range(world)]


def same(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"{a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    it = {2: torch.int16, 4: torch.int32}[a.element_size()]
    diff = int((a.contiguous().view(it) != b.contiguous().view(it)).sum())
    return diff == 0, f"{diff} of {a.numel()} differ"


def check(name: str, fn) -> None:
    try:
        ok, detail = fn()
    except Exception:  # recorded, not raised: the other rank must be able to run the same sequence
        ok, detail = False, traceback.format_exc()[-1500:]
    RESULTS[name] = (ok, detail)
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail if not ok else ''}", flush=True)


def on_both_ranks(t: torch.Tensor) -> tuple[bool, str]:
    """The result's bytes, gathered from both ranks, are identical."""
    flat = t.contiguous().view(-1).view(torch.uint8)
    both = torch.empty(2 * flat.numel(), dtype=torch.uint8, device="cuda")
    dist.all_gather_into_tensor(both, flat)
    return bool(torch.equal(both[: flat.numel()], both[flat.numel():])), "rank 0 vs rank 1"


def main() -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=60), device_id=torch.device("cuda", rank))
    out = Path(sys.argv[1])

    # the GPU's arithmetic is the CPU specification's, bit for bit (NaN patterns included)
    for dtype in inputs.DTYPES:
        for kind, xs in (("adversarial", inputs.adversarial(world, 70001, dtype, seed=1)),
                         ("bits", inputs.random_bits(world, 70001, dtype, seed=2))):
            ref_cpu = reduce_reference(xs)
            check(f"cpu_spec/{kind}/{dtype}", lambda xs=xs, r=ref_cpu: same(all_reduce(xs[rank].cuda()).cpu(), r))
    for dtype in inputs.DTYPES:
        for n in SIZES:
            if dtype != torch.bfloat16 and n > 16 * MiB + 5:
                continue
            xs = gpu_bits(world, n, dtype, seed=n)
            ref = reduce_reference(xs)
            check(f"all_reduce/{dtype}/{n}", lambda xs=xs, ref=ref: same(all_reduce(xs[rank]), ref))
            if n in (4099, 4 * MiB, 16 * MiB + 5) or (n == 128 * MiB):
                for p in PATHS:
                    check(f"all_reduce/{dtype}/{n}/{p}",
                          lambda xs=xs, ref=ref, p=p: same(all_reduce(xs[rank], check=False, _path=p), ref))
                check(f"identical/{dtype}/{n}", lambda xs=xs: on_both_ranks(all_reduce(xs[rank])))
                check(f"slice/{dtype}/{n}", lambda xs=xs, ref=ref: same(all_reduce(xs[rank][1:-1]), ref[1:-1]))
            del xs, ref
    for n in (4, 4100, 8 * MiB):
        xs = gpu_bits(world, n, torch.bfloat16, seed=7 + n)
        ref = reduce_reference(xs)
        check(f"reduce_scatter/{n}", lambda xs=xs, ref=ref: same(rs(xs[rank].view(-1, 2), dim=0),
                                                                 ref.view(-1, 2).chunk(2)[rank].contiguous()))
        check(f"all_gather/{n}", lambda xs=xs: same(all_gather(xs[rank].view(-1, 2), dim=1),
                                                    torch.cat([x.view(-1, 2) for x in xs], 1)))
    for dtype in inputs.DTYPES:  # the W = 2 NCCL-sum candidate: its bits, with and without canonical NaNs
        xs = gpu_bits(world, 4 * MiB + 1, dtype, seed=21)
        ref = reduce_reference(xs)
        check(f"candidate/nccl2/{dtype}", lambda xs=xs, ref=ref: same(all_reduce(xs[rank], _path="nccl2"), ref))
        # a measurement, not a check: NCCL's raw NaN bits are the GPU's canonical NaN, not CANONICAL_NAN
        check(f"candidate/nccl2_raw_differs/{dtype}",
              lambda xs=xs, ref=ref: (True, same(all_reduce(xs[rank], _path="nccl2_raw"), ref)[1]))
        raw = all_reduce(xs[rank], _path="nccl2_raw")
        it = torch.int16 if dtype.itemsize == 2 else torch.int32
        check(f"candidate/nan_bits/{dtype}", lambda raw=raw, it=it: (True, str(sorted(set(
            raw[raw.isnan()].view(it).tolist()))[:8])))
    _cp(rank, world)
    _graphs(rank, world)
    torch.cuda.synchronize()
    if rank == 0:
        (out / "collectives_gpu.json").write_text(json.dumps(RESULTS, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def _cp(rank: int, world: int) -> None:
    cu = [0, 4 * 300, 4 * 300 + 4 * 17, 4 * 317 + 4 * 1000]
    layout = ZigzagLayout.build(cu, world, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(3)
    k_full = torch.randn(cu[-1], 8, 128, device="cuda", generator=g).to(torch.bfloat16)
    check("cp/all_gather", lambda: same(cp_all_gather(layout.shard(k_full, rank), layout), k_full))
    dks = gpu_bits(world, cu[-1] * 8 * 128, torch.bfloat16, seed=4)
    ref = reduce_reference(dks).view(cu[-1], 8, 128)
    check("cp/reduce_scatter", lambda: same(cp_reduce_scatter(dks[rank].view(cu[-1], 8, 128), layout),
                                            layout.shard(ref, rank)))


def _graphs(rank: int, world: int) -> None:
    """Captured collectives replay with the bits of an eager call on the new inputs (vLLM's decode)."""
    for n in (4096, 1 * MiB + 3, 16 * MiB):
        for p in (None, *PATHS):
            name = f"graph/all_reduce/{n}/{p or 'default'}"

            def run(n=n, p=p):
                x = gpu_bits(world, n, torch.bfloat16, seed=11)[rank].clone()
                graph, res = capture(lambda: all_reduce(x, _path=p))
                new = gpu_bits(world, n, torch.bfloat16, seed=12)
                x.copy_(new[rank])
                graph.replay()
                ok1, d1 = same(res, reduce_reference(new))
                graph.replay()
                ok2, d2 = same(res, reduce_reference(new))
                return ok1 and ok2, f"{d1}; {d2}"
            check(name, run)

    def run_rs():
        x = gpu_bits(world, 8192, torch.bfloat16, seed=13)[rank].clone()
        graph, res = capture(lambda: rs(x, dim=0))
        new = gpu_bits(world, 8192, torch.bfloat16, seed=14)
        x.copy_(new[rank])
        graph.replay()
        return same(res, reduce_reference(new).chunk(world)[rank].contiguous())
    check("graph/reduce_scatter", run_rs)


if __name__ == "__main__":
    main()
