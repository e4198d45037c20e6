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


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tile_counts(dtype):
    g = torch.Generator().manual_seed(0)
    for lens in ([5], [0, 1, 63, 64, 65, 128, 0, 200], torch.randint(0, 300, (37,), generator=g).tolist()):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=dtype)
        for tile in (1, 16, 64, 128):
            counts = at.tile_counts(cu, tile)
            expected, total = [], 0
            for n in lens:
                total += -(-n // tile)
                expected.append(total)
            assert counts.dtype == torch.int32 and counts.tolist() == expected, (lens, tile)
