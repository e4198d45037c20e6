"""The cost of TP invariance at the GEMM (contract ``rlk.gemm.tp.v1``, issue 35): a row-parallel linear (``o_proj``,
``down_proj``) as one rank computes it under rlk.gemm.tp.v1 vs under rlk.gemm.bi.v1 (today's ``linear``) and vs
``F.linear``, same process.

    python benchmarks/bench_linear_tp.py [--quick] [--repeats N] [--variants all|rule|fused,split,stash]

For each row-parallel shape of Qwen3-0.6B and Qwen3-8B, each TP t in 1, 2, 4, 8 (G = 8: a rank holds G / t leaves
of the global K) and each M: one rank's work under invariance — at TP > 1 ``linear_tp_partials(x_r, w_r, G / t)``
(fp32 partials, the in-op adjacent-pairs tree; the rounding follows the all-reduce and is timed there:
``bench_collectives.py``), at TP 1 ``linear_tp(x, w, None, G)``, the one op whose last kernel also adds the bias and
rounds (and, as ``unfused_ms``, the two steps ``linear_tp_finish(linear_tp_partials(...))`` it replaced: three more
launches) — against the same rank's ``linear(x_r, w_r)`` (bf16 out) and ``F.linear``. ``ratio`` = tp time / bi time
(<= 1.10 is the issue's budget for the whole step; a GEMM-level figure bounds the row-parallel GEMMs' share of it).
Device time through ``harness.time_fns`` (L2 flushed, GPU held busy before each call).

``--variants all`` also times every variant of the rlk.triton kernel forced (``fused``, ``split``, ``stash``:
``rlk_core.ops.linear_tp.triton``'s docstring; and ``smem``, the forced-only Gluon kernel of
``rlk_core.ops.linear_tp.gluon``, on sm_90 where Gluon imports) through the same launch plan, each as
``<variant>_ms`` and ``<variant>_ratio`` (its time over ``bi_ms``; at TP 1 finished, as the op runs), and per row:
``rule`` (the variant the rule ran), ``best`` (the fastest), ``rule_over_best`` (the rule's time over the best's:
1.0 where the rule chose best); every variant's result must have the op's bits (``same_bits``; the run fails
otherwise). The run ends with the rule's verdict: the rows where another variant is more than 5% faster — what the
rule (``variant()``, unmeasured) is to be set from.
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
from rlk_core.ops.linear_tp import linear_tp, linear_tp_finish, linear_tp_partials
from rlk_core.ops.linear_tp import triton as tp_triton

G = 8
M_LIST = (1, 16, 128, 1024, 4096, 8192)
RULE_SLACK = 1.05  # the verdict names rows where the rule's variant is more than 5% slower than the best


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
        if tp == 1:  # the whole tree and the rounding in one op (the forced variant: the same plan, finished)
            return linear_tp(x, w, None, G) if which is None else tp_triton.finished(plan, x, w, None, leaves, which)
        return linear_tp_partials(x, w, leaves) if which is None else tp_triton.partials(plan, x, w, leaves, which)

    t_tp = time_fns([lambda x=x, w=w: tp_call(x, w) for x, w in sets], repeats=repeats)["median_ms"]
    t_bi = time_fns([lambda x=x, w=w: ops.linear(x, w) for x, w in sets], repeats=repeats)["median_ms"]
    t_nat = time_fns([lambda x=x, w=w: F.linear(x, w) for x, w in sets], repeats=repeats)["median_ms"]
    rule = tp_triton.variant(sets[0][0].dtype, m, n, kl // leaves)
    r = {"shape": name, "TP": tp, "M": m, "N": n, "K_local": kl, "leaves": leaves, "variant": rule, "tp_ms": t_tp,
         "bi_ms": t_bi, "native_ms": t_nat, "ratio": t_tp / t_bi, "ratio_native": t_tp / t_nat}
    line = f"{name:18s} TP{tp} M={m:5d} bi {t_bi:.4f} ms F.linear {t_nat:.4f} ms | rule {rule}: {t_tp:.4f} ms " \
           f"({r['ratio']:.2f}x bi)"
    if tp == 1:  # what the one op saves: the partial and linear_tp_finish's three launches
        r["unfused_ms"] = time_fns([lambda x=x, w=w: linear_tp_finish(linear_tp_partials(x, w, leaves), None, x.dtype)
                                    for x, w in sets], repeats=repeats)["median_ms"]
        r["unfused_over_tp"] = r["unfused_ms"] / t_tp
        line += f", unfused {r['unfused_ms']:.4f} ms"
    if variants:
        x, w = sets[0]
        want = tp_call(x, w)
        same = True
        for v in variants:
            r[f"{v}_ms"] = t = time_fns([lambda x=x, w=w, v=v: tp_call(x, w, v) for x, w in sets],
                                        repeats=repeats)["median_ms"]
            r[f"{v}_ratio"] = t / t_bi
            same = same and torch.equal(tp_call(x, w, v), want)
        r["same_bits"] = same
        r["best"] = min(variants, key=lambda v: r[f"{v}_ms"])
        if rule in variants:
            r["rule_over_best"] = r[f"{rule}_ms"] / r[f"{r['best']}_ms"]
        line += " | " + " ".join(f"{v} {r[f'{v}_ms']:.4f} ms ({r[f'{v}_ratio']:.2f}x)" for v in variants)
        line += f" | best {r['best']}" + (f", rule/best {r['rule_over_best']:.2f}" if "rule_over_best" in r else "")
    print(line, flush=True)
    return r


def rule_verdict(rows: list[dict]) -> dict:
    """Where the rule's variant is more than :data:`RULE_SLACK` slower than the fastest variant of its row."""
    timed = [r for r in rows if "rule_over_best" in r]
    off = [{k: r[k] for k in ("shape", "TP", "M", "variant", "best", "rule_over_best")}
           for r in timed if r["rule_over_best"] > RULE_SLACK]
    return {"rows_timed": len(timed), "rule_best_within_slack": len(timed) - len(off), "slack": RULE_SLACK,
            "rows_where_another_variant_is_faster": off}


