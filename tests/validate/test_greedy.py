"""Greedy rollout requests (issue 40): the vLLM plugin counts, per process, the requests its sampler took in the
readback's ``annotations.sampling``, marking ``comparable: false`` once a greedy request (temperature 0) asked for
log-probs. Where the compared tokens can be greedy ones (no sampled request with log-probs, or the manifest's
temperature is 0) that is ``GREEDY_NOT_COMPARABLE``: an error where bitwise equality is required, a warning otherwise;
greedy requests beside sampled ones (an evaluation pass) are a warning. The negative controls: sampled requests only
pass, and a readback without the field (older writers) passes. Torch-free."""

from __future__ import annotations

from pathlib import Path

from validate_builders import PP, RR, build_run, mutate_json

from rlk_validate import Options, validate_run

VLLM = "readbacks/vllm-rollout-3000.json"
REASON = "greedy requests (temperature 0) asked for log-probs: vLLM samples them by argmax"


def _note(greedy: int, sampled: int, greedy_lp: int, sampled_lp: int) -> dict:
    """What rlk_vllm_plugin.logprobs.note_request leaves in a readback."""
    counts = {k: v for k, v in (("greedy", greedy), ("sampled", sampled), ("greedy_with_logprobs", greedy_lp),
                                ("sampled_with_logprobs", sampled_lp)) if v}
    return {"counts": counts, "comparable": not greedy_lp, "reason": REASON if greedy_lp else None,
            "counted": "requests added to vLLM's sampler"}


def _run(tmp_path: Path, name: str, note: dict | None, plan: dict = RR, temperature: float | None = None) -> Path:
    run = build_run(tmp_path / name, plan, engine="frameworks", drift=0.0)  # agreeing bits: only the greedy rule
    if note is not None:
        mutate_json(run / VLLM, lambda d: d.update(annotations={"sampling": note}))
    if temperature is not None:
        mutate_json(run / "manifest.json", lambda m: m.update(sampling={
            "temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "filtered": False,
            "rollout": {"logprobs": "processed"}, "train": {"logprobs": "processed"}}))
    return run


def _greedy(run: Path, **kw) -> tuple[str, list]:
    report = validate_run(run, Options(**kw))
    return report.verdict, [f for f in report.findings if f.code == "GREEDY_NOT_COMPARABLE"]


def test_a_greedy_only_rollout_is_no_pass(tmp_path: Path) -> None:
    verdict, (f,) = _greedy(_run(tmp_path, "greedy", _note(8, 0, 8, 0)))
    assert verdict == "failed" and f.severity == "error" and f.path == VLLM, f
    assert f.details["greedy_with_logprobs"] == 8 and f.details["sampled_with_logprobs"] == 0
    assert f.details["reason"].startswith("greedy requests") and "argmax" in f.message
    # not required bitwise (P/P): a warning, the run passes
    verdict, (f,) = _greedy(_run(tmp_path, "pp", _note(8, 0, 8, 0), PP))
    assert verdict == "passed" and f.severity == "warning"
    # required bitwise on a P/P run: an error again
    verdict, (f,) = _greedy(_run(tmp_path, "pp-strict", _note(8, 0, 8, 0), PP), require_bitwise=True)
    assert verdict == "failed" and f.severity == "error"


def test_greedy_beside_sampled_requests_is_a_warning_unless_the_run_sampled_at_temperature_0(tmp_path: Path) -> None:
    verdict, (f,) = _greedy(_run(tmp_path, "eval", _note(2, 8, 2, 8), temperature=0.7))
    assert verdict == "passed" and f.severity == "warning" and "evaluation pass" in f.message
    verdict, (f,) = _greedy(_run(tmp_path, "t0", _note(2, 8, 2, 8), temperature=0.0))
    assert verdict == "failed" and f.severity == "error" and "temperature is 0" in f.message


def test_sampled_requests_only_and_old_readbacks_pass(tmp_path: Path) -> None:
    for name, note in (("sampled", _note(0, 8, 0, 8)), ("greedy-no-logprobs", _note(4, 8, 0, 8)), ("old", None)):
        verdict, found = _greedy(_run(tmp_path, name, note))
        assert verdict == "passed" and not found, (name, found)


def test_a_mark_without_counts_is_evidence_and_malformed_annotations_are_invalid(tmp_path: Path) -> None:
    verdict, (f,) = _greedy(_run(tmp_path, "mark", {"comparable": False, "reason": REASON}))
    assert verdict == "failed" and f.severity == "error"
    for name, note in (("negative", {"counts": {"greedy": -1}}), ("nested", {"counts": {}, "reason": {"a": 1}}),
                       ("bool", {"counts": {"greedy_with_logprobs": True}})):
        report = validate_run(_run(tmp_path, name, note))
        codes = [f.code for f in report.findings]
        assert report.verdict == "failed" and "READBACK_FIELD_INVALID" in codes, (name, codes)
        assert "GREEDY_NOT_COMPARABLE" not in codes  # an invalid readback is not read for it
