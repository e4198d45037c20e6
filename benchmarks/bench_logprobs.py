"""``linear_logprobs`` / ``token_logprobs`` (rlk.triton, rlk.logp.v1) vs the torch path, same process.

    python benchmarks/bench_logprobs.py [--quick]

Torch path: ``F.linear`` (cuBLAS) + ``log_softmax(logits.float())`` + ``gather`` (backward: autograd
through it). Reported per case: median times, ratio = torch time / rlk time (>= 1: rlk faster), and
the PEAK EXTRA MEMORY of each (``torch.cuda.max_memory_allocated`` during one call minus the memory
allocated before it: inputs, and for backward the saved forward state, are not counted). The GEMM
floor (``torch.mm`` alone, cuBLAS; and the rlk GEMM alone) is reported with each forward so the
ratio can be read against what the LM-head product alone costs.
"""

from __future__ import annotations

import argparse
import gc

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
from _common import MODELS, randn
from harness import copy_bandwidth, default_out_dir, environment, require_cuda, time_fns, write_results

from rlk_core.ops._plan import jit_plan
from rlk_core.ops.linear import triton as lt
from rlk_core.ops.linear_logprobs import linear_logprobs
from rlk_core.ops.token_logprobs import token_logprobs


def torch_path(h, w, y, t):
    logits = F.linear(h, w).float() / t[:, None]
    logp = torch.log_softmax(logits, -1).gather(1, y[:, None])[:, 0]
    return logp, logits.gather(1, y[:, None])[:, 0] - logp  # lse = z_t - logp (cheap, for backward)


def torch_token(x, y, t):
    z = x.float() / t[:, None]
    return torch.log_softmax(z, -1).gather(1, y[:, None])[:, 0]


def rlk_gemm(p, h, w):
    """The rlk.triton GEMM alone (``linear``'s launch plan run by ``p``, the JIT plan): the LM-head product."""
    return lt.forward(p, h, w, None)


