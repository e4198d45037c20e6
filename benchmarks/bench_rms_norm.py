"""``rms_norm`` (rlk.triton) vs ``F.rms_norm`` in the same process.

Rows of the hidden size (Qwen3-8B 4096, 0.6B 1024; not sharded by TP) and q/k-norm rows of the head
dim 128 with M x heads rows (heads 32/16/8/4/2 cover q and k of both models at TP 1, 2, 4).
"""

from __future__ import annotations

import sys

import _common  # noqa: F401
import torch
import torch.nn.functional as F
from _common import M_LIST, randn
from harness import bench_membound

from rlk_core.ops._plan import jit_plan
from rlk_core.ops.rms_norm import triton as rt

EPS = 1e-6


def rlk(p, x, w):
    """The rlk.triton forward: the op's launch plan run by ``p`` (the JIT plan of the GPU)."""
    return rt.forward(p, x, w, EPS)


def cases(quick: bool):
    p = jit_plan(torch.device("cuda"))
    shapes = [("hidden 4096", 4096, 1), ("hidden 1024", 1024, 1)]
    shapes += [(f"head 128 x{h}", 128, h) for h in (32, 16, 8, 4, 2)]
    for label, h, mult in shapes[:3] if quick else shapes:
        for m in ((1, 128, 8192) if quick else M_LIST):
            sets = [(randn((m * mult, h), seed=i), randn((h,), seed=100 + i)) for i in range(2)]
            nbytes = 2 * m * mult * h * 2 + h * 2
            yield (label, m, nbytes, [lambda x=x, w=w: rlk(p, x, w) for x, w in sets],
                   [lambda x=x, w=w, h=h: F.rms_norm(x, (h,), w, EPS) for x, w in sets])


if __name__ == "__main__":
    bench_membound("rms_norm", cases("--quick" in sys.argv))
