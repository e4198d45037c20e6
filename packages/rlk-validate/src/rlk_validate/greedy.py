"""Greedy rollout requests (issue 40): log-probs of vLLM's argmax, not of a distribution a trainer recomputes.

The vLLM plugin serves greedy requests (``temperature = 0``, e.g. evaluation passes sent through the training
engines) with vLLM's greedy semantics and counts, per process, the requests its sampler took in the readback's
``annotations.sampling`` (rlk_vllm_plugin.logprobs): ``greedy`` / ``sampled``, ``greedy_with_logprobs`` /
``sampled_with_logprobs``, and ``comparable: false`` (with a ``reason``) once a greedy request asked for log-probs.
:func:`check_greedy` turns greedy log-prob requests on the rollout side into ``GREEDY_NOT_COMPARABLE``:

- the compared tokens can be greedy ones — no sampled request asked for log-probs, or the manifest's
  ``sampling.temperature`` is 0: the code's severity (error), a warning where bitwise equality is not required
  (the convention of ``SAMPLING_SEMANTICS_DIFFER``: it then describes the drift);
- sampled log-prob requests beside them and a manifest temperature that is not 0 (an evaluation pass through the
  same engine): a warning — readbacks count requests, and cannot say which tokens train-data holds.
"""

from __future__ import annotations

from typing import Any

from .findings import Finding, finding
from .readbacks import _list_readbacks, _load_readback
from .safeio import InputError, Root

CHECK = "readbacks"
TOPIC = "sampling"
COUNTS = ("greedy", "sampled", "greedy_with_logprobs", "sampled_with_logprobs")


def rollout_sampling(root: Root) -> tuple[dict[str, int], list[str], list[str]]:
    """The rollout side's ``annotations.sampling`` counts summed over its valid readbacks (each TP rank's sampler
    counts the requests it took: with TP > 1 a request counts once per rank), the readbacks that carry the
    annotation, and the ``reason`` of each one marked ``comparable: false``."""
    total = dict.fromkeys(COUNTS, 0)
    files: list[str] = []
    reasons: list[str] = []
    try:
        names = _list_readbacks(root) or []
    except InputError:
        return total, files, reasons  # check_readbacks reports it
    for host, name in names:
        rel = f"readbacks/{host}/{name}" if host else f"readbacks/{name}"
        doc, _ = _load_readback(root, rel)  # its own problems are check_readbacks' findings
        if doc is None or doc.get("side") != "rollout":
            continue
        note = (doc.get("annotations") or {}).get(TOPIC)
        if not isinstance(note, dict):
            continue
        files.append(rel)
        counts = note.get("counts") or {}
        for key in COUNTS:
            total[key] += counts.get(key, 0)
        if note.get("comparable") is False:
            reason = note.get("reason")
            reasons.append(reason[:400] if isinstance(reason, str) else "marked comparable: false, no reason")
    return total, files, reasons


def _temperature(manifest: Any) -> float | None:
    sampling = manifest.get("sampling") if isinstance(manifest, dict) else None
    t = sampling.get("temperature") if isinstance(sampling, dict) else None
    return float(t) if type(t) in (int, float) else None


def check_greedy(root: Root, manifest: Any, require_exact: bool) -> list[Finding]:
    """``GREEDY_NOT_COMPARABLE`` where the rollout's readbacks record greedy requests that asked for log-probs."""
    counts, files, reasons = rollout_sampling(root)
    greedy, sampled = counts["greedy_with_logprobs"], counts["sampled_with_logprobs"]
    if not greedy and not reasons:  # a mark without counts is evidence too
        return []
    temperature = _temperature(manifest)
    compared = sampled == 0 or temperature == 0.0
    where = files[0] if len(files) == 1 else "readbacks"
    head = (f"the rollout served {greedy} greedy request(s) (temperature 0) with log-probs, beside {sampled} sampled "
            "one(s) with log-probs: vLLM's argmax, not a distribution the trainer recomputes")
    detail = {"greedy_with_logprobs": greedy, "sampled_with_logprobs": sampled, "greedy": counts["greedy"],
              "sampled": counts["sampled"], "files": files[:8], "reason": reasons[0] if reasons else None}
    if compared:
        why = ("no sampled request asked for log-probs" if sampled == 0 else "the manifest's sampling temperature is 0")
        return [finding("GREEDY_NOT_COMPARABLE", f"{head}; {why}, so the compared rollout log-probs are greedy ones: "
                        "a comparison with the trainer's recompute is no pass" + (" (bitwise equality was required)"
                                                                                  if require_exact else ""),
                        check=CHECK, path=where, severity=None if require_exact else "warning", **detail)]
    return [finding("GREEDY_NOT_COMPARABLE", f"{head}; sampled requests beside them (an evaluation pass through the "
                    "same engine?): the readbacks count requests and cannot say which tokens train-data holds — the "
                    "compared ones must be the sampled ones", check=CHECK, path=where, severity="warning", **detail)]
