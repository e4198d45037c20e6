"""The MoE kernels (ops/moe/triton.py) compile for sm_90 on this CPU machine with their shipped tiles and the
specialisation of a launch on real tensors, without register spills or serialised wgmma (the helper of
test_kernels_compile_sm90.py); the grouped GEMM's dots are wgmma (64-row tiles)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _compile(kernel, constexprs, **kw):
    from .test_kernels_compile_sm90 import compile_sm90

    return compile_sm90(kernel, constexprs, **kw)


def _tile(cfg):
    cfg = dict(cfg)
    return cfg.pop("num_warps"), cfg.pop("num_stages"), cfg


def test_grouped_gemm_and_weight_gradient_compile_with_wgmma():
    from rlk_core.ops.moe import triton as MT

    warps, stages, cfg = _tile(MT.config(torch.bfloat16))
    ptx = _compile(MT._moe_grouped_fwd_kernel, {**cfg, "BLOCK_E": 128}, pointers={"off_ptr": "*i64"},
                   num_warps=warps, num_stages=stages, ones=("stride_wk",))
    assert "wgmma.mma_async" in ptx
    # dx: the weight read through its transposed view (unit stride along N)
    _compile(MT._moe_grouped_fwd_kernel, {**cfg, "BLOCK_E": 128}, pointers={"off_ptr": "*i64"}, num_warps=warps,
             num_stages=stages, ones=("stride_wn",))
    warps, stages, cfg = _tile(MT.wgrad_config(torch.bfloat16))
    _compile(MT._moe_wgrad_kernel, cfg, pointers={"off_ptr": "*i64"}, num_warps=warps, num_stages=stages)


@pytest.mark.parametrize("e,k", [(128, 8), (16, 2), (256, 6)])
def test_router_and_combine_kernels_compile(e, k):
    from rlk_core.ops.moe import triton as MT

    blocks = MT._topk_blocks(e, k)
    warps = blocks.pop("num_warps")
    ptrs = {"w_ptr": "*fp32", "id_ptr": "*i64"}
    _compile(MT._moe_topk_fwd_kernel, {**blocks, "TOP_K": k, "NORMALIZE": True}, pointers=ptrs, num_warps=warps)
    _compile(MT._moe_topk_bwd_kernel, {**blocks, "TOP_K": k, "NORMALIZE": False},
             pointers={**ptrs, "g_ptr": "*fp32"}, num_warps=warps)
    c = MT._combine_block(2048)
    warps = c.pop("num_warps")
    _compile(MT._moe_combine_fwd_kernel, {**c, "TOP_K": k}, pointers={"w_ptr": "*fp32"}, num_warps=warps)
    _compile(MT._moe_combine_bwd_kernel, {**c, "TOP_K": k}, pointers={"w_ptr": "*fp32", "dw_ptr": "*fp32"},
             num_warps=warps)
