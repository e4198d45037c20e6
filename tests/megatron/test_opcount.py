"""The device model of :class:`_opcount.SyncCounter` on plain torch code (no Megatron):
each rule of its docstring, with a counted case and a free one."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _opcount import SyncCounter


@pytest.fixture
def w():
    return torch.randn(4, 3, requires_grad=True)  # made before the counter: a device tensor


def _count(fn) -> list[tuple[str, str]]:
    with SyncCounter() as c:
        fn()
    return [(s.kind, s.op) for s in c.syncs]


def test_host_factories_are_free_device_factories_upload_only_data(w):
    assert _count(lambda: torch.tensor([1, 2]).cumsum(0).tolist()) == []
    assert _count(lambda: torch.tensor([1, 2], device="cpu").tolist()) == []
    assert _count(lambda: torch.tensor([1, 2], device=w.device)) == [("h2d", "tensor(data, device=...)")]
    assert _count(lambda: torch.arange(4, device=w.device).tolist()) == [("d2h", "tolist")]
    assert _count(lambda: torch.zeros(3, device=w.device) + 1) == []
    assert _count(lambda: w.new_tensor([1.0])) == [("h2d", "new_tensor(data, device=...)")]


def test_reads_of_device_values(w):
    assert _count(lambda: float(w.detach().sum())) == [("read", "aten::_local_scalar_dense")]
    assert _count(lambda: bool(w.sum() > 0)) == [("read", "aten::_local_scalar_dense")]
    assert _count(lambda: w.detach().tolist()) == [("d2h", "tolist")]
    assert _count(lambda: torch.equal(w, w)) == [("host value", "aten::equal")]
    assert _count(lambda: int(torch.tensor(3))) == []


def test_moves_keep_the_original_where_it_was(w):
    def host_then_device():
        h = torch.tensor([1, 2])
        d = h.to(w.device)  # a view stands for the GPU's copy: h stays a host tensor
        h.tolist()
        d.tolist()

    assert _count(host_then_device) == [("h2d", "to(device)"), ("d2h", "tolist")]

    def device_then_host():
        c = w.detach().cpu()
        c.tolist()  # already on the host: free
        w.detach().tolist()

    assert _count(device_then_host) == [("d2h", "cpu"), ("d2h", "tolist")]


def test_data_dependent_shapes(w):
    pos = torch.arange(3, device=w.device)
    assert _count(lambda: w[w > 0]) == [("shape", "aten::index")]
    assert _count(lambda: w.nonzero()) == [("shape", "aten::nonzero")]
    assert _count(lambda: torch.repeat_interleave(pos, pos)) == [("shape", "aten::repeat_interleave")]
    assert _count(lambda: torch.repeat_interleave(pos, pos, output_size=3)) == []
    assert _count(lambda: w[torch.tensor([0, 2])]) == [("h2d", "index with a host tensor")]
    assert _count(lambda: w[pos]) == []


def test_python_backward_is_seen_and_rng_states_are_host(w):
    class Fn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            g.sum().cpu()
            return g * 2

    assert _count(lambda: Fn.apply(w).sum().backward()) == [("d2h", "cpu")]
    assert _count(lambda: bool((torch.get_rng_state() == torch.get_rng_state()).all())) == []
