"""Every ``RL_KERNEL_*`` / ``RLK_*`` environment variable rlk reads, declared once.

Each entry has a name, a parser, a default and a doc string; ``docs/envvars.md`` is generated from
this table (``python -m rlk_core.envs > docs/envvars.md``). Nothing here reads the environment at
import time: call :func:`get` (one variable) or :func:`snapshot` (all of them) when a value is needed.
A bad value raises :class:`~rlk_core.errors.RlkConfigError` naming the variable, the value and the
allowed values.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_validate.evidence import CASES, MODES


@dataclass(frozen=True)
class EnvVar:
    name: str
    parser: Callable[[str, EnvVar], Any]
    default: Any
    doc: str
    allowed: tuple[str, ...] | None = None
    allowed_doc: str | None = None

    def parse(self, raw: str | None) -> Any:
        if raw is None or raw == "":
            return self.default
        return self.parser(raw, self)

    def error(self, raw: str, extra: str = "") -> RlkConfigError:
        allowed = self.allowed_doc or (", ".join(self.allowed) if self.allowed else "see docs/envvars.md")
        msg = f"{self.name}={raw!r} is not valid; allowed: {allowed}"
        return RlkConfigError(msg + (f" ({extra})" if extra else ""))


def _choice(raw: str, var: EnvVar) -> str:
    value = raw.strip()
    if var.allowed is not None and value.upper() in {a.upper() for a in var.allowed}:
        return next(a for a in var.allowed if a.upper() == value.upper())
    raise var.error(raw)


def parse_case(raw: str, origin: str) -> str:
    """The one spelling rule of a route case, for variables and command-line flags alike: ``X/Y`` with X
    and Y each ``P`` or ``R``, either letter case, surrounding blanks ignored; anything else (``RR``,
    ``R-R``, ``R/X``, ``R/R/R``) raises :class:`RlkConfigError` naming ``origin`` and the allowed values."""
    value = raw.strip().upper() if isinstance(raw, str) else raw
    if not isinstance(value, str) or value not in CASES:
        raise RlkConfigError(f"{origin}={raw!r} is not a case; allowed: {', '.join(CASES)} "
                             "(X = train side, Y = rollout side; P = production, R = rlk)")
    return value


def _case(raw: str, var: EnvVar) -> str:
    return parse_case(raw, var.name)


def _bool(raw: str, var: EnvVar) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise var.error(raw)


def _path(raw: str, var: EnvVar) -> str:
    return os.path.abspath(os.path.expanduser(raw.strip()))


def _text(raw: str, var: EnvVar) -> str:
    value = raw.strip()
    if any(c in value for c in "/\\\n\0"):
        raise var.error(raw, "must not contain path separators, newlines or NUL")
    return value


def _dotted(raw: str, var: EnvVar) -> str:
    value = raw.strip()
    parts = value.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise var.error(raw)
    return value


def _count(raw: str, var: EnvVar) -> int:
    value = raw.strip()
    if not value.isdigit() or int(value) < 1:
        raise var.error(raw)
    return int(value)


def _tp_leaves(raw: str, var: EnvVar) -> int:
    """``off`` / ``0`` -> 0 (invariant mode off), ``on`` -> 8, or G itself: a power of two >= 2."""
    value = raw.strip().lower()
    if value in ("off", "0", "false"):
        return 0
    if value in ("on", "true"):
        return 8  # rlk_core.tp.DEFAULT_LEAVES (envs imports nothing of rlk_core's ops)
    if value.isdigit() and int(value) >= 2 and not int(value) & (int(value) - 1):
        return int(value)
    raise var.error(raw)


def _tp_emulate(raw: str, var: EnvVar) -> tuple[int, bool, bool] | None:
    """``off`` / ``0`` -> None; ``t[,sp][,bi]`` -> ``(t, sp, bi)``: t a power of two >= 2."""
    value = raw.strip().lower().replace(" ", "")
    if value in ("off", "0", "false"):
        return None
    t, *flags = value.split(",")
    if t.isdigit() and int(t) >= 2 and not int(t) & (int(t) - 1) and set(flags) <= {"sp", "bi"} \
            and len(set(flags)) == len(flags):
        return int(t), "sp" in flags, "bi" in flags
    raise var.error(raw)


def _targets(raw: str, var: EnvVar) -> tuple[str, ...]:
    items = tuple(t.strip() for t in raw.split(",") if t.strip())
    if not all(t.count(":") == 1 and all(t.split(":")) for t in items):
        raise var.error(raw)
    return items


def _names(raw: str, var: EnvVar) -> tuple[str, ...]:
    items = tuple(t.strip() for t in raw.split(",") if t.strip())
    if not items or not all(t.isidentifier() for t in items):
        raise var.error(raw)
    return items


def _sampling(raw: str, var: EnvVar) -> dict[str, float]:
    """``top_k=40,top_p=0.95,min_p=0.05`` (any subset) -> ``{"top_k": 40, "top_p": 0.95, "min_p": 0.05}``, checked."""
    out: dict[str, float] = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
    for part in filter(None, (x.strip() for x in raw.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in out:
            raise var.error(raw, f"{part!r} is not top_k=N, top_p=P or min_p=P")
        try:
            out[key] = int(value) if key == "top_k" else float(value)
        except ValueError:
            raise var.error(raw, f"{key}={value!r} is not a number") from None
    if out["top_k"] < 0 or not 0 < out["top_p"] <= 1 or not 0 <= out["min_p"] <= 1:
        raise var.error(raw, "top_k >= 0, 0 < top_p <= 1, 0 <= min_p <= 1")
    return out


def _backend_overrides(raw: str, var: EnvVar) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        op, sep, backend = item.partition("=")
        if not sep or not op.strip() or not backend.strip():
            raise var.error(raw, f"item {item!r} is not OP=BACKEND_ID")
        out[op.strip()] = backend.strip()
    return out


CASE_DOCS = {  # module -> what its case variable routes (the modules of rlk_validate.evidence.MODULES, in order)
    "attention": "Route of the attention module, train side / rollout side (P = framework production, R = rlk).",
    "ffn": "Route of the FFN module (post-attention RMSNorm, gate/up, SwiGLU, down projection).",
    "logp": "Route of the log-prob module (final RMSNorm, LM head, temperature, log-softmax, selection).",
}
CASE_VARS = {module: f"RL_KERNEL_{module.upper()}_CASE" for module in CASE_DOCS}  # the one spelling of the names

ENV_VARS: tuple[EnvVar, ...] = (
    *(EnvVar(CASE_VARS[module], _case, "P/P", doc, CASES) for module, doc in CASE_DOCS.items()),
    EnvVar("RL_KERNEL_MODE", _choice, "strict",
           "strict: any fallback on an R side raises and an rlk backend on a P side is an error. "
           "audit: both are recorded in the readback and the run continues.", MODES),
    EnvVar("RL_KERNEL_TP_INVARIANT", _tp_leaves, 0,
           "TP-invariant mode (contract rlk.gemm.tp.v1, docs/ops/linear_tp.md): every row-parallel linear cuts K "
           "into G fixed leaves merged by one tree, so any TP dividing G gives the same bits and the train TP may "
           "differ from the rollout TP. The value is G, the largest TP the run supports; set the same on both sides. "
           "Unset / off: row-parallel linears sum per-rank partials (rlk.gemm.bi.v1), and strict mode refuses a "
           "train TP that differs from the rollout TP.",
           allowed_doc="off, 0, on (= 8), or a power of two >= 2 (2, 4, 8, 16, ...)"),
    EnvVar("RL_KERNEL_TP_EMULATE", _tp_emulate, None,
           "Megatron provider, emulated TP on one process (docs/ops/linear_tp.md, 'Emulated TP on one GPU'): a model "
           "built at real TP 1 in TP-invariant mode runs every TP-split op as the t ranks of TP t would — each rank's "
           "shard with its own launches and shapes (row- and column-parallel linears, their input gradients, the "
           "attention heads, the q/k norms' head leaves), the ranks' fp32 partials merged in process by "
           "rlk_collectives.merge_partials (the rank tree of all_reduce_partials) and rounded once. ',sp' adds "
           "Megatron's sequence parallelism: the reduce-scatter as the ranks' rows of the merge, the norms' weight "
           "gradients over the ranks' token leaves. ',bi' is the negative control: the row-parallel linears as "
           "rlk.gemm.bi.v1 per rank (each rank's linear on its K slice, the rank outputs summed by the "
           "rlk.collective.v1 tree: what real TP t computes without invariant mode), everything else as with the "
           "mode. Needs RL_KERNEL_TP_INVARIANT=G with t dividing G and a real TP of 1. Proves every rank's "
           "arithmetic, not the transport. Unset / off: no emulation.",
           allowed_doc="off, 0, or t with optional ,sp and ,bi (t a power of two >= 2 dividing "
           "RL_KERNEL_TP_INVARIANT): 4, 4,sp, 4,bi, 4,sp,bi"),
    EnvVar("RL_KERNEL_READBACK_DIR", _path, None,
           "Directory that receives one rlk.readback.v1 JSON per (framework, target, process). "
           "Unset: nothing is written.", allowed_doc="a directory path"),
    EnvVar("RL_KERNEL_VLLM_UNFILTERED_LOGPROBS", _bool, False,
           "vLLM, logp R: return the unfiltered log softmax(logits / T) of the sampled tokens instead of the "
           "processed log-prob over the kept set of top-k / top-p / min-p (sampling stays filtered). Unset: the "
           "processed log-prob (contract rlk.logp.processed.v1), vLLM's processed_logprobs semantics.",
           ("1", "0", "true", "false")),
    EnvVar("RL_KERNEL_VLLM_MOE_ROUTING", _bool, False,
           "vLLM, MoE models on Model Runner V2: record every computed token's k expert ids at every FusedMoE layer "
           "(under ffn R rlk's, under P vLLM's router's) per request and position, for the routing diagnostic "
           "(rlk_vllm_plugin.moe.take_routing). Unset: nothing recorded.", ("1", "0", "true", "false")),
    EnvVar("RL_KERNEL_VLLM_KEPT_EXPORT", _bool, False,
           "vLLM, logp R: after every sampling step, append one JSON line per sampled token to "
           "rlk-kept-<pid>.jsonl beside the readbacks (RL_KERNEL_READBACK_DIR/<hostname>/): req_id, pos, token, "
           "temperature, the kept set's threshold (value, token_id) and size (contract rlk.logp.processed.v1), "
           "greedy and comparable. Costs a host sync per step. Unset: nothing is written.",
           ("1", "0", "true", "false")),
    EnvVar("RL_KERNEL_LOGP_SAMPLING", _sampling, None,
           "Megatron, logp R: the rollout's filters (e.g. top_k=40,top_p=0.95,min_p=0.05). The trainer then finds "
           "each position's kept set from its own logits and computes the processed log-prob over it (contract "
           "rlk.logp.processed.v1), the bits vLLM's rlk sampler returns; no keep-mask replay is needed. Unset: "
           "the unfiltered log-prob (or the request's keep mask).",
           allowed_doc="comma-separated top_k=N, top_p=P, min_p=P"),
    EnvVar("RL_KERNEL_VLLM_ATTENTION_OVERRIDE", _choice, None,
           "vLLM, attention R, for launchers that cannot pass --attention-backend CUSTOM: register rlk's backend "
           "under this existing backend name as well (e.g. FLASH_ATTN, the default on Hopper).",
           ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "FLEX_ATTENTION", "CPU_ATTN")),
    EnvVar("RL_KERNEL_LOGPROB_RECORDS_DIR", _path, None,
           "Directory where rlk_megatron_provider.record_logprobs (slime/VIME's --custom-tis-function-path) "
           "writes one rlk.vime-logprobs.v1 safetensors record per training rank and call. "
           "Unset: nothing is written.", allowed_doc="a directory path"),
    EnvVar("RL_KERNEL_TIS_FUNCTION", _dotted, None,
           "The user's own TIS/MIS function (what slime/VIME's --custom-tis-function-path would name) that "
           "rlk_megatron_provider.record_logprobs calls after recording, with the same keyword arguments, "
           "returning its result. Unset: record_logprobs returns pg_loss and the masks unchanged.",
           allowed_doc="module.function (dotted, as slime's load_function takes it)"),
    EnvVar("RL_KERNEL_RUN_ID", _text, None,
           "Run id recorded in readbacks and manifests.",
           allowed_doc="text without path separators"),
    EnvVar("RLK_BACKENDS", _backend_overrides, {},
           "Force a backend per op for A/B testing, e.g. 'linear=acme.blackwell,rms_norm=rlk.reference'. "
           "A forced backend must be registered for the op's contract id.",
           allowed_doc="comma-separated OP=BACKEND_ID"),
    EnvVar("RLK_LOAD_PLUGINS", _bool, True,
           "Load backends that other packages register through the 'rlk.backends' entry-point group.",
           ("1", "0", "true", "false")),
    EnvVar("RLK_FAST_PATH", _bool, True,
           "Repeat op calls that rlk.cuda ran as one program through rlk_core._C's fast path (signature, readback "
           "count and launches in one C++ call; the same program and bits as the Python path). 0 turns it off.",
           ("1", "0", "true", "false")),
    EnvVar("RLK_VALUE_CHECKS", _choice, "auto",
           "Range checks on the values of index tensors (cu_seqlens, positions, block tables, slots, targets) and of "
           "log-prob temperatures. "
           "auto: run them when those tensors are on the CPU; on a GPU each costs a device sync per call, so "
           "they run there only with 'always' (shape, dtype and device checks always run).",
           ("auto", "always", "never")),
    EnvVar("RLK_AOT_DIR", _path, None,
           "rlk.cuda: the folder holding the AOT manifest.json and cubins (python -m rlk_core.aot build --out DIR). "
           "Unset: the package data rlk_core/_aot/<target>/ installed with the extension.",
           allowed_doc="a directory path"),
    EnvVar("RLK_BUILD_EXT", _choice, "auto",
           "Build time (packages/rlk-core/setup.py): build the C++ extension rlk_core._C and the AOT cubins. "
           "auto: when torch is a CUDA build and nvcc is found; 1: fail if that is not so; 0: pure Python.",
           ("auto", "1", "0")),
    EnvVar("RLK_BUILD_TARGETS", _targets, ("cuda:90",),
           "Build time: the AOT targets whose cubins setup.py builds into rlk_core/_aot/<target>/ with the "
           "extension (rlk_core.aot.build.TARGETS); empty string: the default. hip:gfx942 builds the row-wise "
           "families' AMD code objects (nothing launches them yet: docs/rocm.md); cuda:100 the sm_100 cubins (built "
           "and checked, not launched until a B200 has run the GPU suite: docs/compiled-ops.md).",
           allowed_doc="comma-separated targets, e.g. `cuda:90`, `cuda:90,hip:gfx942`, `cuda:90,cuda:100`"),
    EnvVar("RLK_BUILD_OPS", _names, None,
           "Build time: the kernel families whose AOT cubins setup.py builds (python -m rlk_core.aot build "
           "--families; rlk_core.aot.build.FAMILIES: one per Triton module). Unset: all. Calls of a family left out "
           "run on rlk.triton.",
           allowed_doc="comma-separated, e.g. `linear,rms_norm,swiglu,rope`"),
    EnvVar("RLK_BUILD_DTYPES", _names, None,
           "Build time: the input dtypes whose AOT cubins setup.py builds (python -m rlk_core.aot build --dtypes). "
           "Unset: bf16, fp16 and fp32. A call in a dtype left out runs on rlk.triton.",
           allowed_doc="comma-separated of bf16, fp16, fp32"),
    EnvVar("RLK_BUILD_JOBS", _count, None,
           "Build time: parallel compiles of the AOT build. Unset: the CPU count.",
           allowed_doc="a positive integer"),
    EnvVar("RLK_REQUIRE_GPU", _bool, False,
           "Tests: turn the skip of a 'gpu' test on a machine without a GPU into a failure.",
           ("1", "0", "true", "false")),
)

_BY_NAME = {v.name: v for v in ENV_VARS}


def var(name: str) -> EnvVar:
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not an rlk environment variable; see rlk_core.envs.ENV_VARS") from None


def environ(env: Mapping[str, str] | None = None) -> Mapping[str, str]:
    """``env``, or the process environment when None."""
    return os.environ if env is None else env


def get(name: str, env: Mapping[str, str] | None = None) -> Any:
    """Parse one variable from ``env`` (default ``os.environ``)."""
    return var(name).parse(environ(env).get(name))


_PARSED: dict[str, tuple[Any, Any]] = {}
# os.environ's own mapping and key encoding (CPython): a lookup of an unset variable through it costs no
# KeyError (os.environ.get raises and catches one); os.environ.get where the interpreter has neither.
_DATA = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_DECODE = getattr(os.environ, "decodevalue", None)
_KEYS: dict[str, Any] = {}


def current(name: str) -> Any:
    """:func:`get` from ``os.environ`` for a per-call reader: the environment is read on every call (so a
    changed value is seen at once), parsed only when its text changed. For variables whose parsed value is
    immutable (text, bool, tuple), since callers share it."""
    if _DATA is not None and _ENCODE is not None and _DECODE is not None:
        key = _KEYS.get(name)
        if key is None:
            key = _KEYS[name] = _ENCODE(var(name).name)
        raw = _DATA.get(key)
        hit = _PARSED.get(name)
        if hit is not None and hit[0] == raw:
            return hit[1]
        text = None if raw is None else _DECODE(raw)
    else:
        raw = text = os.environ.get(name)
        hit = _PARSED.get(name)
        if hit is not None and hit[0] == raw:
            return hit[1]
    value = var(name).parse(text)
    _PARSED[name] = (raw, value)
    return value


def snapshot(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Parse every variable; the first bad value raises."""
    return {v.name: get(v.name, env) for v in ENV_VARS}


def markdown() -> str:
    lines = [
        "# Environment variables",
        "",
        "Generated from `rlk_core.envs.ENV_VARS` by `python -m rlk_core.envs`; do not edit by hand.",
        "",
        "| name | default | allowed | meaning |",
        "| --- | --- | --- | --- |",
    ]
    for v in ENV_VARS:
        allowed = v.allowed_doc or (", ".join(f"`{a}`" for a in v.allowed) if v.allowed else "")
        default = "unset" if v.default in (None, {}) else f"`{v.default}`"
        lines.append(f"| `{v.name}` | {default} | {allowed} | {v.doc} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
