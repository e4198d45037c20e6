"""The evidence formats of rlk, defined once and torch-free.

Everything a producer writes into a run directory and everything ``rlk-validate`` checks is named
here: schema ids, closed vocabularies, file names, the fields of each JSON document, the tensors of a
train-data file, and the one atomic JSON writer every producer and the validator write through.
``docs/evidence.md``'s reference tables are generated from this module by
``python -m rlk_validate.evidence_doc --update docs/evidence.md`` (see :mod:`rlk_validate.evidence_doc`).

Closed vocabularies are matched exactly (:func:`is_member`): set membership of a ``str``, no
stripping, no case folding, no prefix matching.

Importing this module has no side effects and imports nothing beyond the standard library.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# -- schema ids ---------------------------------------------------------------------------------
READBACK_SCHEMA = "rlk.readback.v1"
MANIFEST_SCHEMA = "rlk.manifest.v1"
METRICS_SCHEMA = "rlk.metrics.v1"
BITWISE_SCHEMA = "rlk.bitwise-validation.v1"
TRAIN_DATA_SCHEMA = "rlk.train-data.v1"
RUN_VALIDATION_SCHEMA = "rlk.run-validation.v1"
MATRIX_REPORT_SCHEMA = "rlk.matrix-report.v1"
COMPLETE_SCHEMA = "rlk.complete.v1"
MATRIX_OPTIONS_SCHEMA = "rlk.matrix-options.v1"
# a ladder root of `rlk-repro ladder` (docs/ladder.md)
LADDER_OPTIONS_SCHEMA = "rlk.ladder-options.v1"
LADDER_REPORT_SCHEMA = "rlk.ladder-report.v1"
LADDER_SKIP_SCHEMA = "rlk.ladder-skip.v1"
# a VIME run's artifact directory, before `rlk-validate import-vime` (docs/vime.md)
VIME_LAUNCH_SCHEMA = "rlk.vime-launch.v1"
VIME_ENVIRONMENT_SCHEMA = "rlk.vime-environment.v1"
VIME_LOGPROBS_SCHEMA = "rlk.vime-logprobs.v1"
KERNEL_TRACE_SCHEMA = "rlk.kernel-trace.v1"  # `rlk-repro run --trace` (rlk_validate.kernel_trace)
VIME_DUMPS_COMPARISON_SCHEMA = "rlk.vime-dumps-comparison.v1"  # `rlk-validate vime-dumps --json`
CONTRACT_DIGEST_SCHEMA = "rlk.contract-digest.v1"  # the handshake's document (rlk_validate.digest, issue 37)
PD_LAYOUT_SCHEMA = "rlk.pd-layout.v1"  # the manifest's Prefill/Decode layout (rlk_validate.pd, issue 37)

#: document kind -> schema id
SCHEMAS: dict[str, str] = {
    "readback": READBACK_SCHEMA,
    "manifest": MANIFEST_SCHEMA,
    "metrics": METRICS_SCHEMA,
    "bitwise-validation": BITWISE_SCHEMA,
    "train-data": TRAIN_DATA_SCHEMA,
    "run-validation": RUN_VALIDATION_SCHEMA,
    "matrix-report": MATRIX_REPORT_SCHEMA,
    "complete": COMPLETE_SCHEMA,
    "matrix-options": MATRIX_OPTIONS_SCHEMA,
    "ladder-options": LADDER_OPTIONS_SCHEMA,
    "ladder-report": LADDER_REPORT_SCHEMA,
    "ladder-skip": LADDER_SKIP_SCHEMA,
    "vime-launch": VIME_LAUNCH_SCHEMA,
    "vime-environment": VIME_ENVIRONMENT_SCHEMA,
    "vime-logprobs": VIME_LOGPROBS_SCHEMA,
    "kernel-trace": KERNEL_TRACE_SCHEMA,
    "vime-dumps-comparison": VIME_DUMPS_COMPARISON_SCHEMA,
    "contract-digest": CONTRACT_DIGEST_SCHEMA,
    "pd-layout": PD_LAYOUT_SCHEMA,
}

# -- closed vocabularies ------------------------------------------------------------------------
MODULES = ("attention", "ffn", "logp")
SIDES = ("train", "rollout")
LETTERS = ("P", "R")  # P: the framework's production implementation; R: rlk
CASES = ("P/P", "P/R", "R/P", "R/R")  # X/Y: X for the train side, Y for the rollout side
MODES = ("strict", "audit")  # readback policy (RL_KERNEL_MODE)
FRAMEWORKS = ("megatron", "vllm", "local")
#: side -> readback ``target``
TARGETS = {"train": "training", "rollout": "rollout"}
#: readback ``target`` -> side
TARGET_SIDE = {t: s for s, t in TARGETS.items()}
#: framework -> the targets it may write
FRAMEWORK_TARGETS = {"megatron": ("training",), "vllm": ("rollout",), "local": ("training", "rollout")}
PRODUCTION = "production"
RLK = "rlk"
IMPLEMENTATIONS = (PRODUCTION, RLK)
#: case letter -> the implementation a module record of that side must report
IMPLEMENTATION_OF = {"P": PRODUCTION, "R": RLK}
EXECUTION_MODES = ("eager", "graph", "mixed")
RLK_BACKEND_PREFIX = "rlk."
PRODUCTION_BACKEND_PREFIX = "production."
#: manifest modes that fix the plan (other modes, e.g. ``matrix``, accept any plan)
PRESET_MODES = {"native": "P/P", "consistency": "R/R"}
#: keys read as fallback flags anywhere in a module record (besides ``fallback_*count`` / ``*calls``)
FALLBACK_KEYS = ("fallback", "fallbacks", "fallback_used")


def is_member(value: Any, vocabulary: Any) -> bool:
    """Exact membership: ``value`` is a ``str`` equal to an element (or key) of ``vocabulary``."""
    return type(value) is str and value in vocabulary


def is_rlk_backend(value: Any, allowed: Any = ()) -> bool:
    """An rlk backend id: ``rlk.<name>`` (a non-empty name) or an explicitly allowed plug-in id."""
    if type(value) is not str:
        return False
    if value in allowed:
        return True
    return value.startswith(RLK_BACKEND_PREFIX) and len(value) > len(RLK_BACKEND_PREFIX) and value.isprintable()


#: backend id -> the backend whose very binaries it launches (``rlk.cuda`` runs ``rlk.triton``'s kernels
#: compiled ahead of time): the two give the same bits, so a route may mix them (rlk-core's
#: ``Backend.same_bits_as`` reads this table).
SAME_BITS_AS = {"rlk.cuda": "rlk.triton"}


def bits_of(backend_id: str) -> str:
    """The backend whose bits ``backend_id`` gives: itself, or what it declares in :data:`SAME_BITS_AS`."""
    return SAME_BITS_AS.get(backend_id, backend_id)


def side_letter(case: str, side: str) -> str:
    """This side's letter of an ``X/Y`` case."""
    return case[0 if side == "train" else 2]


