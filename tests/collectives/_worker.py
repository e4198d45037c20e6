"""A gloo test group: ``python _worker.py <scenario> <world> <init_file> <out_dir>``.

Imports torch and rlk once, then forks one child per rank (importing torch in W processes would cost
W times the import on the 2-core CI machine). Child ``r`` joins the group, runs
``scenarios.<scenario>(r, world)`` and saves the returned dict as ``<out_dir>/rank<r>.pt``; errors the
scenario expects are recorded in the dict as strings, any other exception exits the child non-zero
with its traceback on stderr. The parent exits non-zero if any child did.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"rlk_coll_{name}", HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _rank_main(scenario, rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.save(scenario(rank, world), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def main() -> None:
    name, world, init_file, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    torch.set_num_threads(1)
    scenario = getattr(_load("scenarios"), name)
    import rlk_core.ops.attention  # noqa: F401  (imported once, before the fork)

    children = {}
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _rank_main(scenario, rank, world, init_file, out_dir)
            except BaseException:
                sys.stderr.write(f"--- rank {rank} ---\n{traceback.format_exc()}")
                code = 1
            sys.stderr.flush()
            os._exit(code)
        children[pid] = rank
    failed = []
    for _ in range(world):
        pid, status = os.wait()
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(children[pid])
    if failed:
        sys.stderr.write(f"ranks {sorted(failed)} failed\n")
        sys.exit(1)


if __name__ == "__main__":
    main()
