"""The rlk.triton MoE kernels (ops/moe/triton.py) under the Triton interpreter (CPU) at small shapes and small tiles:
the router's top-k forward and backward (both normalisations, ties to the lower id), the grouped GEMM over empty,
one-row and multi-tile experts (forward, dx through the weight's transposed view, the weight gradient), the combine
and its backward — against the reference within tolerance (ids exactly). The interpreter does not reproduce GPU bits;
the kernels' bitwise properties are tests/gpu/test_moe_gpu.py. fp32/fp16 only (the interpreter's bf16 ``tl.dot`` is
wrong)."""

from __future__ import annotations

SCRIPT = """
    from rlk_core.ops.moe import reference as R
    from rlk_core.ops.moe import triton as MT

    def close(a, b, tol, what):
        err = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        scale = max(1.0, float(b.double().abs().max())) if b.numel() else 1.0
        assert err <= tol * scale, (what, err)

    torch.manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 4e-3)):
        for e in (13, 64):
            logits = (2 * torch.randn(9, e)).to(dtype)
            for k in (1, 3, 8):
                for norm in (True, False):
                    w, ids = MT.topk_forward(CPU, logits, k, norm)
                    w_r, ids_r = R.moe_topk_reference(logits, k, norm)
                    assert torch.equal(ids, ids_r), (dtype, e, k, norm, ids, ids_r)
                    close(w, w_r, 1e-6, ("topk", dtype, e, k, norm))
                    g = torch.randn(9, k)
                    close(MT.topk_backward(CPU, g, logits, w, ids, norm),
                          R.moe_topk_backward_reference(g, logits, w_r, ids_r, norm), tol, ("topk bwd", dtype, k, norm))
        ties = torch.zeros(3, 13, dtype=dtype)
        ties[1, 5] = ties[1, 9] = 1.0
        assert MT.topk_forward(CPU, ties, 4, True)[1].tolist() == [[0, 1, 2, 3], [5, 9, 0, 1], [0, 1, 2, 3]]

        tiles = dict(MT.config(dtype), BLOCK_M=16, BLOCK_N=16, BLOCK_K=16)
        wtiles = dict(MT.wgrad_config(dtype), BLOCK_R=16, BLOCK_N=16, BLOCK_K=16)
        x, weight = torch.randn(37, 40).to(dtype), (torch.randn(5, 24, 40) / 4).to(dtype)
        for counts in ((3, 0, 17, 16, 1), (0, 37, 0, 0, 0), (0, 0, 0, 0, 37)):
            off = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
            close(MT._grouped(CPU, x, weight, off, tiles), R.moe_grouped_linear_reference(x, weight, off), tol,
                  ("grouped", dtype, counts))
            g = torch.randn(37, 24).to(dtype)
            dx_r, dw_r = R.moe_grouped_linear_backward_reference(g, x, weight, off)
            close(MT._grouped(CPU, g, weight.transpose(1, 2), off, tiles), dx_r, tol, ("dx", dtype, counts))
            dw = MT._wgrad(CPU, g, x, off, 5, dtype, wtiles)
            close(dw, dw_r, tol, ("dw", dtype, counts))
            assert all(not dw[i].any() for i in range(5) if counts[i] == 0)
        # the plans with the shipped tiles (one tile covers these shapes)
        off = torch.tensor([0, 3, 3, 20, 36, 37])
        close(MT.grouped_forward(CPU, x, weight, off), R.moe_grouped_linear_reference(x, weight, off), tol, "plan")
        g = torch.randn(37, 24).to(dtype)
        for got, want in zip(MT.grouped_backward(CPU, g, x, weight, off),
                             R.moe_grouped_linear_backward_reference(g, x, weight, off)):
            close(got, want, tol, "plan backward")

        o, cw = torch.randn(9, 3, 50).to(dtype), torch.rand(9, 3)
        close(MT.combine_forward(CPU, o, cw), R.moe_combine_reference(o, cw), tol, "combine")
        g = torch.randn(9, 50).to(dtype)
        for got, want in zip(MT.combine_backward(CPU, g, o, cw), R.moe_combine_backward_reference(g, o, cw)):
            close(got, want, tol, "combine bwd")
    print("ok")
"""


def test_moe_triton_kernels_interpreted(run_interpreted):
    run_interpreted(SCRIPT, timeout=300)
