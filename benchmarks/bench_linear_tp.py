"""The cost of TP invariance at the GEMM (contract ``rlk.gemm.tp.v1``, issue 35): a row-parallel linear (``o_proj``,
``down_proj``) as one rank computes it under rlk.gemm.tp.v1 vs under rlk.gemm.bi.v1 (today's ``linear``) and vs
``F.linear``, same process.

    python benchmarks/bench_linear_tp.py [--quick] [--repeats N] [--variants all|rule|fused,split,stash]

For each row-parallel shape of Qwen3-0.6B and Qwen3-8B, each TP t in 1, 2, 4, 8 (G = 8: a rank holds G / t leaves
of the global K) and each M: one rank's work under invariance, ``linear_tp_partials(x_r, w_r, G / t)`` (fp32
partials, the in-op adjacent-pairs tree) plus, at TP 1, ``linear_tp_finish`` (the one rounding; at TP > 1 the
rounding follows the all-reduce and is timed there: ``bench_collectives.py``), against the same rank's
``linear(x_r, w_r)`` (bf16 out) and ``F.linear``. ``ratio`` = tp time / bi time (<= 1.10 is the issue's budget for
the whole step; a GEMM-level figure bounds the row-parallel GEMMs' share of it). Device time through
``harness.time_fns`` (L2 flushed, GPU held busy before each call).

``--variants all`` also times every variant of the rlk.triton kernel forced (``fused``, ``split``, ``stash``:
``rlk_core.ops.linear_tp.triton``'s docstring) through the same launch plan, each as ``<variant>_ms`` and
``<variant>_ratio`` (its time over ``bi_ms``, the finish included at TP 1 as for ``tp_ms``) beside the rule's
``variant``, and checks that every variant's partial has the rule's bits (``same_bits``; the run fails otherwise):
the measurement the rule (``variant()``, unmeasured) is to be set from.
"""

from __future__ import annotations

import argparse

import _common  # noqa: F401  (sys.path)
import torch
import torch.nn.functional as F
from _common import MODELS, randn
from harness import copy_bandwidth, default_out_dir, environment, require_cuda, time_fns, write_results

from rlk_core import ops
from rlk_core.ops._plan import jit_plan
from rlk_core.ops.linear_tp import linear_tp_finish, linear_tp_partials
from rlk_core.ops.linear_tp import triton as tp_triton

G = 8
M_LIST = (1, 16, 128, 1024, 4096, 8192)


def row_parallel_shapes() -> list[tuple[str, int, int]]:
    """``(name, N, K)`` of the global row-parallel projections: attention's output and the MLP's down projection."""
    out = []
    for model, c in MODELS.items():
        out += [(f"{model}/o", c["hidden"], c["q_heads"] * c["head_dim"]), (f"{model}/down", c["hidden"], c["inter"])]
    return out


