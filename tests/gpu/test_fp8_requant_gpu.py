"""The FP8 weight sync's re-quantization (``rlk_repro.engine.fp8.quantize_per_tensor``) against vLLM's CUDA
``ops.scaled_fp8_quant(w, scale=None)`` — the call vLLM's online FP8 loader makes — bit for bit on the GPU, at the
Qwen3-0.6B layer shapes (TP 1) and awkward ones; the negative control: the new weights quantized with the old
weights' scale (a sync that forgot the scale) differ, and the same check sees it (issue 38)."""

from __future__ import annotations

import pytest
import torch

from rlk_repro.engine import fp8

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

# (out, in): Qwen3-0.6B's qkv_proj, o_proj, gate_up_proj, down_proj; then awkward shapes
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1, 1), (5, 123), (19, 99), (989, 17)]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_requantization_equals_vllm_scaled_fp8_quant_bitwise(shape):
    from vllm import _custom_ops as ops

    g = torch.Generator(device="cuda").manual_seed(shape[0] * 7 + shape[1])
    w = (torch.randn(shape, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
    w.view(-1)[w.numel() // 2] = 0.75  # an outlier sets the scale: most values land in e4m3's subnormals
    q, s = fp8.quantize_per_tensor(w)
    rq, rs = ops.scaled_fp8_quant(w, scale=None)
    assert rq.dtype == q.dtype == torch.float8_e4m3fn
    assert torch.equal(s, rs.reshape(1)), (float(s), float(rs))
    assert torch.equal(_bytes(q), _bytes(rq)), int((_bytes(q) != _bytes(rq)).sum())
    if w.numel() > 1:
        _, old_s = fp8.quantize_per_tensor((w.float() * 1.5).to(torch.bfloat16))
        stale = (w.float() / old_s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float8_e4m3fn)
        assert not torch.equal(_bytes(stale), _bytes(rq))


def test_vllm_quantizer_is_available_on_cuda():
    """The sync's runtime check (every layer against vLLM's kernel) is on where the FP8 rollout runs."""
    assert fp8.vllm_quantizer() is not None
    assert fp8.device_problem() is None, fp8.device_problem()
