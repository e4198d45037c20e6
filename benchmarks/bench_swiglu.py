"""``swiglu`` (rlk.triton, fused) vs ``F.silu(gate) * up`` (torch, unfused) in the same process.

Intermediate sizes: Qwen3-8B 12288 / TP2 6144 / TP4 3072, Qwen3-0.6B 3072 / 1536 / 768.
"""

from __future__ import annotations

import sys

import _common  # noqa: F401
import torch
import torch.nn.functional as F
from _common import M_LIST, randn
from harness import bench_membound

from rlk_core.ops._plan import jit_plan
from rlk_core.ops.swiglu import triton as st


def rlk(p, x):
    """The rlk.triton forward: the op's launch plan run by ``p`` (the JIT plan of the GPU)."""
    return st.forward(p, x)


def native(x, inter):
    return F.silu(x[..., :inter]) * x[..., inter:]


def cases(quick: bool):
    p = jit_plan(torch.device("cuda"))
    for inter in ((12288, 768) if quick else (12288, 6144, 3072, 1536, 768)):
        for m in ((1, 128, 8192) if quick else M_LIST):
            sets = [randn((m, 2 * inter), scale=3.0, seed=i) for i in range(2)]
            yield (f"I={inter}", m, 3 * m * inter * 2, [lambda x=x: rlk(p, x) for x in sets],
                   [lambda x=x, inter=inter: native(x, inter) for x in sets])


if __name__ == "__main__":
    bench_membound("swiglu", cases("--quick" in sys.argv))
