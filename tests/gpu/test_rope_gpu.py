"""``rope`` on the GPU (backend ``rlk.triton``, contract ``rlk.rope.v1``)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import rope
from rlk_core.ops.rope.reference import rope_reference
from rlk_core.testing import assert_bitwise_equal, check_run_to_run, dtype_tols

from ._shapes import M_LIST, randn

pytestmark = pytest.mark.gpu
THETA = 1e6


def _positions(t: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 40000, (t,), device="cuda", generator=torch.Generator("cuda").manual_seed(seed))


def test_triton_backend_is_selected():
    x, pos = randn((3, 4, 128)), _positions(3, 0)
    # rlk.cuda (the same binaries, AOT-built) where rlk_core._C and the cubins are installed
    assert REGISTRY.select("rope", "cuda", (x, pos, THETA, 128), strict=True).backend.id in ("rlk.cuda", "rlk.triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,d,rd", [(32, 128, 128), (8, 128, 128), (3, 96, 64)])
def test_rope_batch_invariant(heads, d, rd, dtype):
    """A token alone equals the same token (same absolute position) at the first, middle and last
    place of batches of every size of the M list."""
    pool, pool_pos = randn((64, heads, d), dtype, seed=1), _positions(64, 2)
    probe, probe_pos = pool[5:6], pool_pos[5:6]
    alone = rope(probe, probe_pos, THETA, rd)
    for m in M_LIST:
        idx = torch.arange(m - 1, device="cuda") % 64
        for at in sorted({0, m // 2, m - 1}):
            x = torch.cat([pool[idx[:at]], probe, pool[idx[at:]]])
            pos = torch.cat([pool_pos[idx[:at]], probe_pos, pool_pos[idx[at:]]])
            assert_bitwise_equal(rope(x, pos, THETA, rd)[at:at + 1], alone, f"token alone vs at {at} of {m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,heads,d,rd", [(65, 32, 128, 128), (7, 8, 128, 64), (1, 3, 96, 96), (0, 2, 64, 64)])
def test_rope_matches_reference(t, heads, d, rd, dtype):
    x, pos = randn((t, heads, d), dtype, seed=3), _positions(t, 4)
    out, ref = rope(x, pos, THETA, rd), rope_reference(x, pos, THETA, rd)
    torch.testing.assert_close(out.double(), ref.double(), **dtype_tols(dtype))
    # same fp32 table, products then add/subtract without contraction, one rounding: same bits
    assert_bitwise_equal(out, ref, "rlk.triton rope vs the reference on the same GPU")


def test_rope_table_growth_keeps_bits():
    x, pos = randn((16, 8, 128), seed=5), _positions(16, 6) % 1000
    small = rope(x, pos, THETA, 128)
    rope(x[:1], torch.tensor([300_000], device="cuda"), THETA, 128)  # grows the cached table
    assert_bitwise_equal(rope(x, pos, THETA, 128), small, "before vs after the table grew")


def test_rope_noncontiguous_heads():
    qkv = randn((33, 48, 128), seed=7)
    q = qkv[:, :32]  # a view into a fused qkv output
    pos = _positions(33, 8)
    assert_bitwise_equal(rope(q, pos, THETA, 128), rope(q.contiguous(), pos, THETA, 128), "view vs copy")


def test_rope_forward_backward_run_to_run():
    x0, g, pos = randn((1000, 32, 128), seed=9), randn((1000, 32, 128), seed=10), _positions(1000, 11)

    def step():
        x = x0.clone().requires_grad_()
        y = rope(x, pos, THETA, 128)
        y.backward(g)
        return y, x.grad

    ok, detail = check_run_to_run(step, repeats=10)
    assert ok, detail


def test_rope_opcheck():
    torch.library.opcheck(torch.ops.rlk.rope.default, (randn((5, 4, 64)), _positions(5, 12), THETA, 64))