def row(name: str, n: int, k: int, tp: int, m: int, repeats: int, variants: tuple[str, ...] = ()) -> dict:
    kl = k // tp
    sets = [(randn((m, kl), seed=10 * i), randn((n, kl), scale=k ** -0.5, seed=10 * i + 1)) for i in range(2)]
    leaves = G // tp
    plan = jit_plan(sets[0][0].device)

    def tp_call(x, w, which=None):
        s = linear_tp_partials(x, w, leaves) if which is None else tp_triton.partials(plan, x, w, leaves, which)
        return linear_tp_finish(s, None, x.dtype) if tp == 1 else s

    t_tp = time_fns([lambda x=x, w=w: tp_call(x, w) for x, w in sets], repeats=repeats)["median_ms"]
    t_bi = time_fns([lambda x=x, w=w: ops.linear(x, w) for x, w in sets], repeats=repeats)["median_ms"]
    t_nat = time_fns([lambda x=x, w=w: F.linear(x, w) for x, w in sets], repeats=repeats)["median_ms"]
    rule = tp_triton.variant(sets[0][0].dtype, m, n, kl // leaves)
    r = {"shape": name, "TP": tp, "M": m, "N": n, "K_local": kl, "leaves": leaves, "variant": rule, "tp_ms": t_tp,
         "bi_ms": t_bi, "native_ms": t_nat, "ratio": t_tp / t_bi, "ratio_native": t_tp / t_nat}
    if variants:
        x, w = sets[0]
        want = linear_tp_partials(x, w, leaves)
        same = True
        for v in variants:
            r[f"{v}_ms"] = t = time_fns([lambda x=x, w=w, v=v: tp_call(x, w, v) for x, w in sets],
                                        repeats=repeats)["median_ms"]
            r[f"{v}_ratio"] = t / t_bi
            same = same and torch.equal(tp_triton.partials(plan, x, w, leaves, v), want)
        r["same_bits"] = same
        r["best"] = min(variants, key=lambda v: r[f"{v}_ms"])
    per = " ".join(f"{v} {r[f'{v}_ratio']:.3f}" for v in variants)
    print(f"{name:18s} TP{tp} M={m:5d} tp {t_tp:.4f} ms bi {t_bi:.4f} ms F.linear {t_nat:.4f} ms "
          f"tp/bi {r['ratio']:.3f} ({rule}) {per}", flush=True)
    return r


def parse_variants(text: str) -> tuple[str, ...]:
    """``--variants``: ``rule`` (the op only), ``all``, or a comma list of ``tp_triton.VARIANTS``."""
    if text == "rule":
        return ()
    names = tp_triton.VARIANTS if text == "all" else tuple(v for v in text.split(",") if v)
    bad = [v for v in names if v not in tp_triton.VARIANTS]
    if bad or not names:
        raise ValueError(f"--variants {text!r}: unknown {bad or 'empty'}; give rule, all or a comma list of "
                         f"{', '.join(tp_triton.VARIANTS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Qwen3-8B, TP 1 and 4, four M")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="rule",
                    help="rule (the op only, default), all, or a comma list of fused,split,stash: each timed forced")
    args = ap.parse_args(argv)
    try:
        variants = parse_variants(args.variants)
    except ValueError as e:
        ap.error(str(e))  # exit 2
    require_cuda("bench_linear_tp")
    shapes, tps, ms = row_parallel_shapes(), (1, 2, 4, 8), M_LIST
    if args.quick:
        shapes, tps, ms = [s for s in shapes if s[0].startswith("qwen3-8b")], (1, 4), (1, 128, 1024, 8192)
    rows = [row(name, n, k, tp, m, args.repeats, variants) for name, n, k in shapes for tp in tps for m in ms]
    meta = {"env": environment(), "copy": copy_bandwidth(), "repeats": args.repeats, "G": G,
            "ratio": "tp_ms / bi_ms (the cost of invariance for one rank's row-parallel GEMM)",
            "tp": "linear_tp_partials(x_r, w_r, G / TP) (+ linear_tp_finish at TP 1)",
            "bi": "rlk_core.ops.linear(x_r, w_r)", "native": "torch.nn.functional.linear (cuBLAS)",
            "variant": "the variant the rule ran for tp_ms (rlk_core.ops.linear_tp.triton.variant)",
            "variants": list(variants), "variant_ms": "<variant>_ms: that variant forced, as tp_ms; same_bits: every "
            "variant's partial equal to the op's (torch.equal)", "split_max_m": tp_triton.SPLIT_MAX_M}
    write_results(default_out_dir(), "linear_tp", meta, rows,
                  [("shape", "shape"), ("TP", "TP"), ("M", "M"), ("N", "N"), ("K_local", "K local"),
                   ("variant", "rule"), ("tp_ms", "tp ms"), ("bi_ms", "bi ms"), ("native_ms", "F.linear ms"),
                   ("ratio", "tp / bi"), ("ratio_native", "tp / F.linear"),
                   *((f"{v}_ratio", f"{v} / bi") for v in variants), *((("best", "best"), ("same_bits", "same bits"))
                                                                       if variants else ())])
    bad = [r for r in rows if r.get("same_bits") is False]
    if bad:
        print(f"bench_linear_tp: {len(bad)} rows where a variant's bits differ from the op's: "
              f"{[(r['shape'], r['TP'], r['M']) for r in bad]}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
