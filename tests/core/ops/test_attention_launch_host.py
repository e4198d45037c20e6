"""Host-side helpers of the attention launchers, which replaced torch ops to save host time: they must
produce exactly the values the torch formulas did."""

from __future__ import annotations

import pytest
import torch

from rlk_core.ops.attention import triton as at


@pytest.mark.parametrize("scale", [128 ** -0.5, 64 ** -0.5, 24 ** -0.5, 0.125, 1 / 3, 1.0, 7.3, 1e-3])
def test_qk_scale_is_the_fp32_product(scale):
    expected = float(torch.tensor(scale, dtype=torch.float32) * torch.tensor(at.LOG2E, dtype=torch.float32))
    assert at.qk_scale_f32(scale) == expected


FIND_TILE = """
    import triton
    import triton.language as tl
    from rlk_core.ops.attention.triton import find_tile

    @triton.jit
    def probe(cu_ptr, out_ptr, B, TILE: tl.constexpr):
        pid = tl.program_id(0)
        seq, i, count, total = find_tile(pid, cu_ptr, B, TILE)
        tl.store(out_ptr + pid * 4 + tl.arange(0, 4), tl.where(tl.arange(0, 4) == 0, seq,
                 tl.where(tl.arange(0, 4) == 1, i, tl.where(tl.arange(0, 4) == 2, count, total))))

    g = torch.Generator().manual_seed(1)
    # more than one scan step (find_tile's SCHED = 128 sequences), empty sequences, one sequence
    for lens in ([5], [0, 1, 63, 64, 65, 128, 0, 200], torch.randint(0, 90, (300,), generator=g).tolist()):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        for tile in (16, 64):
            tiles = [(b, j, -(-n // tile)) for b, n in enumerate(lens) for j in range(-(-n // tile))]
            grid = -(-sum(lens) // tile) + len(lens)  # the launchers' upper bound
            out = torch.full((grid, 4), -1, dtype=torch.int32)
            probe[(grid,)](cu, out, len(lens), TILE=tile)
            assert (out[:, 3] == len(tiles)).all(), (lens, tile)
            assert [tuple(r) for r in out[: len(tiles), :3].tolist()] == tiles, (lens, tile)
    print("ok")
"""


def test_find_tile_maps_every_program_to_its_tile(run_interpreted):
    """The in-kernel schedule: program p < total gets the p-th tile in (sequence, tile) order, and every
    program sees the same total (the launchers' grids are upper bounds)."""
    run_interpreted(FIND_TILE, timeout=300)