def peak_extra(fn) -> int:
    """Bytes allocated at the peak of one call beyond what was allocated before it."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def fwd_bwd(fn, h0, w0, y, t):
    """A callable running forward + backward from fresh leaf tensors (the backward time is reported as
    forward + backward minus the forward timed alone)."""
    def step():
        h, w = h0.detach().requires_grad_(), w0.detach().requires_grad_()
        logp, lse = fn(h, w, y, t)
        (logp.sum() + 0.5 * lse.sum()).backward()
        return h.grad, w.grad
    return step


def bench_case(model: str, tt: int, hh: int, v: int, repeats: int) -> list[dict]:
    h = randn((tt, hh), seed=1)
    w = randn((v, hh), scale=2.0 * hh ** -0.5, seed=2)
    y = torch.randint(0, v, (tt,), device="cuda")
    t = torch.full((tt,), 1.0, device="cuda")
    flop = 2.0 * tt * v * hh
    p = jit_plan(h.device)
    r = {"case": f"{model} linear_logprobs fwd", "T": tt, "V": v, "H": hh}
    r["rlk_ms"] = time_fns([lambda: linear_logprobs(h, w, y, t)], repeats=repeats)["median_ms"]
    r["torch_ms"] = time_fns([lambda: torch_path(h, w, y, t)], repeats=repeats)["median_ms"]
    r["mm_floor_ms"] = time_fns([lambda: torch.mm(h, w.t())], repeats=repeats)["median_ms"]
    r["rlk_gemm_ms"] = time_fns([lambda: rlk_gemm(p, h, w)], repeats=repeats)["median_ms"]
    r["ratio"] = r["torch_ms"] / r["rlk_ms"]
    r["rlk_tflops"] = flop / r["rlk_ms"] / 1e9
    r["rlk_extra_gib"] = peak_extra(lambda: linear_logprobs(h, w, y, t)) / 2**30
    r["torch_extra_gib"] = peak_extra(lambda: torch_path(h, w, y, t)) / 2**30
    r["mem_ratio"] = r["torch_extra_gib"] / max(r["rlk_extra_gib"], 1e-9)
    print(r, flush=True)
    # forward + backward (backward = fwd+bwd minus fwd)
    rb = {"case": f"{model} linear_logprobs fwd+bwd", "T": tt, "V": v, "H": hh}
    rlk_step = fwd_bwd(linear_logprobs, h, w, y, t)
    torch_step = fwd_bwd(torch_path, h, w, y, t)
    rb["rlk_ms"] = time_fns([rlk_step], warmup=2, repeats=max(3, repeats // 2))["median_ms"]
    rb["torch_ms"] = time_fns([torch_step], warmup=2, repeats=max(3, repeats // 2))["median_ms"]
    rb["rlk_bwd_ms"] = rb["rlk_ms"] - r["rlk_ms"]
    rb["torch_bwd_ms"] = rb["torch_ms"] - r["torch_ms"]
    rb["ratio"] = rb["torch_ms"] / rb["rlk_ms"]
    rb["bwd_ratio"] = rb["torch_bwd_ms"] / rb["rlk_bwd_ms"]
    rb["mm_floor_ms"] = 3 * r["mm_floor_ms"]  # logits + dhidden + dW products
    rb["rlk_extra_gib"] = peak_extra(rlk_step) / 2**30
    rb["torch_extra_gib"] = peak_extra(torch_step) / 2**30
    rb["mem_ratio"] = rb["torch_extra_gib"] / max(rb["rlk_extra_gib"], 1e-9)
    print(rb, flush=True)
    # token_logprobs from materialised logits
    x = F.linear(h, w)
    rt = {"case": f"{model} token_logprobs fwd (bf16 logits)", "T": tt, "V": v, "H": hh}
    rt["rlk_ms"] = time_fns([lambda: token_logprobs(x, y, t)], repeats=repeats)["median_ms"]
    rt["torch_ms"] = time_fns([lambda: torch_token(x, y, t)], repeats=repeats)["median_ms"]
    rt["ratio"] = rt["torch_ms"] / rt["rlk_ms"]
    rt["rlk_extra_gib"] = peak_extra(lambda: token_logprobs(x, y, t)) / 2**30
    rt["torch_extra_gib"] = peak_extra(lambda: torch_token(x, y, t)) / 2**30
    rt["mem_ratio"] = rt["torch_extra_gib"] / max(rt["rlk_extra_gib"], 1e-9)
    rt["rlk_tbs"] = x.numel() * x.element_size() / rt["rlk_ms"] / 1e9
    print(rt, flush=True)
    return [r, rb, rt]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="T=8192 Qwen3-8B LM head forward and backward only")
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    require_cuda("bench_logprobs")
    env, copy = environment(), copy_bandwidth()
    v = MODELS["qwen3-8b"]["vocab"]
    cases = [("qwen3-8b", 8192, MODELS["qwen3-8b"]["hidden"])]
    if not args.quick:
        cases += [("qwen3-0.6b", 8192, MODELS["qwen3-0.6b"]["hidden"]), ("qwen3-8b", 1024, 4096)]
    rows = []
    for model, tt, hh in cases:
        rows += bench_case(model, tt, hh, v, args.repeats)
        gc.collect()
        torch.cuda.empty_cache()
    # is torch.log_softmax alone batch-invariant here? (measured, reported)
    x = randn((2048, v), scale=3.0, seed=5).float()
    ls_inv = bool(torch.equal(torch.log_softmax(x[:1], -1), torch.log_softmax(x, -1)[:1]))
    print("torch.log_softmax alone batch-invariant (row 0, M=1 vs M=2048, V=151936 fp32):", ls_inv)
    meta = {"env": env, "copy": copy, "repeats": args.repeats, "log_softmax_alone_batch_invariant": ls_inv,
            "ratio": "torch_ms / rlk_ms (>= 1: rlk faster)",
            "mem_ratio": "torch peak extra / rlk peak extra (target >= 8 for linear_logprobs fwd)",
            "torch": "F.linear + log_softmax(float) + gather (+ logsumexp), autograd for backward",
            "mm_floor_ms": "torch.mm alone (cuBLAS) for the forward; 3x that for forward + backward"}
    write_results(default_out_dir(), "logprobs", meta, rows,
                  [("case", "case"), ("T", "T"), ("H", "H"), ("rlk_ms", "rlk ms"), ("torch_ms", "torch ms"),
                   ("ratio", "ratio"), ("mm_floor_ms", "torch.mm floor ms"), ("rlk_gemm_ms", "rlk GEMM ms"),
                   ("rlk_bwd_ms", "rlk bwd ms"), ("torch_bwd_ms", "torch bwd ms"), ("bwd_ratio", "bwd ratio"),
                   ("rlk_extra_gib", "rlk extra GiB"), ("torch_extra_gib", "torch extra GiB"),
                   ("mem_ratio", "mem ratio")])


if __name__ == "__main__":
    main()
