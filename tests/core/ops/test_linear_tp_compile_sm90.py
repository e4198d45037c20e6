"""linear_tp_partials' kernel compiles for sm_90 on this CPU machine with every tile its rule picks and every leaf
count up to 8, without register spills or serialised wgmma (ptxas's report; the helper of
test_kernels_compile_sm90.py)."""

import importlib.util

import pytest
import torch

from .test_kernels_compile_sm90 import compile_sm90

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_tp_kernel_compiles_without_spills(dtype):
    from rlk_core.ops.linear_tp import triton as T

    tiles = [T._FP32] if dtype == torch.float32 else [T._DECODE, T._ROWS]
    name = "*fp32" if dtype == torch.float32 else "*bf16"
    for tile in tiles:
        for leaves in (1, 8) if dtype == torch.bfloat16 else (8,):
            c = T.tile_config(tile, 512, dtype)
            ptx = compile_sm90(T._linear_tp_fwd_kernel,
                               dict(LEAVES=leaves, EVEN_K=True, IEEE=c["IEEE"], BLOCK_M=c["BLOCK_M"],
                                    BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"]),
                               pointers={"x_ptr": name, "w_ptr": name, "y_ptr": "*fp32"}, num_warps=c["num_warps"],
                               num_stages=c["num_stages"], ones=("stride_xk", "stride_wk", "stride_yn"))
            if dtype == torch.bfloat16:
                assert ("wgmma" in ptx) == (tile[0] >= 64), (tile, leaves)

