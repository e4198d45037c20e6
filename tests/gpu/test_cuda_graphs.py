"""rlk ops under CUDA graph capture (vLLM captures its decode steps; Megatron can capture layers).

The launch paths must not synchronise with the device, and a replay after the captured buffers changed
in place — same shapes, new values: sequence boundaries, context lengths, block tables, activations —
must give the bits of an eager call on the new values. For attention that holds because each program
finds its tile on the device (``find_tile``), from the offsets of the replay, not of the capture."""

from __future__ import annotations

import pytest
import torch

from rlk_core.ops import linear
from rlk_core.ops._plan import jit_plan
from rlk_core.ops.attention import attention_decode, attention_varlen
from rlk_core.testing import assert_bitwise_equal
from rlk_core.testing.attention import build_paged_kv, cu_seqlens
from rlk_core.testing.graphs import capture

from ._shapes import randn

pytestmark = pytest.mark.gpu

SCALE = 128 ** -0.5


def test_decode_graph_replays_new_lengths_tables_and_queries():
    b, ctx, page = 8, 500, 16
    g = torch.Generator().manual_seed(3)
    k = [randn((ctx, 8, 128), seed=10 + i) for i in range(b)]
    v = [randn((ctx, 8, 128), seed=30 + i) for i in range(b)]
    cache = build_paged_kv(k, v, page, generator=g)
    q = randn((b, 32, 128), seed=1)
    table, lens = cache.block_table.clone(), torch.randint(1, ctx + 1, (b,), generator=g).to(torch.int32).cuda()
    def decode():
        return attention_decode(q, cache.k_cache, cache.v_cache, table, lens, SCALE)

    graph, out = capture(decode)
    graph.replay()
    assert_bitwise_equal(out, decode(), "replay as captured")
    perm = torch.randperm(b, generator=g).cuda()
    q.copy_(randn((b, 32, 128), seed=2))
    table.copy_(cache.block_table[perm])
    lens.copy_(torch.randint(1, ctx + 1, (b,), generator=g).to(torch.int32))
    graph.replay()
    assert_bitwise_equal(out, decode(), "replay after new queries, block tables and lengths")


def test_varlen_forward_backward_graph_replays_new_sequence_boundaries():
    t = 600
    cu = cu_seqlens([100, 250, 250], "cuda")
    leaves = [randn(s, seed=50 + i).requires_grad_() for i, s in enumerate([(t, 32, 128), (t, 8, 128), (t, 8, 128)])]
    grad = randn((t, 32, 128), seed=60)

    def step(xs):
        out = attention_varlen(*xs, cu, cu, SCALE)
        return (out, *torch.autograd.grad(out, xs, grad))

    graph, outs = capture(lambda: step(leaves))
    with torch.no_grad():
        for i, x in enumerate(leaves):
            x.copy_(randn(x.shape, seed=70 + i))
        grad.copy_(randn(grad.shape, seed=80))
        cu.copy_(cu_seqlens([300, 1, 299], "cuda"))  # same B and T, other boundaries
    graph.replay()
    # eager on fresh leaves: the captured leaves' gradient nodes belong to the capture's side stream
    fresh = [x.detach().clone().requires_grad_() for x in leaves]
    for name, got, want in zip(("out", "dq", "dk", "dv"), outs, step(fresh), strict=True):
        assert_bitwise_equal(got, want, f"{name}: replay with new sequence boundaries vs eager")


def test_linear_graph_replays_new_activations():
    x, w = randn((72, 4096), seed=90), randn((6144, 4096), scale=4096 ** -0.5, seed=91)  # a 64 + 16-row tail tile
    graph, y = capture(lambda: linear(x, w))
    x.copy_(randn(x.shape, seed=92))
    graph.replay()
    assert_bitwise_equal(y, linear(x, w), "linear replay with new activations")


def test_linear_row_split_graph_replays_new_activations():
    """A row split (8B qkv at TP 4, M = 4096: 128x256 tiles, then 128x128 tiles in a second launch made
    by programmatic dependent launch) captured and replayed gives the eager bits."""
    from rlk_core.ops.linear import triton as lt

    x, w = randn((4096, 4096), seed=93), randn((1536, 4096), scale=4096 ** -0.5, seed=94)
    assert lt.config(x.dtype, 4096, 1536, 4096, True, jit_plan(x.device).sms).get("SPLIT_ROWS")
    graph, y = capture(lambda: linear(x, w))
    x.copy_(randn(x.shape, seed=95))
    graph.replay()
    assert_bitwise_equal(y, linear(x, w), "split linear replay with new activations")


# the refused capture leaves an empty graph behind, which torch reports with a warning
@pytest.mark.filterwarnings("ignore:The CUDA Graph is empty")
def test_rope_graph_replays_new_positions_from_reserved_tables():
    """vLLM captures rope inside its decode graphs: the table is reserved for the model's length first
    (no host sync under capture), and a replay at other positions gives the eager bits."""
    from rlk_core.errors import RlkInputError
    from rlk_core.ops import rope
    from rlk_core.ops.rope import reserve_tables

    theta, d = 12345.0, 128
    reserve_tables("cuda", d, theta, 40_000)
    x = randn((64, 8, d), seed=96)
    pos = torch.arange(64, device="cuda", dtype=torch.int64)
    graph, y = capture(lambda: rope(x, pos, theta))
    pos.copy_(torch.randint(0, 40_000, (64,), device="cuda"))
    x.copy_(randn(x.shape, seed=97))
    graph.replay()
    assert_bitwise_equal(y, rope(x, pos, theta), "rope replay at new positions")
    # a table built by earlier calls (sized by their positions) is not trusted under capture: only a reserved one
    rope(x, pos, theta + 1.0)
    with pytest.raises(RlkInputError, match="reserve_tables"):
        capture(lambda: rope(x, pos, theta + 1.0))
