"""``rope`` on the GPU (backend ``rlk.triton``, contract ``rlk.rope.v1``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from rlk_core.backends import REGISTRY
from rlk_core.ops import rope
from rlk_core.ops.rope.reference import rope_backward_reference, rope_reference
from rlk_core.testing import assert_bitwise_equal, check_run_to_run, dtype_tols

from ._shapes import M_LIST, RLK_GPU, randn

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


# -- backward: rope_backward on rlk.triton (the forward's kernel with sin negated, on the forward's table) --------
def _grad(t, heads, d, dtype=torch.bfloat16, seed=20):
    return randn((t, heads, d), dtype, seed=seed)


def test_backward_runs_rlk_triton_from_autograd():
    x, g, pos = randn((65, 16, 128), seed=21), _grad(65, 16, 128), _positions(65, 22)
    sel = REGISTRY.select("rope_backward", "cuda", (g, pos, THETA, 128), strict=True)
    assert sel.backend.id in RLK_GPU and sel.fallback_reason is None
    xx = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(rope(xx, pos, THETA, 128), (xx,), g)
    assert_bitwise_equal(dx, sel.backend.fn(g, pos, THETA, 128), "autograd dx vs the selected backward")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,heads,d,rd", [(4096, 16, 128, 128), (65, 32, 128, 128), (7, 8, 128, 64), (1, 3, 96, 96),
                                          (3, 2, 96, 64)])
def test_backward_equals_reference_bitwise(t, heads, d, rd, dtype):
    """Same fp32 table rows, products then add/subtract without contraction, one rounding: the reference
    backward's bits on the same GPU (within tolerance too, for the report)."""
    g, pos = _grad(t, heads, d, dtype), _positions(t, 23)
    dx, ref = torch.ops.rlk.rope_backward(g, pos, THETA, rd), rope_backward_reference(g, pos, THETA, rd)
    torch.testing.assert_close(dx.double(), ref.double(), **dtype_tols(dtype))
    assert_bitwise_equal(dx, ref, "rlk.triton rope backward vs the reference on the same GPU")


def test_backward_non_contiguous_grad_and_run_to_run():
    g = randn((33, 48, 128), seed=24)[:, :32]
    pos = _positions(33, 25)
    assert_bitwise_equal(torch.ops.rlk.rope_backward(g, pos, THETA, 128),
                         torch.ops.rlk.rope_backward(g.contiguous(), pos, THETA, 128), "view vs copy")
    g, pos = _grad(4096, 16, 128), _positions(4096, 26)
    ok, detail = check_run_to_run(lambda: torch.ops.rlk.rope_backward(g, pos, THETA, 128), repeats=10)
    assert ok, detail


def _no_sync(fn):
    """Run ``fn`` with torch's sync debug mode set to raise on any host-device synchronisation."""
    torch.cuda.synchronize()
    try:
        _sync_debug_mode("error")
        return fn()
    finally:  # also where setting it raised: a mode left on fails every later test's syncs
        _sync_debug_mode("default")


def _sync_debug_mode(mode: str) -> None:
    with warnings.catch_warnings():  # torch warns that the mode is a prototype: an error under pytest's config
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)


def test_reserved_table_forward_and_backward_never_sync():
    """With the table reserved (what the Megatron provider and vLLM do at build), a training step's rope —
    forward and backward through autograd — makes no host sync. Controls: the same step on an unreserved
    theta syncs in the forward (sizing the table from the positions), and a backward with no cached table
    builds one (a sync)."""
    from rlk_core.ops.rope import reserve_tables

    theta = 2468.0
    reserve_tables("cuda", 128, theta, 40960)
    x, g, pos = randn((4096, 16, 128), seed=27), _grad(4096, 16, 128), _positions(4096, 28)

    def step(th):
        xx = x.clone().requires_grad_()
        return torch.autograd.grad(rope(xx, pos, th, 128), (xx,), g)[0]

    warm = step(theta)  # compiles the kernels outside the sync check
    assert_bitwise_equal(_no_sync(lambda: step(theta)), warm, "a step without syncs vs the warm-up step")
    with pytest.raises(RuntimeError, match="synchroniz"):
        _no_sync(lambda: step(theta + 1.0))
    with pytest.raises(RuntimeError, match="synchroniz"):
        _no_sync(lambda: torch.ops.rlk.rope_backward(g, pos, theta + 2.0, 128))


