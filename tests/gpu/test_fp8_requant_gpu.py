"""The FP8 weight sync's re-quantization (``rlk_repro.engine.fp8.quantize_per_tensor``) against vLLM's CUDA
``ops.scaled_fp8_quant(w, scale=None)`` — the call vLLM's online FP8 loader makes — bit for bit on the GPU, at the
Qwen3-0.6B layer shapes (TP 1) and awkward ones; the negative control: the new weights quantized with the old
weights' scale (a sync that forgot the scale) differ, and the same check sees it (issue 38). vLLM is imported in a
fresh process (as the framework tests do): its import-time warnings are not this test's."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

SCRIPT = r'''
import torch
from vllm import _custom_ops as ops
from rlk_repro.engine import fp8

def u8(t):
    return t.contiguous().view(torch.uint8)

# (out, in): Qwen3-0.6B's qkv_proj, o_proj, gate_up_proj, down_proj; then awkward shapes
for shape in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1, 1), (5, 123), (19, 99), (989, 17)]:
    g = torch.Generator(device="cuda").manual_seed(shape[0] * 7 + shape[1])
    w = (torch.randn(shape, device="cuda", generator=g) * 0.03).to(torch.bfloat16)
    w.view(-1)[w.numel() // 2] = 0.75  # an outlier sets the scale: most values land in e4m3's subnormals
    q, s = fp8.quantize_per_tensor(w)
    rq, rs = ops.scaled_fp8_quant(w, scale=None)
    assert rq.dtype == q.dtype == torch.float8_e4m3fn
    assert torch.equal(s, rs.reshape(1)), (shape, float(s), float(rs))
    assert torch.equal(u8(q), u8(rq)), (shape, int((u8(q) != u8(rq)).sum()))
    if w.numel() > 1:
        _, old_s = fp8.quantize_per_tensor((w.float() * 1.5).to(torch.bfloat16))
        stale = (w.float() / old_s).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(torch.float8_e4m3fn)
        assert not torch.equal(u8(stale), u8(rq)), shape
    print("equal", shape)
assert fp8.vllm_quantizer() is not None  # the sync's runtime check is on where the FP8 rollout runs
assert fp8.device_problem() is None, fp8.device_problem()
print("ok")
'''


def test_requantization_equals_vllm_scaled_fp8_quant_bitwise():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(SCRIPT)], capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.count("equal ") == 8
