"""Findings: what a check reports, and the table of every finding code.

A finding has a ``code`` (stable, documented in ``docs/validate.md``), a ``severity`` and a
human ``message``; optionally the ``path`` (relative to the checked directory) it is about and
machine-readable ``details``.

Severities, strongest first:

- ``error``: the evidence contradicts the claim, or is corrupt. Any error makes the verdict ``failed``.
- ``incomplete``: evidence the claim needs is missing (nothing seen contradicts it). Without errors,
  the verdict is ``incomplete``.
- ``warning``: worth a look; does not change the verdict.
- ``info``: diagnostics (for example the mismatch of a mixed ``P/R`` cell).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ERROR = "error"
INCOMPLETE = "incomplete"
WARNING = "warning"
INFO = "info"
SEVERITIES = (ERROR, INCOMPLETE, WARNING, INFO)

#: code -> (default severity, one-line meaning). docs/validate.md lists the same table.
CODES: dict[str, tuple[str, str]] = {
    # input handling (any file)
    "INPUT_UNUSABLE": (
        ERROR,
        "the directory to check does not exist, is not a directory, or cannot be listed",
    ),
    "PATH_ESCAPES": (ERROR, "a path (usually a symlink) resolves outside the checked directory"),
    "FILE_TOO_LARGE": (ERROR, "a file is larger than the size cap for its kind; it was not read"),
    "FILE_UNREADABLE": (ERROR, "a file or directory could not be opened or listed"),
    "NOT_A_FILE": (ERROR, "a path that must be a regular file is something else (directory, FIFO, ...)"),
    "JSON_INVALID": (
        ERROR,
        "a JSON document is truncated, malformed, or uses NaN/Infinity or duplicate keys",
    ),
    "SCHEMA_UNSUPPORTED": (
        ERROR,
        "a document's `schema` is missing, unknown, or a version this checker does not read",
    ),
    # run
    "MANIFEST_MISSING": (INCOMPLETE, "manifest.json is absent"),
    "MANIFEST_FIELD_MISSING": (ERROR, "a required manifest field is absent"),
    "MANIFEST_FIELD_INVALID": (ERROR, "a manifest field has the wrong type or value"),
    "PLAN_INVALID": (ERROR, "a plan is not a mapping of known modules to X/Y cases with X, Y in {P, R}"),
    "MODE_PLAN_MISMATCH": (ERROR, "the manifest mode (native / consistency) disagrees with its plan"),
    "REPO_REVISION_UNKNOWN": (
        INCOMPLETE,
        "a manifest repository records no SHA or no dirty state (not a git checkout?)",
    ),
    "REPO_DIRTY": (WARNING, "a repository recorded in the manifest had uncommitted changes"),
    "EXIT_CODE_MISSING": (INCOMPLETE, "exit-code is absent: the run has not finished or was killed"),
    "EXIT_CODE_INVALID": (ERROR, "exit-code does not hold one integer"),
    "EXIT_CODE_NONZERO": (ERROR, "the run exited with a non-zero status"),
    "RUN_LOG_MISSING": (INCOMPLETE, "run.log is absent"),
    "TRACEBACK_IN_LOG": (ERROR, "run.log contains a Python traceback"),
    "ROUNDS_MISSING": (INCOMPLETE, "fewer rounds (or rank files) of train-data than the manifest expects"),
    "TRAIN_DATA_UNEXPECTED": (ERROR, "train-data holds files the manifest does not account for"),
    "METRICS_MISSING": (INCOMPLETE, "metrics.jsonl is absent or lacks rounds"),
    "METRICS_INVALID": (ERROR, "a metrics.jsonl line is malformed, duplicated or out of range"),
    "VIME_METRIC_DISAGREES": (
        ERROR,
        "VIME's logged train_rollout_logprob_abs_diff is zero where train-data differs, or non-zero where it is equal",
    ),
    "METRICS_DISAGREE": (ERROR, "metrics.jsonl disagrees with the numbers recomputed from train-data"),
    "BITWISE_FILE_MISSING": (INCOMPLETE, "bitwise-validation.json is absent"),
    "BITWISE_FILE_INVALID": (ERROR, "bitwise-validation.json lacks fields or has wrong types"),
    "BITWISE_FILE_DISAGREES": (
        ERROR,
        "bitwise-validation.json disagrees with the numbers recomputed from train-data",
    ),
    "FALLBACK_FAILURES": (ERROR, "bitwise-validation.json reports fallback failures"),
    "NOTHING_COMPARED": (ERROR, "the train-data, or a claim about it, covers zero tokens or zero rounds"),
    "REWARDS_UNVERIFIED": (WARNING, "train-data holds no rewards tensor: metrics' reward claims cannot be checked"),
    "REWARDS_INVALID": (ERROR, "a rewards / advantages tensor holds NaN or infinite values"),
    "SEAL_INVALID": (
        ERROR,
        "COMPLETE is not a valid seal: unreadable, hand-written, its run-validation.json is absent or its hash "
        "differs, or the run was edited after sealing",
    ),
    "COMPLETE_UNJUSTIFIED": (ERROR, "COMPLETE exists but the run does not pass validation"),
    "SEALED": (INFO, "COMPLETE exists and the run passes validation"),
    "SEAL_WRITTEN": (INFO, "--seal wrote run-validation.json (and COMPLETE when the run passed)"),
    "SEAL_EXISTS": (WARNING, "--seal asked for, but COMPLETE already exists; nothing was written"),
    "SEAL_FAILED": (ERROR, "--seal could not write run-validation.json or COMPLETE, or refused: the run is still "
                    "being written"),
    "SEAL_REDONE": (INFO, "--seal found what an interrupted seal left (its temp files, an empty COMPLETE), removed "
                    "it and sealed afresh"),
    "SEAL_SIGNED": (INFO, "COMPLETE carries a valid Ed25519 signature (by the --verify-key key, where given)"),
    "SIGNATURE_MISSING": (ERROR, "--verify-key given, but the run is not sealed or its COMPLETE is not signed"),
    "SIGNATURE_INVALID": (
        ERROR,
        "COMPLETE's signature does not verify, or was made by another key than --verify-key's",
    ),
    "SIGNATURE_UNCHECKED": (WARNING, "COMPLETE is signed but the cryptography package is not installed here"),
    "RUN_DIR_BUSY": (
        WARNING,
        "another process held the run directory's lock (a run still writing it, or a sealer): it was read mid-write",
    ),
    "SAMPLING_SEMANTICS_DIFFER": (
        ERROR,
        "the rollout filtered its sampling (top-k / top-p / min-p) and the two sides' log-probs are of different "
        "distributions (one over the kept set, the other over the whole vocabulary): a semantic mismatch, not an "
        "arithmetic one (a warning where bitwise equality is not required: it quantifies that mismatch)",
    ),
    "KEPT_SET_MISMATCH": (
        ERROR,
        "the trainer's kept sets (found from its own logits) differ in size from the rollout's at some positions",
    ),
    "KEPT_SET_SIZES": (INFO, "the kept-set size distribution of the run's sampled tokens"),
    "GREEDY_NOT_COMPARABLE": (
        ERROR,
        "the rollout's readbacks record greedy requests (temperature 0) that asked for log-probs — vLLM's argmax, not "
        "a distribution the trainer recomputes — and the compared tokens can be theirs: no sampled request asked for "
        "log-probs, or the manifest's temperature is 0 (a warning where bitwise equality is not required, or where "
        "sampled requests beside them make it an evaluation pass the readbacks cannot tell apart)",
    ),
    "QUANTIZED_ROLLOUT": (
        ERROR,
        "the rollout ran quantized (manifest rollout_quantization, e.g. fp8) while the trainer did not: a mismatch "
        "knob, never a bitwise claim (info where bitwise equality is not required)",
    ),
    "WEIGHTS_STATIC": (
        ERROR,
        "no update between rounds changed the weights (or no sequence had a non-zero advantage): a bitwise claim "
        "over rounds is then about one fixed model (an error where bitwise equality is required and the run did "
        "not ask for static weights)",
    ),
    "ADVANTAGES_ZERO": (
        WARNING,
        "in some rounds (not all: that is WEIGHTS_STATIC) every sequence's advantage was 0, e.g. a saturated reward: "
        "those updates had no learning signal and the later rounds compare a policy that barely moved",
    ),
    "INFORMATIVE_FRACTION_LOW": (
        ERROR,
        "in some round, fewer compared tokens than the bound (--min-informative-fraction) had a rollout log-prob "
        "below -1e-3: equal bits of saturated log-probs prove little (an error where bitwise equality is required)",
    ),
    # resume chain (rlk_validate.chain: `rlk-repro run --resume`)
    "RESUME_FIELD_INVALID": (ERROR, "the manifest's resume block (a resumed attempt's link to its parent) is invalid"),
    "RESUME_PARENT_MISSING": (ERROR, "the run a resumed attempt continued is not beside it: its inherited rounds "
                              "cannot be traced"),
    "RESUME_PARENT_MISMATCH": (ERROR, "the directory named as the resumed parent is another run, or the chain loops"),
    "RESUME_CONFIG_DIFFERS": (ERROR, "a resumed attempt and its parent differ in plan, seeds, inputs or configuration"),
    "RESUME_STATE_MISMATCH": (ERROR, "the parent's round state is not the one the resumed attempt started from"),
    "RESUME_INHERITED_DIFFERS": (ERROR, "a round a resumed attempt inherited (train-data file or metrics line) is not "
                                 "its parent's, or the inherited rounds are not exactly the parent's earlier ones"),
    # readbacks
    "READBACKS_MISSING": (INCOMPLETE, "no readback for one side (train or rollout), or no readbacks at all"),
    "READBACK_FIELD_INVALID": (ERROR, "a readback field is absent, of the wrong type, or inconsistent"),
    "READBACK_NAME_MISMATCH": (
        ERROR,
        "a readback's file name disagrees with its framework/target/pid (or its readbacks/<hostname>/ with its host)",
    ),
    "READBACK_DUPLICATE": (ERROR, "two readbacks for the same (host, framework, target, pid)"),
    "READBACKS_SIDE_SILENT": (
        ERROR,
        "a VIME run finished but one side left no readback: RL_KERNEL_* never reached its processes (Ray runtime env)",
    ),
    "READBACK_PLAN_MISMATCH": (ERROR, "a readback's plan differs from the requested plan"),
    "READBACK_PLAN_CONFLICT": (ERROR, "readbacks disagree with each other on the plan"),
    "READBACK_RUN_ID_MISMATCH": (ERROR, "a readback names a different run id than the manifest"),
    # contract digest (rlk_validate.digest, issue 37)
    "CONTRACT_DIGEST_INVALID": (ERROR, "a recorded contract digest is malformed (not sha256:<hex>, no "
                                "rlk.contract-digest.v1 document, no checks)"),
    "CONTRACT_DIGEST_MISMATCH": (ERROR, "a readback's contract digest is not the digest of the document it records: "
                                 "one of them was altered"),
    "CONTRACT_DIGEST_CHANGED": (ERROR, "a check of the contract digest during the run (after a weight sync) found "
                                "another digest than the run's"),
    "CONTRACT_DIGEST_SIDES_DIFFER": (ERROR, "the readbacks (train and rollout sides) carry different contract "
                                     "digests"),
    "CONTRACT_DIGEST_DISAGREES": (ERROR, "a contract digest disagrees with the readback's plan or executed contracts "
                                  "and backends, or the manifest's / metrics lines' digest is not the readbacks'"),
    "CONTRACT_DIGEST_MISSING": (ERROR, "the manifest records a contract digest but a readback carries none"),
    # Prefill/Decode layout (rlk_validate.pd, issue 37)
    "PD_LAYOUT_INVALID": (ERROR, "the manifest's pd layout is malformed (roles, routes, readback lists, a readback "
                          "listed by both engines, one that is not a vLLM rollout readback)"),
    "PD_ROUTES_DIFFER": (ERROR, "the prefill and decode engines ran different routes, or the decode engine not the "
                         "plan's rollout letters (a warning where exactness is not required)"),
    "PD_CONNECTOR_LOSSY": (ERROR, "an exact run with rlk on the rollout used a KV connector not recorded as moving "
                           "rlk's KV layout unchanged"),
    "PD_READBACK_MISSING": (INCOMPLETE, "a readback the P/D layout lists is absent or unusable"),
    "PD_ENGINE_SILENT": (ERROR, "a P/D engine's readback records no executed op"),
    "PD_DIGEST_MISSING": (ERROR, "a P/D engine's readback carries no contract digest"),
    "PD_DIGEST_DIFFERS": (ERROR, "the prefill and decode engines' readbacks carry different contract digests, or not "
                          "the manifest's"),
    "MODULE_RECORD_MISSING": (ERROR, "a planned module has no record in a side's readbacks"),
    "MODULE_NOT_EXECUTED": (ERROR, "a planned module has call_count 0 on every process of a side"),
    "CASE_MISMATCH": (ERROR, "a module record's case is not this side's letter of the plan"),
    "R_NOT_RLK": (ERROR, "an R side does not report implementation rlk with an rlk backend"),
    "R_CONTRACT_MISSING": (ERROR, "an R side reports no contract id"),
    "FALLBACK": (ERROR, "fallback is set somewhere in a module record (nested ops/provenance included)"),
    "BACKEND_DIVERGES": (ERROR, "a module that is R on both sides ran different rlk backends on the two sides"),
    "P_NOT_PRODUCTION": (ERROR, "a P side does not report implementation production"),
    "P_REPORTS_RLK": (ERROR, "a P side names an rlk backend somewhere in its record"),
    "MODULE_UNPLANNED": (WARNING, "a readback records a module the plan does not contain"),
    # train-data / bitwise
    "TRAIN_DATA_MISSING": (INCOMPLETE, "train-data/ is absent or holds no round files"),
    "TENSOR_FILE_INVALID": (ERROR, "a train-data file cannot be parsed (truncated or corrupt header/data)"),
    "TENSOR_MISSING": (ERROR, "a required tensor is absent from a train-data file"),
    "TENSOR_DTYPE_INVALID": (ERROR, "a tensor has a dtype the contract does not allow"),
    "TENSOR_SHAPE_MISMATCH": (ERROR, "tensors of one file do not share one [S, T] shape"),
    "TENSOR_METADATA_INVALID": (
        ERROR,
        "train-data metadata (schema/round/rank) is absent or disagrees with the file name",
    ),
    "MASK_INVALID": (ERROR, "response_mask holds values other than 0 and 1"),
    "MASK_EMPTY": (ERROR, "response_mask selects no token: nothing was compared"),
    "LOGPROB_NONFINITE": (ERROR, "a log-prob at an active position is NaN or infinite"),
    "TRAIN_LOGPROB_OUTSIDE_KEPT_SET": (
        WARNING,
        "a train log-prob is -inf where the rollout's is finite: the sampled token lies outside the trainer's own "
        "kept set (the sides' top-k / top-p / min-p kept sets differ; a mismatch, not corrupt data)",
    ),
    "LOGPROB_POSITIVE": (ERROR, "a log-prob at an active position is > 0"),
    "MASKED_NONZERO": (WARNING, "a log-prob at a masked position is not 0"),
    "LEGACY_PT_UNAVAILABLE": (INCOMPLETE, "train-data holds legacy .pt files and torch is not importable"),
    "BITWISE_MISMATCH": (ERROR, "train and rollout log-probs differ where bitwise equality is required"),
    "MISMATCH_DIAGNOSTIC": (
        INFO,
        "train/rollout mismatch of a case that is not required to be bitwise equal",
    ),
    # kernel trace (rlk_validate.kernel_trace: `rlk-repro run --trace`)
    "KERNEL_TRACE_MISSING": (INCOMPLETE, "the run asked for a kernel trace (--trace) but kernel-trace.json is absent"),
    "KERNEL_TRACE_INVALID": (ERROR, "kernel-trace.json lacks fields or has wrong types"),
    "KERNEL_TRACE_DISAGREES": (ERROR, "kernel-trace.json's per-family counts differ from those recomputed from its "
                               "kernels"),
    "KERNEL_FAMILY_MISSING": (ERROR, "an all-R run's traced round ran no kernel of a required rlk family (GEMM, "
                              "attention forward / backward, SwiGLU, RMSNorm, log-prob; collective at TP > 1)"),
    "VENDOR_KERNEL_IN_R": (ERROR, "an all-R run's traced round ran a vendor GEMM, vendor / flash attention or "
                           "NCCL / custom all-reduce payload kernel"),
    "KERNEL_TRACE_SUMMARY": (INFO, "the per-family kernel counts of the traced round, per side"),
    # CUDA graphs (rlk_validate.cuda_graphs: the vLLM plugin's cuda_graphs evidence against the manifest)
    "CUDA_GRAPH_EVIDENCE_MISSING": (INCOMPLETE, "the run asked for FULL_DECODE_ONLY CUDA graphs but no vLLM readback "
                                    "records CUDA-graph evidence with decode steps"),
    "CUDA_GRAPH_EVIDENCE_INVALID": (ERROR, "a readback's cuda_graphs field lacks fields or has wrong types"),
    "CUDA_GRAPH_SETTINGS_MISMATCH": (ERROR, "vLLM resolved another cudagraph_mode or other capture sizes than the "
                                     "run asked for"),
    "CUDA_GRAPH_NOT_CAPTURED": (ERROR, "no FULL graph was captured for some requested capture size"),
    "CUDA_GRAPH_DECODE_EAGER": (ERROR, "a decode step of a FULL_DECODE_ONLY run ran without a FULL CUDA graph "
                                "(eager, piecewise, or a batch outside the captured sizes)"),
    "CUDA_GRAPH_DECODE_PADDED": (ERROR, "a decode step replayed a graph of another size than its batch, or one never "
                                 "captured (the exact-size profile)"),
    "CUDA_GRAPH_SUMMARY": (INFO, "CUDA-graph replays per size and steps without a graph, over the vLLM processes"),
    # matrix
    "MATRIX_CELL_MISSING": (INCOMPLETE, "an expected matrix cell directory is absent"),
    "MATRIX_CELL_PLAN_MISMATCH": (ERROR, "a cell's plan is not the plan its name stands for"),
    "MATRIX_CELL_FAILED": (ERROR, "a matrix cell failed validation"),
    "MATRIX_CELL_INCOMPLETE": (INCOMPLETE, "a matrix cell's evidence is incomplete"),
    "MATRIX_UNKNOWN_ENTRY": (WARNING, "an entry of the matrix root is not a known cell name; it was skipped"),
    "MATRIX_WRITE_FAILED": (ERROR, "matrix-report.json / matrix-report.md could not be written"),
    "MATRIX_PROVENANCE_MISMATCH": (
        ERROR,
        "a cell's commit, seeds, inputs or configuration (routes aside) differ from the other cells of the root",
    ),
    # ladder root (rlk-validate ladder, docs/ladder.md)
    "LADDER_OPTIONS_INVALID": (ERROR, "ladder-options.json is not an rlk.ladder-options.v1 list of distinct rungs"),
    "LADDER_RUNG_MISSING": (INCOMPLETE, "a rung of the ladder has neither a run directory nor a skip record"),
    "LADDER_RUNG_FAILED": (ERROR, "a rung's run directory failed validation"),
    "LADDER_RUNG_INCOMPLETE": (INCOMPLETE, "a rung's evidence is incomplete"),
    "LADDER_RUNG_KNOBS_MISMATCH": (ERROR, "a rung's manifest does not show the rung's routes, filters, temperature or "
                                   "quantization"),
    "LADDER_RUNG_SKIPPED": (INFO, "a rung was skipped: the machine or engine lacks what it needs (the reason)"),
    "LADDER_SKIP_INVALID": (ERROR, "a skip record is malformed, names no need of its rung, or sits beside a run of it"),
    "LADDER_UNKNOWN_ENTRY": (WARNING, "an entry of the ladder root is not a rung; it was skipped"),
    "LADDER_PROVENANCE_MISMATCH": (ERROR, "a rung's commit, seeds, inputs or configuration (knobs and routes aside) "
                                   "differ from the other rungs'"),
    "LADDER_REPORT_STALE": (ERROR, "ladder-report.json does not hold what the rungs' data give now"),
    "LADDER_WRITE_FAILED": (ERROR, "ladder-report.json / ladder-report.md could not be written"),
}


@dataclass(frozen=True)
class Finding:
    """One observation of a check."""

    code: str
    severity: str
    message: str
    check: str = ""
    path: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "code": self.code,
            "severity": self.severity,
            "check": self.check,
            "message": self.message,
        }
        if self.path is not None:
            out["path"] = self.path
        if self.details:
            out["details"] = self.details
        return out


def finding(
    code: str,
    message: str,
    *,
    check: str = "",
    path: str | None = None,
    severity: str | None = None,
    **details: Any,
) -> Finding:
    """Build a finding with the code's default severity (unless ``severity`` overrides it)."""
    if code not in CODES:
        raise KeyError(f"unknown finding code {code!r}")
    sev = severity or CODES[code][0]
    if sev not in SEVERITIES:
        raise ValueError(f"unknown severity {sev!r}")
    return Finding(code=code, severity=sev, message=message, check=check, path=path, details=details)


def verdict_of(findings: list[Finding]) -> str:
    """``failed`` if any error, else ``incomplete`` if evidence is missing, else ``passed``."""
    sevs = {f.severity for f in findings}
    if ERROR in sevs:
        return "failed"
    if INCOMPLETE in sevs:
        return "incomplete"
    return "passed"
