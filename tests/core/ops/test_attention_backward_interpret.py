"""The ``rlk.triton`` attention backward kernels under the Triton interpreter (CPU) at tiny shapes, against
``attention_varlen_backward_reference``: packed lengths, GQA, chunk continuation, an empty chunk, arbitrary
``q_positions``, non-causal, and both dK/dV schedules (``SPLIT_G``). fp32 and fp16 only: the interpreter's
bf16 ``tl.dot`` is wrong (numpy has no bf16), so bf16 is covered by
``tests/gpu/test_attention_backward_gpu.py``. ``TRITON_INTERPRET`` must be set before Triton is imported, so
the check runs in a subprocess.
"""

from __future__ import annotations

_SCRIPT = '''
    from rlk_core.ops.attention.reference import attention_varlen_backward_reference as ref
    from rlk_core.ops.attention.triton_backward import attention_varlen_backward, config
    from rlk_core.testing import dtype_tols

    def case(lq, lk, hq, hkv, d, dtype, causal=True, positions=False, seed=0, split=None):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
        k = torch.randn(sum(lk), hkv, d, generator=g).to(dtype)
        v = torch.randn(sum(lk), hkv, d, generator=g).to(dtype)
        do = torch.randn(sum(lq), hq, d, generator=g).to(dtype)
        cq = torch.tensor([0] + torch.tensor(lq).cumsum(0).tolist(), dtype=torch.int32)
        ck = torch.tensor([0] + torch.tensor(lk).cumsum(0).tolist(), dtype=torch.int32)
        pos = None
        if positions:
            pos = torch.cat([torch.randperm(b, generator=g)[:a] for a, b in zip(lq, lk)])
        cfg = config(dtype, d)
        if split is not None:  # both dK/dV schedules: per KV head, or per query head + group sum
            cfg["dkdv"]["SPLIT_G"] = split
        out = attention_varlen_backward(CPU, do, q, k, v, cq, ck, d ** -0.5, causal, pos, cfg)
        want = ref(do, q, k, v, cq, ck, d ** -0.5, causal, pos)
        rtol = dtype_tols(dtype)["rtol"]
        for name, a, b in zip(("dq", "dk", "dv"), out, want):
            rel = float((a.double() - b.double()).norm() / b.double().norm())
            assert rel <= rtol, (name, lq, lk, dtype, causal, positions, rel)
            print(name, lq, lk, dtype, causal, positions, f"{rel:.2e}")

    case([1, 0, 19, 40], [1, 5, 30, 100], 4, 2, 24, torch.float32, seed=1)
    case([10, 23], [40, 90], 2, 2, 32, torch.float32, positions=True, seed=2)
    for split in (False, True):
        case([7, 20], [40, 150], 4, 2, 16, torch.float16, seed=4, split=split)
        case([10, 23], [40, 90], 2, 1, 32, torch.float32, positions=True, seed=6, split=split)
    case([30, 3], [140, 9], 2, 1, 16, torch.float16, causal=False, seed=5)
    print("ok")
'''


def test_backward_kernels_under_interpreter(run_interpreted):
    run_interpreted(_SCRIPT, timeout=120)