# -- informative tokens ---------------------------------------------------------------------------
#: a compared token is *informative* when its rollout log-prob is below this (probability < 0.999): equal bits of
#: saturated log-probs (a collapsed policy's 0.0) prove little, so every bitwise count is also given over these
INFORMATIVE_LOGP = -1e-3
#: a round whose compared tokens are informative less often than this is flagged (``--min-informative-fraction``):
#: the collapsed policies of issue 41 fell to 4% and 0.3%; a peaked but live policy stays far above
MIN_INFORMATIVE_FRACTION = 0.1


# -- file names ---------------------------------------------------------------------------------
MANIFEST = "manifest.json"
RUN_LOG = "run.log"
EXIT_CODE = "exit-code"
READBACKS_DIR = "readbacks"
TRAIN_DATA_DIR = "train-data"
METRICS = "metrics.jsonl"
BITWISE = "bitwise-validation.json"
RUN_VALIDATION = "run-validation.json"
COMPLETE = "COMPLETE"
REPORT_DIR = "report"
MATRIX_REPORT_JSON = "matrix-report.json"
MATRIX_REPORT_MD = "matrix-report.md"
#: entries that mark a directory as a run directory
RUN_MARKERS = (MANIFEST, READBACKS_DIR, TRAIN_DATA_DIR, EXIT_CODE, BITWISE, METRICS)
#: what ``rlk-repro matrix`` records at a matrix root: the options every cell runs with (``--resume`` reads them)
MATRIX_OPTIONS = "matrix-options.json"
#: the lock file of a matrix root (held by the one ``rlk-repro matrix`` process writing it; names the holder)
MATRIX_LOCK = ".rlk-matrix.lock"
#: a ladder root's files (``rlk-repro ladder``): its options and rungs, its report, a skipped rung's record
LADDER_OPTIONS = "ladder-options.json"
LADDER_REPORT_JSON = "ladder-report.json"
LADDER_REPORT_MD = "ladder-report.md"
LADDER_SKIP_SUFFIX = ".skipped.json"


