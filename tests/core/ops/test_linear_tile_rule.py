"""The GEMM tile rule (``rlk_core.ops.linear.tiles.config``) on the CPU, without Triton: the documented
choices for the Qwen3 shapes on a 132-SM H200, the pointer kernel wherever TMA does not apply, and a rule
that is a pure function of its arguments. That every tile gives the same bits is a GPU fact, checked by the
contract suite (``rlk_core.testing.contracts``) and tests/gpu/test_linear_gpu.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from rlk_core.ops.linear import tiles as lt


def _tile(m, n, k, tma=True, dtype=torch.bfloat16):
    c = lt.config(dtype, m, n, k, tma, 132)
    return ("tma" if c["TMA"] else "ptr", c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) + (
        (f"+{c['TAIL_M']}",) if c["TAIL_M"] else ())


def test_the_rule_imports_no_triton():
    code = ("import sys, torch\nfrom rlk_core.ops.linear import tiles\n"
            "tiles.config(torch.bfloat16, 65, 6144, 4096, True)\n"
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('triton.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@pytest.mark.parametrize("m,n,k,want", [
    (1, 4096, 4096, ("ptr", 16, 32, 128)),        # decode: narrow tiles put 128 programs on the weights
    (16, 24576, 4096, ("ptr", 16, 128, 128)),     # wide N fills the SMs with wider tiles
    (64, 6144, 4096, ("tma", 64, 64, 128)),
    (128, 151936, 4096, ("tma", 128, 256, 64)),   # M in 65..128 and a wide N: one 128-row tile
    (128, 1024, 2048, ("tma", 64, 32, 256)),
    (1000, 4096, 4096, ("tma", 128, 256, 64)),    # one full wave of 128x256 tiles
    (1000, 6144, 4096, ("tma", 128, 128, 64)),    # 1.45 waves of 128x256: 128x128 fills better
    (65, 6144, 4096, ("tma", 64, 64, 128, "+16")),  # 65 <= M <= 80, weight not in L2: one 64+16-row tile
    (80, 4096, 12288, ("tma", 64, 32, 256, "+16")),
    (72, 24576, 4096, ("tma", 64, 64, 128, "+16")),  # 64+16 x 128 would leave 1.45 waves
    (65, 151936, 4096, ("tma", 64, 128, 64, "+16")),
    (65, 1536, 4096, ("tma", 64, 32, 256)),       # small weight (in L2): two 64-row tiles
    (81, 6144, 4096, ("tma", 128, 64, 128)),
    (96, 6144, 4096, ("tma", 128, 64, 128)),
    (1000, 3072, 4096, ("tma", 128, 256, 64)),    # 12.6M-element weight: 128x64 re-reads it from HBM
    (1000, 1024, 3072, ("tma", 128, 64, 128)),    # small weight (in L2): 128x64 fills the SMs
    (8192, 1024, 3072, ("tma", 128, 256, 64)),
])
def test_documented_choices(m, n, k, want):
    assert _tile(m, n, k) == want


def test_pointer_kernel_without_tma_and_for_fp32():
    for m in (1, 7, 65, 128, 1000, 8192):
        assert _tile(m, 4096, 4096, tma=False)[0] == "ptr"
        assert _tile(m, 4096, 4096, dtype=torch.float32)[:2] == ("ptr", 64)


@pytest.mark.parametrize("m,n,k,want", [
    (4096, 1536, 4096, (2816, 128)),  # 8B qkv at TP 4: one wave of 128x256, then 0.9 of a wave of 128x128
    (3000, 1536, 4096, (2816, 64)),   # the rest (184 rows) fills the SMs better with 128x64
    (2048, 3072, 4096, (1408, 128)),  # 8B qkv at TP 2
    (8192, 1536, 4096, None),         # 2.9 waves of 128x256: no split
    (6000, 1024, 2048, None),         # estimated 211 K-units faster split: within the gap's margin
    (4096, 37984, 1024, None),        # 0.6B lm_head at TP 4: estimated 364 faster, measured 2% slower
    (3000, 2048, 1024, None),
])
def test_row_split_choices(m, n, k, want):
    """M > 128: whole waves of 128x256 tiles and a second launch for the rest, where estimated faster."""
    c = lt.config(torch.bfloat16, m, n, k, True, 132)
    got = (c["SPLIT_ROWS"], c["REST"]["BLOCK_N"]) if "SPLIT_ROWS" in c else None
    assert got == want
    if got:
        assert (c["BLOCK_M"], c["BLOCK_N"]) == (128, 256) and got[0] % 128 == 0
        assert lt._tiles(got[0], n, (128, 256)) % 132 == 0  # the 128x256 part is whole waves


def test_last_box_rows():
    """64-row tiles read a last row block of fewer than 32 rows with a 16/32-row box; nothing else does."""
    assert [lt.rem_rows(m, 64) for m in (1, 16, 17, 31, 32, 63, 64, 65, 80, 81, 95, 96, 127)] == [
        16, 16, 32, 32, 0, 0, 0, 16, 16, 32, 32, 0, 0]
    assert all(lt.rem_rows(m, 128) == 0 for m in range(1, 513))


def _stored(m, n, tma=True, dtype=torch.bfloat16, f32_out=False):
    c = lt.stored_config(dtype, m, n, tma, 132, f32_out)
    return ("tma" if c["TMA"] else "ptr", c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"])


@pytest.mark.parametrize("m,n,want", [
    # dx (rows = the token count, never read): the least padded columns per unit of rate
    (None, 1024, ("tma", 128, 256, 64)), (None, 3072, ("tma", 128, 256, 64)), (None, 2048, ("tma", 128, 256, 64)),
    (None, 320, ("tma", 128, 64, 128)), (None, 100, ("tma", 128, 128, 64)),
    # dW of the 0.6B projections at TP 1 (rows: the weight's): the least estimated time in whole waves
    (4096, 1024, ("tma", 128, 256, 64)),   # qkv: 128 tiles of 128x256, one wave
    (1024, 2048, ("tma", 128, 128, 64)),   # o: 64 tiles of 128x256 would leave half the SMs idle
    (6144, 1024, ("tma", 128, 128, 64)),   # gate_up: 2.9 waves of 128x128 beat 1.45 (counted 2) of 128x256
    (1024, 3072, ("tma", 128, 64, 128)),   # down: 384 tiles of 128x64 in 2.9 waves
    (1024, 1, ("ptr", 64, 16, 128)),       # db: one column, pointer kernel
])
def test_stored_layout_choices(m, n, want):
    assert _stored(m, n) == want


def test_stored_layout_pointer_and_fp32_and_fp32_outputs():
    assert _stored(None, 1024, tma=False) == ("ptr", 128, 128, 64)
    assert _stored(4096, 1024, dtype=torch.float32) == ("ptr", 64, 64, 32)
    assert _stored(4096, 16, dtype=torch.float32) == ("ptr", 64, 16, 32)
    assert _stored(None, 1024, f32_out=True) == ("tma", 128, 128, 64)  # 128x256 with an fp32 output: too big
    assert lt.stored_config(torch.float32, None, 1024, True)["IEEE"]
    assert set(lt.stored_tiles(torch.bfloat16)) >= {e[0] for e in lt._STORED_TMA}
