"""Fixed-order fp32 arithmetic used by the reference ops.

Every reduction here is written as a sequence of elementwise tensor operations whose structure
depends only on the reduction length, never on the number of rows, the memory layout, the thread
count or a BLAS library: an elementwise ``a + b`` rounds each element once, the same way wherever the
element sits. That makes the reference ops batch-invariant and run-to-run deterministic *by
construction* on the CPU (and on any device whose elementwise add/multiply are IEEE-rounded).

``tree_sum`` — the reduction order: pad the length to the next power of two with zeros, then
repeatedly add the upper half onto the lower half (``x[:h] + x[h:]``) until one element remains.
Element ``i`` therefore meets element ``i + h`` first; the tree is the same for every row.
"""

from __future__ import annotations

import torch

# Work per chunk of a blocked product (elements of the [rows, cols, K] product tensor).
_CHUNK_ELEMENTS = 1 << 22


def settle_cpu_vml() -> None:
    """Make oneMKL choose its ``exp`` and ``log`` kernels now, on the calling thread.

    On the CPU, ATen computes fp32/fp64 ``exp``/``log`` of more than 2048 elements with oneMKL's VML,
    one chunk per intra-op thread. oneMKL before 2025.0 chooses the kernel on the process's first call of
    each function, and when two threads make that first call at the same moment one of them may run a
    low-accuracy kernel over its whole chunk (pytorch/pytorch#188792). Measured here (torch 2.13 CPU
    wheel, 2 threads): the first ``linear_logprobs`` of a process gave rows 0..6 of 13 an ``exp`` off by
    up to 1770 ulp in about 1 process of 20 — its bits then differed from every later call. The log-prob
    tree and the swiglu reference use ``torch.exp``/``torch.log``; a call on one element runs on the
    calling thread and settles the choice before any parallel call. Done when ``rlk_core.ops`` is
    imported: a process whose first parallel ``exp``/``log`` ran before that import is not covered."""
    for dtype in (torch.float32, torch.float64):
        one = torch.ones(1, dtype=dtype)
        torch.exp(one)
        torch.log(one)


settle_cpu_vml()


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum the last dimension of an fp32 tensor in the fixed pairwise-halves order."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    p = 1 << (n - 1).bit_length()
    if p != n:
        x = torch.nn.functional.pad(x, (0, p - n))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def matmul_nt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32 with each output element reduced over K by :func:`tree_sum`.

    x: [M, K] fp32, w: [N, K] fp32 -> [M, N] fp32. Products of bf16/fp16 values are exact in fp32.
    The work is cut into blocks of rows and columns; blocking changes no element's arithmetic.
    """
    m, k = x.shape
    n = w.shape[0]
    out = x.new_empty((m, n))
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cols = max(1, min(n, _CHUNK_ELEMENTS // k))
    rows = max(1, min(m, _CHUNK_ELEMENTS // (cols * k)))
    for i in range(0, m, rows):
        xi = x[i : i + rows, None, :]
        for j in range(0, n, cols):
            out[i : i + rows, j : j + cols] = tree_sum(xi * w[None, j : j + cols, :])
    return out