def is_run_dir(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a run directory: it holds an ``rlk.manifest.v1`` manifest, or the ``readbacks/`` and
    ``train-data/`` folders every producer creates first. Reads at most the manifest's first 4 KiB."""
    p = Path(path)
    if (p / READBACKS_DIR).is_dir() and (p / TRAIN_DATA_DIR).is_dir():
        return True
    try:
        with open(p / MANIFEST, "rb") as fh:
            head = fh.read(4096)
    except OSError:
        return False
    return MANIFEST_SCHEMA.encode() in head


def enclosing_run_dir(path: str | os.PathLike[str]) -> Path | None:
    """The run directory that is ``path`` or holds it (its nearest such ancestor), or None: a run directory is
    append-only and sealed as a whole, so nothing creates a run or a matrix inside one."""
    p = Path(os.path.abspath(os.fspath(path)))
    for d in (p, *p.parents):
        if d.is_dir() and is_run_dir(d):
            return d
    return None

# -- matrix cells -------------------------------------------------------------------------------
#: the cells of a matrix root: ``control-RR`` (all R/R), ``<module>-<XY>`` (that module at X/Y, the others
#: R/R) and optionally ``native-PP`` (all P/P)
CONTROL_CELL = "control-RR"
NATIVE_CELL = "native-PP"
ISOLATION_CELLS = tuple(f"{m}-{xy}" for m in MODULES for xy in ("PR", "RP", "PP"))
REQUIRED_CELLS = (CONTROL_CELL, *ISOLATION_CELLS)
MATRIX_CELLS = (*REQUIRED_CELLS, NATIVE_CELL)


#: manifest fields every cell of one matrix root shares (the run's provenance and configuration)
MATRIX_SHARED_FIELDS = ("engine", "rounds", "ranks", "repos", "packages", "inputs", "seeds", "config")
#: ``config`` keys that follow from a cell's routes and so may differ between cells
ROUTE_CONFIG_KEYS = ("plan", "plan_sources", "env", "mode", "require_exact", "exact_required", "command", "run_id")


def expected_plan(name: str) -> tuple[str, dict[str, str]] | None:
    """``(role, plan)`` a cell name stands for (exact names only), or None for a name that is not a cell."""
    if not is_member(name, MATRIX_CELLS):
        return None
    if name == CONTROL_CELL:
        return "control", {m: "R/R" for m in MODULES}
    if name == NATIVE_CELL:
        return "native", {m: "P/P" for m in MODULES}
    module, xy = name.split("-")
    plan = {m: "R/R" for m in MODULES}
    plan[module] = f"{xy[0]}/{xy[1]}"
    return "isolation", plan


def readback_name(framework: str, target: str, pid: int) -> str:
    return f"{framework}-{target}-{pid}.json"


def train_data_name(rnd: int, rank: int) -> str:
    return f"round-{rnd:04d}.rank{rank}.safetensors"


# -- documents ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One field of a JSON document: name, JSON type, whether required, meaning."""

    name: str
    type: str
    required: bool
    doc: str


def _f(name: str, type_: str, doc: str, required: bool = True) -> Field:
    return Field(name, type_, required, doc)


READBACK_FIELDS = (
    _f("schema", "string", f"`{READBACK_SCHEMA}`"),
    _f("framework", "string", " / ".join(f"`{x}`" for x in FRAMEWORKS)),
    _f("target", "string", "`training` / `rollout` (`megatron` writes training, `vllm` rollout, `local` either)"),
    _f("side", "string", "`train` / `rollout`, the side of `target`"),
    _f("pid", "integer", ">= 0; the file is named `<framework>-<target>-<pid>.json`"),
    _f("rank", "integer", ">= 0, below `world_size`"),
    _f("world_size", "integer", ">= 1"),
    _f("hostname", "string", "the host of the process"),
    _f("run_id", "string or null", "the run's id; when not null, equal to the manifest's"),
    _f("mode", "string", " / ".join(f"`{x}`" for x in MODES)),
    _f("created_at", "string", "UTC ISO time of the first write"),
    _f("updated_at", "string", "UTC ISO time of the last write"),
    _f("plan", "object", "module -> case (`X/Y`, X and Y in P, R) the process saw"),
    _f("hooks", "array", "installed hooks: `name`, `target`, `kind`, `installed` (bool)"),
    _f("modules", "object", "module -> module record (below)"),
    _f("cuda_graphs", "object", "vLLM only: its CUDA-graph settings, captured graphs and per-step graph decisions "
       "(rlk_vllm_plugin.cudagraphs; checked by rlk_validate.cuda_graphs, docs/validate.md)", required=False),
    _f("annotations", "object", "per-process observations an adapter records beside the op records "
       "(`ReadbackRecorder.tally` / `annotate`): topic (`[a-z][a-z0-9_]*`) -> object with `counts` (name -> integer "
       ">= 0) and marks (JSON scalars). The vLLM plugin's `sampling`: requests its sampler took, counts `greedy`, "
       "`sampled`, `greedy_with_logprobs`, `sampled_with_logprobs`, marks `comparable` (false once a greedy request "
       "asked for log-probs), `reason`, `counted` (docs/vllm.md); read by rlk_validate.greedy", required=False),
    _f("contract_digest", "object", "the contract digest handshake (`rlk.contract-digest.v1`, issue 37): `digest` "
       "(`sha256:<hex>` of the canonical JSON of `document`), `document` (plan, device type, TP-invariant leaves, "
       "sampling parameters, per R/R module its contract ids, backend families and source hashes), `detail` (this "
       "side's op -> backend and log-prob semantics) and `checks` (`at`: `start` / `sync <n>`, `digest`)",
       required=False),
)
MODULE_RECORD_FIELDS = (
    _f("case", "string", "this side's letter of `plan[module]`: `P` or `R`"),
    _f("implementation", "string", f"`{RLK}` for R, `{PRODUCTION}` for P"),
    _f("backend_id", "string", "the backend of most calls: `rlk.<name>` or `production.<what>`"),
    _f("contract_id", "string or null", "the contract of the arithmetic (null for production)"),
    _f("call_count", "integer", ">= 0, summed over the module's ops"),
    _f("execution_mode", "string", " / ".join(f"`{x}`" for x in EXECUTION_MODES)),
    _f("fallback", "boolean", "whether any call fell back (audit mode only; strict refuses)"),
    _f("fallback_reason", "string or null", "why it fell back"),
    _f("ops", "object", "op name -> op record (below)"),
)
OP_RECORD_FIELDS = (
    _f("backend_id", "string", "the backend that executed this op"),
    _f("contract_id", "string or null", "its contract id"),
    _f("call_count", "integer", ">= 0"),
    _f("execution_mode", "string", " / ".join(f"`{x}`" for x in EXECUTION_MODES)),
    _f("fallback", "boolean", "whether it fell back"),
    _f("fallback_reason", "string or null", "why"),
    _f("provenance", "object", "free-form (device, dtype, ...); fallback keys inside are read too"),
)
MANIFEST_FIELDS = (
    _f("schema", "string", f"`{MANIFEST_SCHEMA}`"),
    _f("run_id", "string", "the run's id (its directory name)"),
    _f("created_at", "string", "UTC ISO time"),
    _f("engine", "string", "`local`, `frameworks` or `vime`"),
    _f("mode", "string", "`consistency` (all R/R), `native` (all P/P) or another mode (e.g. `matrix`)"),
    _f("command", "array of strings", "the command line"),
    _f("plan", "object", "module -> case; every module of the run"),
    _f("rounds", "integer", ">= 1: rounds (rollout steps) the run is expected to produce"),
    _f("ranks", "integer", ">= 1: train-data files expected per round"),
    _f("repos", "array", "non-empty; each `name`, `path`, `sha` (40 or 64 hex), `dirty` (bool), optional `error`"),
    _f("packages", "object", "non-empty; package name -> version string"),
    _f("hardware", "object", "`device`, `name`, `driver`"),
    _f("inputs", "object", "non-empty; input name -> `sha256:<64 hex>`"),
    _f("seeds", "object", "seed name -> integer"),
    _f("config", "object", "the run configuration (free-form)", required=False),
    _f("contract_digest", "string", "`sha256:<hex>`: the contract digest both sides agreed on before the first "
       "round; every readback then carries it", required=False),
    _f("rollout_quantization", "string", "`none` or `fp8` (vLLM's FP8 weights and activations on the rollout, the "
       "trainer BF16): a quantized rollout is a mismatch knob, never a bitwise claim", required=False),
    _f("pd", "object", "a Prefill/Decode split's layout (`rlk.pd-layout.v1`, issue 37; `rlk-repro plan --pd`): "
       "`prefill` / `decode` each with `kv_role` (`kv_producer` / `kv_consumer`), `routes` (module -> `P` / `R`) and "
       "`readbacks` (the run-directory paths of its processes' readbacks), `connector` (`class`, "
       "`lossless_for_rlk_layout`, ...), `placement`; checked by rlk_validate.pd", required=False),
)
METRICS_FIELDS = (
    _f("schema", "string", f"`{METRICS_SCHEMA}`"),
    _f("round", "integer", ">= 0, below the manifest's `rounds`; one line per round"),
    _f("compared_tokens", "integer", "active tokens of the round; recomputed", required=False),
    _f("mismatch_count", "integer", "tokens whose two fp32 log-probs differ in bits; recomputed", required=False),
    _f("max_abs_diff", "number", "max `|train - rollout|`; recomputed (relative 1e-5)", required=False),
    _f("mean_abs_diff", "number", "mean `|train - rollout|`; recomputed (relative 1e-3)", required=False),
    _f("reward_mean", "number", "mean of the round's `rewards` tensor (recomputed when present)", required=False),
    _f("loss", "number", "training loss", required=False),
    _f("rollout_tokens_per_s", "number", "rollout throughput", required=False),
    _f("train_tokens_per_s", "number", "training throughput", required=False),
    _f("peak_memory_bytes", "integer", "peak device memory", required=False),
    _f("weights_changed", "boolean", "whether the weight update changed the rollout weights (all false over the "
       "updates between rounds: `WEIGHTS_STATIC`)", required=False),
    _f("informative_tokens", "integer", "compared tokens with a rollout log-prob below -1e-3; recomputed",
       required=False),
    _f("informative_mismatch_count", "integer", "mismatches among them; recomputed", required=False),
    _f("informative_fraction", "number", "`informative_tokens / compared_tokens`", required=False),
    _f("sampled_nll_mean", "number", "mean `-log p` of the sampled tokens (nats): an estimate of the sampling "
       "distribution's entropy", required=False),
    _f("entropy_mean", "number", "mean entropy (nats) of `softmax(logits / T)` at the sampled positions, where "
       "the engine computes it (local)", required=False),
    _f("max_entropy", "number", "`log V`, the entropy of a uniform next-token distribution", required=False),
    _f("distinct_responses", "integer", "distinct responses of the round's samples", required=False),
    _f("routing_compared_tokens", "integer", "an MoE model's tokens whose expert choice both sides recorded (every "
       "token run through the model)", required=False),
    _f("routing_mismatch_tokens", "integer", "those routed to a different expert set (at any layer) by the rollout "
       "than by the trainer", required=False),
    _f("routing_mismatch_fraction", "number", "`routing_mismatch_tokens / routing_compared_tokens`", required=False),
    _f("routing_mismatch_layer_tokens", "integer", "the (token, layer) pairs whose expert sets differ",
       required=False),
    _f("contract_digest", "string", "the contract digest both sides agreed on after the round's weight sync",
       required=False),
)
BITWISE_FIELDS = (
    _f("schema", "string", f"`{BITWISE_SCHEMA}`"),
    _f("require_exact", "boolean", "whether the run required bitwise equality"),
    _f("torch_equal", "boolean", "`mismatch_count == 0`"),
    _f("element_count", "integer", "active tokens compared, all rounds; recomputed"),
    _f("mismatch_count", "integer", "mismatched tokens, all rounds; recomputed"),
    _f("max_abs_diff", "number", "max `|train - rollout|`, all rounds; recomputed"),
    _f("mean_abs_diff", "number", "mean `|train - rollout|`, all rounds; recomputed", required=False),
    _f("informative_count", "integer", "compared tokens with a rollout log-prob below -1e-3; recomputed",
       required=False),
    _f("informative_mismatch_count", "integer", "mismatches among them; recomputed", required=False),
    _f("rounds", "array", "one object per round (below); non-empty"),
    _f("fallback_failures", "integer", "modules that fell back; > 0 fails the run"),
)
BITWISE_ROUND_FIELDS = (
    _f("round", "integer", ">= 0, each round once"),
    _f("element_count", "integer", "recomputed"),
    _f("mismatch_count", "integer", "recomputed"),
    _f("max_abs_diff", "number", "recomputed"),
    _f("mean_abs_diff", "number", "recomputed", required=False),
    _f("informative_count", "integer", "recomputed", required=False),
    _f("informative_mismatch_count", "integer", "recomputed", required=False),
)
COMPLETE_FIELDS = (
    _f("schema", "string", f"`{COMPLETE_SCHEMA}`"),
    _f("run_validation_sha256", "string", "64 hex: sha256 of the bytes of `run-validation.json`; re-checked"),
    _f("sealed_at", "string", "UTC ISO time"),
    _f("validator", "object", "`name` (`rlk-validate`), `version`"),
    _f("signature", "object", "`--sign-key`: `scheme` (`ed25519`), `key_id` (`sha256:` of the raw public key), "
       "`public_key`, `value` (base64): over the canonical JSON of the other fields", required=False),
)
MATRIX_OPTIONS_FIELDS = (
    _f("schema", "string", f"`{MATRIX_OPTIONS_SCHEMA}`"),
    _f("created_at", "string", "UTC ISO time"),
    _f("command", "array of strings", "the command that created the root"),
    _f("options", "object", "every experiment option of the matrix (`--resume` runs them again)"),
    _f("config", "object", "a cell's run configuration less its routes (`--resume` refuses another one)"),
)

KERNEL_TRACE_FIELDS = (
    _f("schema", "string", f"`{KERNEL_TRACE_SCHEMA}`"),
    _f("source", "string", "the profiler (`torch.profiler (torch <version>)`)"),
    _f("device", "string", "`cpu` or `cuda[:N]`"),
    _f("units", "string", "`kernels` (CUDA) or `cpu operators`"),
    _f("round", "integer", "the traced round (the attempt's first)"),
    _f("tp", "integer", ">= 1: tensor-parallel size (the `collective` family is required only above 1)"),
    _f("sides", "object", "`rollout` and `train`, each `{families: {family: count}, units: [[name, context or null, "
       "count], ...]}`; families are recomputed from the units (docs/validate.md)"),
)

#: document -> (title, fields)
DOCUMENTS: dict[str, tuple[str, tuple[Field, ...]]] = {
    "readback": (f"`readbacks/*.json` — `{READBACK_SCHEMA}`", READBACK_FIELDS),
    "readback.module": ("readback module record (`modules.<module>`)", MODULE_RECORD_FIELDS),
    "readback.op": ("readback op record (`modules.<module>.ops.<op>`)", OP_RECORD_FIELDS),
    "manifest": (f"`{MANIFEST}` — `{MANIFEST_SCHEMA}`", MANIFEST_FIELDS),
    "metrics": (f"`{METRICS}` — `{METRICS_SCHEMA}`, one object per line", METRICS_FIELDS),
    "bitwise-validation": (f"`{BITWISE}` — `{BITWISE_SCHEMA}`", BITWISE_FIELDS),
    "bitwise-validation.round": ("`bitwise-validation.json` round (`rounds[i]`)", BITWISE_ROUND_FIELDS),
    "complete": (f"`{COMPLETE}` — `{COMPLETE_SCHEMA}`", COMPLETE_FIELDS),
    "matrix-options": (f"`{MATRIX_OPTIONS}` (matrix root) — `{MATRIX_OPTIONS_SCHEMA}`", MATRIX_OPTIONS_FIELDS),
    "kernel-trace": (f"`kernel-trace.json` — `{KERNEL_TRACE_SCHEMA}`", KERNEL_TRACE_FIELDS),
}


def required_fields(document: str) -> tuple[str, ...]:
    return tuple(f.name for f in DOCUMENTS[document][1] if f.required)


# -- train-data tensors -------------------------------------------------------------------------
@dataclass(frozen=True)
class Tensor:
    """One tensor of a train-data file: safetensors dtypes allowed, shape, required, meaning."""

    name: str
    dtypes: tuple[str, ...]
    shape: str
    required: bool
    doc: str


TRAIN_DATA_TENSORS = (
    Tensor("token_ids", ("I64", "I32"), "[S, T]", True, "prompt + response tokens"),
    Tensor("response_mask", ("BOOL", "U8"), "[S, T]", True, "1 where a sampled response token is compared"),
    Tensor("rollout_logprobs", ("F32",), "[S, T]", True, "the rollout engine's log-prob (0 where masked)"),
    Tensor("train_logprobs", ("F32",), "[S, T]", True, "the trainer's recomputed log-prob (0 where masked)"),
    Tensor("rewards", ("F32",), "[S]", False, "the reward of each sequence; `reward_mean` is checked against it"),
    Tensor("advantages", ("F32",), "[S]", False, "the advantage each sequence was trained with"),
)
TRAIN_DATA_NAMES = tuple(t.name for t in TRAIN_DATA_TENSORS)
TRAIN_DATA_REQUIRED = tuple(t.name for t in TRAIN_DATA_TENSORS if t.required)
TRAIN_DATA_PER_SEQUENCE = tuple(t.name for t in TRAIN_DATA_TENSORS if t.shape == "[S]")
#: safetensors ``__metadata__`` keys (all strings)
TRAIN_DATA_METADATA = {
    "schema": f"`{TRAIN_DATA_SCHEMA}`",
    "round": "decimal ASCII digits",
    "rank": "decimal ASCII digits",
}


# -- the readback JSON Schema -------------------------------------------------------------------
def readback_json_schema() -> dict[str, Any]:
    """The JSON Schema of ``rlk.readback.v1`` (shipped as ``rlk_validate/schemas/readback.v1.json``)."""
    return json.loads((Path(__file__).parent / "schemas" / "readback.v1.json").read_text(encoding="utf-8"))


# -- the atomic JSON writer ---------------------------------------------------------------------
def json_text(doc: Any, *, indent: int | None = 2, sort_keys: bool = False) -> str:
    """Strict JSON text (``allow_nan=False``), newline-terminated."""
    return json.dumps(doc, indent=indent, sort_keys=sort_keys, allow_nan=False) + "\n"


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> str:
    """Write ``data`` to ``path`` atomically: a private temp file in the same directory (``O_EXCL``),
    fsync, ``os.replace``. The temp file is removed on any error. Returns the path written."""
    path = os.fspath(path)
    d, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(d, f".{name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o644)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def write_json_atomic(
    path: str | os.PathLike[str], doc: Any, *, indent: int | None = 2, sort_keys: bool = False
) -> str:
    """Write ``doc`` as strict JSON to ``path`` atomically (see :func:`write_bytes_atomic`).

    The document is serialised first (``allow_nan=False``: NaN or infinity raise ``ValueError``), so a
    document that cannot be written leaves nothing behind.
    """
    return write_bytes_atomic(path, json_text(doc, indent=indent, sort_keys=sort_keys).encode("utf-8"))
