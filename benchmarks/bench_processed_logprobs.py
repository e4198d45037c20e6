"""Processed log-probs (contract ``rlk.logp.processed.v1``) on the GPU, same process.

    python benchmarks/bench_processed_logprobs.py [--repeats N]

1. Trainer: fused ``linear_logprobs(..., kept=K)`` vs rlk's unfiltered fused op (forward, forward + backward),
   target <= 1.05x time, and its peak extra memory (O(T x 256) logits chunks, never [T, V]).
2. Sampler: one decode step's filtering at batch B — rlk's ``kept_set`` + ``apply_kept`` + the processed
   ``token_logprobs`` vs the torch path vLLM runs without FlashInfer (``apply_top_k_top_p``: sort, softmax,
   cumsum, scatter; then ``log_softmax`` + gather), same logits, top_k 40 / top_p 0.95; and the step's parts
   (the kept set on its backend and as the reference's torch ops, ``apply_kept``, the processed log-prob).
The kept-set statistics of the benchmark's random logits are reported with each case.
"""

from __future__ import annotations

import argparse
import gc

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
from _common import MODELS, randn
from bench_logprobs import fwd_bwd, peak_extra
from harness import copy_bandwidth, default_out_dir, environment, require_cuda, time_fns, write_results

from rlk_core.backends import REGISTRY
from rlk_core.ops import apply_kept, kept_set
from rlk_core.ops.kept_set.reference import PATH_TOP_K, kept_set_reference
from rlk_core.ops.linear_logprobs import linear_logprobs
from rlk_core.ops.token_logprobs import token_logprobs

TOP_K, TOP_P = 40, 0.95


