"""``rope`` (rlk.triton kernel, cached fp32 table) vs a torch rope in the same process.

Native path: the Hugging Face / Qwen3 formulation ``x * cos + rotate_half(x) * sin`` with cos/sin
gathered from a cached fp32 table by position and cast to the activation dtype. Heads 32/16/8/4/2 of
head dim 128 cover q and k of Qwen3-8B and 0.6B at TP 1, 2, 4. The rlk time is the kernel with the
cached table.
"""

from __future__ import annotations

import sys

import _common  # noqa: F401
import torch
from _common import M_LIST, randn
from harness import bench_membound

from rlk_core.ops._plan import jit_plan
from rlk_core.ops.rope import triton as ropet

THETA, D = 1e6, 128


def rlk(p, x, pos, cos_t, sin_t):
    """The rlk.triton kernel on the cached table: the op's launch (``ropet.launch``) run by ``p`` (the JIT plan)."""
    return ropet.launch(p, x, pos, cos_t, sin_t, D)


def native(x, pos, cos_t, sin_t):
    cos = torch.cat([cos_t[pos], cos_t[pos]], dim=-1)[:, None, :].to(x.dtype)
    sin = torch.cat([sin_t[pos], sin_t[pos]], dim=-1)[:, None, :].to(x.dtype)
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def cases(quick: bool):
    p = jit_plan(torch.device("cuda"))
    cos_t, sin_t = ropet.tables(p.device, D, THETA, 40960)
    for heads in ((32, 8) if quick else (32, 16, 8, 4, 2)):
        for m in ((1, 128, 8192) if quick else M_LIST):
            sets = []
            for i in range(2):
                pos = torch.randint(0, 40960, (m,), device="cuda", generator=torch.Generator("cuda").manual_seed(i))
                sets.append((randn((m, heads, D), seed=i), pos))
            nbytes = 2 * m * heads * D * 2 + m * D * 4 + m * 8  # x in, y out, one cos+sin row and a position per token
            yield (f"heads {heads} x 128", m, nbytes,
                   [lambda x=x, pos=pos: rlk(p, x, pos, cos_t, sin_t) for x, pos in sets],
                   [lambda x=x, pos=pos: native(x, pos, cos_t, sin_t) for x, pos in sets])


if __name__ == "__main__":
    bench_membound("rope", cases("--quick" in sys.argv))
