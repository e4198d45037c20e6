"""linear_tp_partials' and linear_tp's kernels compile for sm_90 on this CPU machine with every (variant, tile) the
rule or the benchmark picks and every leaf count up to 8, without register spills or serialised wgmma (ptxas's
report; the helper of test_kernels_compile_sm90.py) — the fp32 partial's store and the finished one (bias added,
one rounding to the dtype, canonical NaN: linear_tp at TP 1)."""

import importlib.util

import pytest
import torch

from .test_kernels_compile_sm90 import compile_sm90

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
# (FINISH, HAS_BIAS): the partial; finished without and with a bias
STORES = ((False, False), (True, False), (True, True))


def _compile(T, kernel, c, name, finish=False, bias=False, **extra):
    out = name if finish else "*fp32"
    ptrs = {"x_ptr": name, "w_ptr": name, "y_ptr": out, "b_ptr": name if bias else out, "ws_ptr": "*fp32"}
    constexprs = dict(EVEN_K=True, IEEE=c["IEEE"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"],
                      GROUP_M=c["GROUP_M"], FINISH=finish, HAS_BIAS=bias, **extra)
    return compile_sm90(kernel, constexprs, pointers=ptrs, num_warps=c["num_warps"], num_stages=c["num_stages"],
                        ones=("stride_xk", "stride_wk", "stride_yn"))


@pytest.mark.parametrize("finish, bias", STORES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_kernel_compiles_without_spills(dtype, finish, bias):
    from rlk_core.ops.linear_tp import triton as T

    tiles = [T._FP32] if dtype == torch.float32 else list(T.TILES["fused"])
    name = "*fp32" if dtype == torch.float32 else "*bf16"
    for tile in tiles:
        for leaves in (1, 8) if dtype == torch.bfloat16 else (8,):
            ptx = _compile(T, T._linear_tp_fwd_kernel, T.tile_config(tile, 512, dtype), name, finish, bias,
                           LEAVES=leaves)
            if dtype == torch.bfloat16:
                assert ("wgmma" in ptx) == (tile[0] >= 64), (tile, leaves)


@pytest.mark.parametrize("finish, bias", STORES)
def test_split_kernels_compile_without_spills(finish, bias):
    from rlk_core.ops.linear_tp import triton as T

    for tile in T.TILES["split"]:  # the leaf kernel finishes only at one leaf, where it writes the output itself
        ptx = _compile(T, T._linear_tp_leaf_kernel, T.tile_config(tile, 512, torch.bfloat16), "*bf16", finish, bias)
        assert ("wgmma" in ptx) == (tile[0] >= 64), tile
    _compile(T, T._linear_tp_leaf_kernel, T.tile_config(T._FP32, 512, torch.float32), "*fp32", finish, bias)
    for leaves in (2, 8):
        for name in ("*bf16", "*fp16", "*fp32"):
            out = name if finish else "*fp32"
            compile_sm90(T._linear_tp_merge_kernel,
                         dict(LEAVES=leaves, FINISH=finish, HAS_BIAS=bias, BLOCK=T.MERGE_BLOCK),
                         pointers={"ws_ptr": "*fp32", "y_ptr": out, "b_ptr": name if bias else "*fp32"}, num_warps=4)


@pytest.mark.parametrize("finish, bias", STORES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_stash_kernel_compiles_without_spills(dtype, finish, bias):
    from rlk_core.ops.linear_tp import triton as T

    tile = T._FP32 if dtype == torch.float32 else T._STASH
    name = "*fp32" if dtype == torch.float32 else "*bf16"
    for leaves in (8,) if dtype == torch.float32 else (1, 8):
        ptx = _compile(T, T._linear_tp_stash_kernel, T.tile_config(tile, 512, dtype), name, finish, bias,
                       LEAVES=leaves, SLOTS=T.slots(leaves), NUM_PROGRAMS=132)
        if dtype == torch.bfloat16:
            assert "wgmma" in ptx


def test_the_finished_bf16_store_rounds_on_the_bits():
    """The finished bf16 epilogue: integer rounding (no cvt.rn.bf16.f32 of a NaN, whose bits are the GPU's own) and the
    canonical NaN 0x7FC0 as an immediate."""
    from rlk_core.ops.linear_tp import triton as T

    ptx = compile_sm90(T._linear_tp_merge_kernel, dict(LEAVES=8, FINISH=True, HAS_BIAS=True, BLOCK=T.MERGE_BLOCK),
                       pointers={"ws_ptr": "*fp32", "y_ptr": "*bf16", "b_ptr": "*bf16"}, num_warps=4)
    assert "cvt.rn.bf16.f32" not in ptx and "selp.b16" in ptx and "0x7FC0" in ptx