def test_positions_past_a_reserved_table_give_nan_or_raise(monkeypatch):
    """A reserved table too short for a position: that token's outputs are NaN (every dim, forward and
    backward) and the others keep their bits — no out-of-bounds read; RLK_VALUE_CHECKS=always raises."""
    from rlk_core.errors import RlkInputError
    from rlk_core.ops.rope import reserve_tables

    theta = 1357.0
    reserve_tables("cuda", 64, theta, 4096)  # 4096 rows
    x, g = randn((6, 4, 96), seed=29), _grad(6, 4, 96)
    pos = torch.tensor([0, 4095, 4096, 17, 1_000_000, 3], device="cuda")
    inside = torch.tensor([True, True, False, True, False, True], device="cuda")
    for out, ref in ((rope(x, pos, theta, 64), rope_reference(x[inside], pos[inside], theta, 64)),
                     (torch.ops.rlk.rope_backward(g, pos, theta, 64),
                      rope_backward_reference(g[inside], pos[inside], theta, 64))):
        assert torch.isnan(out[~inside]).all() and not torch.isnan(out[inside]).any()
        assert_bitwise_equal(out[inside], ref, "tokens inside the table")
    monkeypatch.setenv("RLK_VALUE_CHECKS", "always")
    with pytest.raises(RlkInputError, match="past the reserved cos/sin table"):
        rope(x, pos, theta, 64)


def _allocated(ptr: int) -> bool:
    """Whether the caching allocator holds the block at ``ptr`` as allocated to a live tensor."""
    for seg in torch.cuda.memory_snapshot():
        for block in seg["blocks"]:
            if block["address"] <= ptr < block["address"] + block["size"]:
                return block["state"] == "active_allocated"
    return False


@pytest.mark.parametrize("retire", [True, False], ids=["retired", "control-freed"])
def test_a_longer_reservation_keeps_the_table_a_graph_captured(monkeypatch, retire):
    """vLLM captures rope on its reserved table; a colocated trainer then reserves a longer one. The table
    the graph reads stays allocated (retired, not freed) and a replay gives the eager bits. Control: with
    retirement disabled the replaced table's memory is freed under the graph (what the retirement
    prevents), seen in the allocator's own snapshot."""
    from rlk_core.ops import _plan
    from rlk_core.ops.rope import reserve_tables
    from rlk_core.ops.rope import triton as rope_triton
    from rlk_core.testing.graphs import capture

    if not retire:
        class Dropped(list):
            def append(self, item):
                pass
        monkeypatch.setattr(rope_triton, "_RETIRED", Dropped())
        monkeypatch.setattr(_plan, "_HELD", Dropped())  # a held table is kept alive as well
    theta = 9753.0 + retire
    reserve_tables("cuda", 128, theta, 4096)
    old = [t.data_ptr() for t in rope_triton.reserved_tables(torch.device("cuda", 0), 128, theta)]
    x, pos = randn((64, 8, 128), seed=35), _positions(64, 36) % 4096
    graph, y = capture(lambda: rope(x, pos, theta))
    reserve_tables("cuda", 128, theta, 70_000)  # the trainer's longer reservation
    assert rope_triton.reserved_tables(torch.device("cuda", 0), 128, theta)[0].data_ptr() not in old
    assert all(_allocated(p) for p in old) is retire
    if retire:
        x.copy_(randn(x.shape, seed=37))
        graph.replay()
        assert_bitwise_equal(y, rope(x, pos, theta), "replay on the retired table vs eager on the grown one")