def forced_variants() -> tuple[str, ...]:
    """The forced-only variants (``tp_triton.FORCED``: ``smem``, the Gluon kernel) where they can run: Gluon for
    Hopper importable and an sm_90 device; none otherwise."""
    try:
        from rlk_core.ops.linear_tp import gluon  # noqa: F401
    except (ImportError, AttributeError):
        return ()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        return ()
    return tp_triton.FORCED


def parse_variants(text: str) -> tuple[str, ...]:
    """``--variants``: ``rule`` (the op only), ``all`` (``tp_triton.VARIANTS`` and :func:`forced_variants`), or a
    comma list of those."""
    if text == "rule":
        return ()
    known = tp_triton.VARIANTS + forced_variants()
    names = known if text == "all" else tuple(v for v in text.split(",") if v)
    bad = [v for v in names if v not in known]
    if bad or not names:
        raise ValueError(f"--variants {text!r}: unknown {bad or 'empty'}; give rule, all or a comma list of "
                         f"{', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="Qwen3-8B, TP 1 and 4, four M")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--variants", default="rule",
                    help="rule (the op only, default), all, or a comma list of fused,split,stash(,smem on sm_90): each "
                    "timed forced")
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
            "variant's result equal to the op's (torch.equal)", "split_max_m": tp_triton.SPLIT_MAX_M,
            "unfused": "TP 1: unfused_ms, linear_tp_finish(linear_tp_partials(x, w, G)) (what linear_tp ran before "
            "its rounding moved into the last kernel); unfused_over_tp: its time over tp_ms"}
    if variants:
        meta["rule_verdict"] = verdict = rule_verdict(rows)
        print(f"the rule: best (within {RULE_SLACK}x) in {verdict['rule_best_within_slack']} of "
              f"{verdict['rows_timed']} rows; another variant faster in: "
              f"{verdict['rows_where_another_variant_is_faster'] or 'none'}", flush=True)
    write_results(default_out_dir(), "linear_tp", meta, rows,
                  [("shape", "shape"), ("TP", "TP"), ("M", "M"), ("N", "N"), ("K_local", "K local"),
                   ("variant", "rule"), ("tp_ms", "tp ms"), ("bi_ms", "bi ms"), ("native_ms", "F.linear ms"),
                   ("ratio", "tp / bi"), ("ratio_native", "tp / F.linear"), ("unfused_ms", "TP 1 unfused ms"),
                   *((f"{v}_ms", f"{v} ms") for v in variants), *((f"{v}_ratio", f"{v} / bi") for v in variants),
                   *((("best", "best"), ("rule_over_best", "rule / best"), ("same_bits", "same bits"))
                     if variants else ())])
    bad = [r for r in rows if r.get("same_bits") is False]
    if bad:
        print(f"bench_linear_tp: {len(bad)} rows where a variant's bits differ from the op's: "
              f"{[(r['shape'], r['TP'], r['M']) for r in bad]}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