def native_filter(z: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM's torch top-k/top-p (``apply_top_k_top_p`` without FlashInfer), written out: sort ascending, the
    k-th largest as the top-k cut, softmax + cumsum for top-p, scatter back."""
    s, idx = z.sort(dim=-1, descending=False)
    s = s.masked_fill(s < s[:, -k:-k + 1], float("-inf"))
    cut = s.softmax(-1).cumsum(-1) <= 1 - p
    cut[:, -1] = False
    return torch.empty_like(z).scatter(-1, idx, s.masked_fill(cut, float("-inf")))


def stats(size: torch.Tensor) -> dict:
    s = size.float()
    return {"kept_mean": float(s.mean()), "kept_median": float(s.median()),
            "kept_singletons": float((size == 1).float().mean())}


def trainer_case(tt: int, hh: int, v: int, repeats: int) -> list[dict]:
    h = randn((tt, hh), seed=1)
    w = randn((v, hh), scale=2.0 * hh ** -0.5, seed=2)
    t = torch.full((tt,), 1.0, device="cuda")
    logits = F.linear(h, w)
    ks = kept_set(logits, t, TOP_K, TOP_P)
    y = torch.where(torch.isfinite(apply_kept(logits, t, ks)), torch.arange(v, device="cuda"), -1).amax(-1)
    del logits
    rows = []
    r = {"case": f"linear_logprobs fwd T={tt} H={hh}", **stats(ks.size)}
    r["processed_ms"] = time_fns([lambda: linear_logprobs(h, w, y, t, kept=ks)], repeats=repeats)["median_ms"]
    r["unfiltered_ms"] = time_fns([lambda: linear_logprobs(h, w, y, t)], repeats=repeats)["median_ms"]
    r["time_ratio"] = r["processed_ms"] / r["unfiltered_ms"]
    r["processed_extra_gib"] = peak_extra(lambda: linear_logprobs(h, w, y, t, kept=ks)) / 2**30
    r["unfiltered_extra_gib"] = peak_extra(lambda: linear_logprobs(h, w, y, t)) / 2**30
    print(r, flush=True)
    rows.append(r)
    rb = {"case": f"linear_logprobs fwd+bwd T={tt} H={hh}", **stats(ks.size)}

    def processed(hh_, ww_, yy, tt_):
        return linear_logprobs(hh_, ww_, yy, tt_, kept=ks)
    rb["processed_ms"] = time_fns([fwd_bwd(processed, h, w, y, t)], warmup=2,
                                  repeats=max(3, repeats // 2))["median_ms"]
    rb["unfiltered_ms"] = time_fns([fwd_bwd(linear_logprobs, h, w, y, t)], warmup=2,
                                   repeats=max(3, repeats // 2))["median_ms"]
    rb["time_ratio"] = rb["processed_ms"] / rb["unfiltered_ms"]
    rb["processed_extra_gib"] = peak_extra(fwd_bwd(processed, h, w, y, t)) / 2**30
    rb["unfiltered_extra_gib"] = peak_extra(fwd_bwd(linear_logprobs, h, w, y, t)) / 2**30
    print(rb, flush=True)
    rows.append(rb)
    return rows


def sampler_case(b: int, v: int, repeats: int) -> dict:
    x = randn((b, v), scale=3.0, seed=3)
    t = torch.full((b,), 0.7, device="cuda")
    host = ([TOP_K] * b, [TOP_P] * b, [0.0] * b)
    k, p, m = (torch.tensor(a, device="cuda") for a in host)

    def rlk_step():
        ks = kept_set(x, t, k, p.float(), m.float(), host=host)
        z = apply_kept(x, t, ks)
        y = z.argmax(-1)
        return token_logprobs(x, y, t, kept=ks)[0]

    def native_step():
        z = native_filter(x.float() / t[:, None], TOP_K, TOP_P)
        y = z.argmax(-1)
        return torch.log_softmax(z, -1).gather(1, y[:, None])[:, 0]

    ks = kept_set(x, t, k, p.float(), m.float(), host=host)
    y = apply_kept(x, t, ks).argmax(-1)
    r = {"case": f"sampler step B={b}", **stats(ks.size)}
    r["processed_ms"] = time_fns([rlk_step], repeats=repeats)["median_ms"]
    r["native_ms"] = time_fns([native_step], repeats=repeats)["median_ms"]
    # the step's parts: the kept set on its backend (rlk.triton's candidates kernel on the top-k path) and as the
    # reference's torch ops (the path before the kernel), apply_kept, the processed log-prob
    r["kept_set_backend"] = REGISTRY.select("kept_set", "cuda", (x, t, k, p, m, PATH_TOP_K, TOP_K), True).backend.id
    r["kept_set_ms"] = time_fns([lambda: kept_set(x, t, k, p, m, host=host)], repeats=repeats)["median_ms"]
    r["kept_set_torch_ms"] = time_fns([lambda: kept_set_reference(x, t, k, p, m, PATH_TOP_K, TOP_K)],
                                      repeats=repeats)["median_ms"]
    r["apply_kept_ms"] = time_fns([lambda: apply_kept(x, t, ks)], repeats=repeats)["median_ms"]
    r["logprob_ms"] = time_fns([lambda: token_logprobs(x, y, t, kept=ks)], repeats=repeats)["median_ms"]
    r["speed_ratio"] = r["native_ms"] / r["processed_ms"]
    print(r, flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    require_cuda("bench_processed_logprobs")
    v = MODELS["qwen3-8b"]["vocab"]
    rows = []
    for tt, hh in ((8192, 4096), (1024, 4096), (8192, 1024)):
        rows += trainer_case(tt, hh, v, args.repeats)
        gc.collect()
        torch.cuda.empty_cache()
    for b in (1, 64, 256, 336):
        rows.append(sampler_case(b, v, args.repeats))
    meta = {"env": environment(), "copy": copy_bandwidth(), "repeats": args.repeats,
            "filters": {"top_k": TOP_K, "top_p": TOP_P},
            "time_ratio": "processed / unfiltered fused op (target <= 1.05)",
            "speed_ratio": "native torch filter step / rlk processed step (>= 1: rlk faster)"}
    write_results(default_out_dir(), "processed_logprobs", meta, rows,
                  [("case", "case"), ("processed_ms", "rlk processed ms"), ("unfiltered_ms", "rlk unfiltered ms"),
                   ("time_ratio", "time ratio"), ("native_ms", "native ms"), ("speed_ratio", "speed ratio"),
                   ("processed_extra_gib", "processed extra GiB"), ("unfiltered_extra_gib", "unfiltered extra GiB"),
                   ("kept_set_ms", "kept_set ms"), ("kept_set_torch_ms", "kept_set torch-ops ms"),
                   ("apply_kept_ms", "apply_kept ms"), ("logprob_ms", "processed logprob ms"),
                   ("kept_mean", "kept mean"), ("kept_singletons", "singletons")])


if __name__ == "__main__":
    main()
