"""The README's headline figures are the linked result files' (issue 41: "README claims match the linked results"):
each claim is rebuilt from the JSON it cites and must appear in README.md word for word (whitespace aside), so a
result re-measured without the README (or the other way round) fails here. A claim that cannot be rebuilt from the
current files is not listed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FW = Path("benchmarks/results/h200/frameworks")
MOE = Path("benchmarks/results/h100/frameworks/moe_loop/moe_loop.json")
COMMITTED_RUN = Path("tests/validate/data/frameworks-rr")


def _json(root: Path, rel: Path | str) -> dict:
    return json.loads((root / rel).read_text())


def _check(checks: list[dict], name: str) -> dict:
    (hit,) = [c for c in checks if c["name"] == name]
    return hit


def claims(root: Path) -> dict[str, str]:
    """Each README claim, rebuilt from the result files under ``root`` (the repository), by the file it comes from."""
    loop = _json(root, FW / "loop" / "loop_gpu.json")
    filtered = _json(root, FW / "filtered" / "filtered_gpu.json")["runs"]
    vllm = _json(root, FW / "vllm_gpu.json")["checks"]
    megatron = _json(root, FW / "megatron_gpu.json")["checks"]
    matrix = [c for m in ("matrix-a", "matrix-b") for c in _json(root, FW / "matrix" / f"{m}.report.json")["cells"]]
    ten = _json(root, FW / "filtered" / "lr_check.json")["sittings"]["lr_1e-6"]
    ten_run, ten_rounds = ten["document"]["runs"]["rr-ten"], ten["per_round"]["rr-ten"]
    least_informative = min(r["informative_fraction"] for r in ten_rounds)
    first_reward, last_reward = ten_rounds[0]["reward_mean"], ten_rounds[-1]["reward_mean"]
    (run,) = [p for p in (root / COMMITTED_RUN).iterdir() if p.is_dir()]
    committed = _json(root, run / "bitwise-validation.json")
    moe_rr, moe_pp = (_json(root, MOE)["runs"][k] for k in ("rr", "pp"))

    rr, ratios = loop["runs"]["rr"], loop["ratios"]
    rr_filtered = [filtered["rr-t1"], filtered["rr-t07"]]
    top_p_1 = filtered["pp-top-p-1"]
    cells = {c["element_count"] for c in matrix}
    assert len(cells) == 1, cells  # the README states one count per cell
    recompute, differs = _check(vllm, "rr.logp_equal_trainer"), _check(vllm, "pp.differs_from_trainer")
    grads = [c for c in megatron if c["name"].endswith(".grads_equal_local_trainer")]
    logps = [c for c in megatron if c["name"].endswith(".logp_equal_local_trainer")]
    assert grads and all(c["differing"] == 0 and c["max_abs_diff"] == 0.0 for c in grads), grads
    assert logps and all(c["max_abs_diff"] == 0.0 for c in logps), logps
    (tensors,) = {c["tensors"] for c in grads}
    negative = _check(megatron, "negative_control.stock_spec_differs_from_local_trainer")
    speed = {m: _check(megatron, f"timing.{m}.rlk_vs_stock_speed_ge_0.9")["speed_ratio"]
             for m in ("qwen3-0.6b", "qwen3-1.7b")}
    return {
        "loop_gpu.json (an earlier preset)": f"(an earlier preset's run: {rr['compared_tokens']:,}, "
                                             f"{rr['mismatches']} differ)",
        "loop_gpu.json (ratios)": f"rollout **{ratios['rollout_tok_s R/R vs P/P']:.2f}x**, training "
                                  f"**{ratios['train_tok_s R/R vs P/P']:.2f}x** of the native loop",
        "lr_check.json (10 rounds)": f"{ten_run['compared_tokens']:,} tokens compared, **{ten_run['mismatches']} "
                                     f"differ**, informative share >= {100 * least_informative:.1f}% every round, "
                                     f"reward {first_reward:.2f} -> {last_reward:.2f}",
        "filtered_gpu.json (R/R)": f"{sum(r['compared_tokens'] for r in rr_filtered):,} tokens compared, "
                                   f"**{sum(r['mismatches'] for r in rr_filtered)} differ**",
        "filtered_gpu.json (P/P, no filter)": f"T 0.7: {top_p_1['mismatches']:,} of {top_p_1['compared_tokens']:,} "
                                              "differ",
        "filtered_gpu.json (drift)": f"{filtered['pp-semantic']['mean_abs_diff']:.3f} nats mean drift; both "
                                     f"processed: {filtered['pp-processed']['mean_abs_diff']:.3f}",
        "matrix reports": f"{cells.pop():,} tokens a cell",
        "vllm_gpu.json (recompute)": f"log-probs equal rlk's training recompute on "
                                     f"{recompute['tokens'] - recompute['mismatched_tokens']:,} of "
                                     f"{recompute['tokens']:,} tokens; "
                                     f"**{_check(vllm, 'perf.rr_vs_native')['ratio']:.2f}x** native output tok/s, "
                                     f"**{_check(vllm, 'perf.rr_vs_batch_invariant')['ratio']:.2f}x**",
        "vllm_gpu.json (P/P)": f"{differs['mismatched_tokens']:,} of {differs['tokens']:,} differ",
        "megatron_gpu.json (lockstep)": f"log-probs and all {tensors} gradients bitwise every step; step time "
                                        f"**{speed['qwen3-0.6b']:.2f}x** of the stock local spec "
                                        f"({speed['qwen3-1.7b']:.2f}x at 1.7B)",
        "megatron_gpu.json (negative control)": f"{negative['differing_tokens']:,} of {negative['tokens']:,} "
                                                "log-probs differ",
        "moe_loop.json (R/R)": f"{moe_rr['compared_tokens']:,} tokens compared, **{moe_rr['mismatches']} differ**; "
                               f"{moe_rr['routing_mismatch_tokens']} of {moe_rr['routing_compared_tokens']:,} "
                               "routed tokens on another expert set",
        "moe_loop.json (P/P)": f"{moe_pp['mismatches']:,} of {moe_pp['compared_tokens']:,} differ; "
                               f"{100 * moe_pp['routing_mismatch_fraction']:.1f}% of routed tokens on another "
                               "expert set",
        "the committed run": f"{committed['element_count']:,} tokens, {committed['mismatch_count']} differ",
    }


def _missing(root: Path) -> dict[str, str]:
    readme = " ".join((REPO / "README.md").read_text().split())  # the table's cells and wrapped lines alike
    return {src: text for src, text in claims(root).items() if text not in readme}


def test_every_headline_figure_of_the_readme_is_its_result_files():
    assert _missing(REPO) == {}


def test_a_result_re_measured_without_the_readme_is_caught(tmp_path):
    for rel in (FW, COMMITTED_RUN, MOE.parent):
        shutil.copytree(REPO / rel, tmp_path / rel)
    path = tmp_path / FW / "loop" / "loop_gpu.json"
    doc = json.loads(path.read_text())
    doc["runs"]["rr"]["compared_tokens"] += 1
    path.write_text(json.dumps(doc))
    assert list(_missing(tmp_path)) == ["loop_gpu.json (an earlier preset)"]

