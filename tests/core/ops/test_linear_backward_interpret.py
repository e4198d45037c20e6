"""linear's backward through the rlk.triton stored-layout kernels under the Triton interpreter (CPU): the op's own
backward (``rlk_core.ops.linear``), its launcher registered as the CPU backend, so dx, dW and db reach
``_linear_bwd_tma_kernel`` (the shipped rule's tiles, TMA descriptors on the original tensors, zero fill past T)
or ``_linear_bwd_kernel`` (pointer loads) with the views the backward passes; within tolerance of the float64
products, bitwise run to run, every ``needs_input_grad`` subset, bias or not, leading dims [B, S, K], T = 1, 17,
64, 1000 with N, K no multiple of any tile. The interpreter does not reproduce GPU bits (tests/gpu/test_linear_gpu.py
does); fp16/fp32 only (the interpreter's bf16 ``tl.dot`` is wrong)."""

from __future__ import annotations

SCRIPT = """
    import torch

    import rlk_core.ops as ops
    from rlk_core.backends import REGISTRY, Backend
    from rlk_core.ops.linear import triton as LT
    from rlk_core.testing import dtype_tols

    REGISTRY.register(Backend("test.triton-on-cpu", "linear", lambda *a: LT.forward(CPU, *a), devices=("cpu",),
                              priority=50, builtin=True))
    ran = []  # per stored-layout launch: whether it was the TMA kernel
    _launch = CPU.launch
    STORED = (LT._linear_bwd_tma_kernel, LT._linear_bwd_kernel)
    CPU.launch = lambda k, grid, *a, **kw: (k in STORED and ran.append(k is STORED[0])) or _launch(k, grid, *a, **kw)


    def close(got, want, absdot, dtype, what):
        tols = dtype_tols(dtype)
        err = (got.double() - want).abs()
        allowed = tols["atol"] + tols["rtol"] * torch.maximum(want.abs(), absdot)
        assert got.dtype == dtype and bool((err <= allowed).all()), (what, float((err / allowed).max()))


    def grads(x, w, b, dy, need):
        leaves = [None if t is None else t.clone().requires_grad_(bool(r)) for t, r in zip((x, w, b), need)]
        out = ops.linear(*leaves)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        got = iter(torch.autograd.grad(out, wanted, dy))
        return [next(got) if t is not None and t.requires_grad else None for t in leaves]


    torch.manual_seed(0)
    N, K = 40, 24  # rows of 80 / 48 bytes in fp16: TMA-compatible, no multiple of any tile
    for tma in (True, False):
        CPU.tma = tma
        for dtype in (torch.float16, torch.float32):
            for lead, need, bias in (((1,), (1, 1, 1), True), ((17,), (1, 1, 1), True), ((64,), (1, 1, 0), False),
                                     ((1000,), (1, 1, 1), True), ((3, 7), (1, 0, 1), True), ((2, 9), (0, 1, 0), True),
                                     ((17,), (0, 0, 1), True)):
                x = torch.randn(*lead, K).to(dtype)
                w = (torch.randn(N, K) / K**0.5).to(dtype)
                b = torch.randn(N).to(dtype) if bias else None
                dy = torch.randn(*lead, N).to(dtype)
                del ran[:]
                got = grads(x, w, b, dy, need)
                # one launch per gradient asked for; TMA wherever the operands allow it (db's ones: stride 0, never)
                assert len(ran) == sum(need), (lead, need, ran)
                want_tma = [tma and dtype == torch.float16] * (need[0] + need[1]) + [False] * need[2]
                assert ran == want_tma, (tma, dtype, lead, need, ran)
                again = grads(x, w, b, dy, need)
                for a, r in zip(got, again):
                    assert (a is None) == (r is None) and (a is None or torch.equal(a, r)), "run to run"
                g64, x64, w64 = dy.double().reshape(-1, N), x.double().reshape(-1, K), w.double()
                dx, dw, db = got
                if need[0]:
                    close(dx, (g64 @ w64).reshape(x.shape), (g64.abs() @ w64.abs()).reshape(x.shape), dtype, "dx")
                if need[1]:
                    close(dw, g64.t() @ x64, g64.abs().t() @ x64.abs(), dtype, "dW")
                if need[2]:
                    close(db, g64.sum(0), g64.abs().sum(0), dtype, "db")
    # small tiles at the launcher, so that dW's and db's outputs span several tiles and ragged edges too (the
    # persistent loop walks several tiles per program, GROUP_M groups rows)
    for dtype in (torch.float16, torch.float32):
        for t in (1, 70):
            g, x, w = torch.randn(t, N).to(dtype), torch.randn(t, K).to(dtype), torch.randn(N, K).to(dtype)
            ones = g.new_ones(1).as_strided((1, t), (1, 0))
            g64, x64, w64 = g.double(), x.double(), w.double()
            for tile in ((16, 16, 16, 2, 4, 2), (32, 16, 32, 2, 4, 2)):
                for tma in (True, False) if dtype == torch.float16 else (False,):
                    cfg = LT.stored_tile_config(tile, dtype, tma)
                    close(LT.linear_2d(g, w.t(), None, cfg), g64 @ w64, g64.abs() @ w64.abs(), dtype, ("dx", tile))
                    close(LT.linear_2d(g.t(), x.t(), None, cfg), g64.t() @ x64, g64.abs().t() @ x64.abs(), dtype,
                          ("dW", tile))
                    if not tma:  # broadcast ones: pointer loads only
                        close(LT.linear_2d(g.t(), ones, None, cfg)[:, 0], g64.sum(0), g64.abs().sum(0), dtype,
                              ("db", tile))
    # into() as the log-prob backward calls it: dz [T, C] @ W[chunk] [C, H] into an fp32 buffer (TMA loads,
    # pointer stores) and dz^T @ hidden from the views dz.t(), hidden.t() into a row slice of dW
    CPU.tma = True
    t, c, h = 70, 40, 24
    dz, hidden, wc = torch.randn(t, c).half(), torch.randn(t, h).half(), torch.randn(c, h).half()
    part = torch.empty(t, h)
    LT.into(CPU, dz, wc.t(), None, part)
    close(part, dz.double() @ wc.double(), dz.double().abs() @ wc.double().abs(), torch.float32, "dz W")
    dw = torch.zeros(3 * c, h).half()
    LT.into(CPU, dz.t(), hidden.t(), None, dw[c:2 * c])
    close(dw[c:2 * c], dz.double().t() @ hidden.double(), dz.double().abs().t() @ hidden.double().abs(),
          torch.float16, "dz^T hidden")
    assert not dw[:c].any() and not dw[2 * c:].any()
    print("ok")
"""


def test_linear_backward_kernels_interpreted(run_interpreted):
    run_interpreted(SCRIPT, timeout=600)
