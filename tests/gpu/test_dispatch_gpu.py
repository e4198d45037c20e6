"""The rlk ops through the PyTorch dispatcher on a GPU (``torch.ops.rlk.<op>.default``, as Inductor's generated
code calls them in vLLM's uncaptured steps): plain CUDA tensors leave nothing below autograd but the CUDA kernel
(the op's Autograd kernel runs the implementation at once), and the bits, the backend and the readback are the
public op's — with grad on, under ``no_grad``, under ``inference_mode`` and under CUDA-graph capture."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rlk_core import ops
from rlk_core.ops import _dispatch as D
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.testing import assert_bitwise_equal
from rlk_core.testing.graphs import capture

from ._shapes import randn

pytestmark = pytest.mark.gpu


def _cases() -> dict[str, tuple]:
    q, cache = randn((4, 32, 128), seed=5), randn((64, 16, 8, 128), seed=6)
    table = torch.arange(64, dtype=torch.int32, device="cuda").view(4, 16)
    lens = torch.tensor([1, 77, 200, 256], dtype=torch.int32, device="cuda")
    return {
        "linear": (randn((64, 1024), seed=1), randn((3072, 1024), scale=1024 ** -0.5, seed=2), None),
        "rms_norm": (randn((64, 4096), seed=3), randn((4096,), seed=4), 1e-6),
        "swiglu": (randn((64, 2 * 3072), seed=7),),
        "rope": (randn((64, 32, 128), seed=8), torch.arange(64, device="cuda"), 1e6, 128),
        "attention_decode": (q, cache, cache, table, lens, 128 ** -0.5),
    }


def test_cuda_tensors_leave_nothing_but_the_cuda_kernel_below_autograd():
    x = randn((4, 64), seed=1)
    assert D._below_is_plain(torch._C._dispatch_keys(x))
    with torch.inference_mode():
        assert D._below_is_plain(torch._C._dispatch_keys(randn((4, 64), seed=2)))
    assert not D._below_is_plain(torch._C._dispatch_keys(torch.randn(2, dtype=torch.cfloat, device="cuda").conj()))


@pytest.mark.parametrize("op", ["linear", "rms_norm", "swiglu", "rope", "attention_decode"])
def test_torch_ops_give_the_public_ops_bits_and_backend(op):
    args = _cases()[op]
    if op == "rope":  # the table sized once, as vLLM's launcher does (no host sync per call)
        from rlk_core.ops.rope import reserve_tables

        reserve_tables(args[0].device, 128, 1e6, 4096)
    public = getattr(ops, op)
    packet = getattr(torch.ops.rlk, op).default
    module = "ffn" if op in ("linear", "swiglu") else "attention"
    for ctx in (contextlib.nullcontext, torch.no_grad, torch.inference_mode):
        rec = ReadbackRecorder("local", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="strict")
        with ctx(), rec.scope(module):
            want = public(*(args[:2] if op == "linear" else args))
            got = packet(*args)
        assert_bitwise_equal(got, want, f"{op} under {ctx.__name__}")
        record = rec.to_dict()["modules"][module]["ops"][op]
        assert record["call_count"] == 2 and "other_backends" not in record["provenance"], record
        assert record["backend_id"] in ("rlk.cuda", "rlk.triton") and not record["fallback"], record


def test_torch_ops_captured_in_inference_mode_replay_new_values_and_record_graph_mode():
    x, w = randn((64, 4096), seed=11), randn((4096,), seed=12)
    xs = randn((64, 2 * 3072), seed=13)
    rec = ReadbackRecorder("vllm", "rollout", RoutePlan("R/R", "R/R", "R/R"), mode="strict")
    with torch.inference_mode(), rec.scope("ffn"):
        graph, (y, s) = capture(lambda: (torch.ops.rlk.rms_norm.default(x, w, 1e-6), torch.ops.rlk.swiglu.default(xs)))
        x.copy_(randn(x.shape, seed=14))
        xs.copy_(randn(xs.shape, seed=15))
        graph.replay()
        assert_bitwise_equal(y, ops.rms_norm(x, w, 1e-6), "rms_norm replay")
        assert_bitwise_equal(s, ops.swiglu(xs), "swiglu replay")
    for op in ("rms_norm", "swiglu"):
        record = rec._ops["ffn"][op]
        assert record.modes == {"eager", "graph"} and not record.fallback, (op, record)
