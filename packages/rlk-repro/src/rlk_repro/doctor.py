"""``rlk-repro doctor``: is this machine ready for the routes it is asked to run?

Each check gives ``ok``, ``warn`` or ``FAIL`` with a reason; a FAIL means the requested run would not
do what it says (a device that is not there, an R route whose ops would run another implementation
than the other side's, an environment variable that does not parse). ``--selfcheck`` adds the op
contract checks of ``rlk-selfcheck`` on the device. Exit code 0 when nothing failed, 1 otherwise.

The frameworks (:func:`framework_checks`): vLLM and megatron-core against the range each adapter's
``_compat`` declares, rlk-vllm-plugin's ``vllm.general_plugins`` entry point, ``VLLM_PLUGINS``; required
(FAIL when wrong) for ``--engine frameworks`` / ``vime``, reported (warn) for the local engine. The compiled
ops (:func:`cuda_check`): whether ``rlk_core._C`` is built and, on a CUDA device, whether ``rlk.cuda`` is
available there (its cubins built for this GPU's architecture by this Triton), asked through the backend
registry's own probe (``REGISTRY.is_available``).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import platform
import warnings
from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL = "ok", "warn", "FAIL"
TRITON_ID = "rlk.triton"
CUDA_ID = "rlk.cuda"
PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_VALUE = "vllm.general_plugins", "rlk", "rlk_vllm_plugin:register"


@dataclass
class Check:
    name: str
    status: str
    detail: str


def _version(module: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return str(importlib.import_module(module).__version__)
    except Exception as exc:  # a broken install is a finding, not a crash
        return f"import failed: {type(exc).__name__}: {exc}"


def op_status(first, triton_ok: tuple[bool, str] | None, on_r_route: bool) -> tuple[str, str]:
    """Status of an op on CUDA whose first candidate is ``first``: a fallback (FAIL on an R route, else warn)
    only where the preferred rlk.triton is registered but unavailable (``triton_ok`` False) and ``first`` is
    not a backend that launches rlk.triton's very binaries (``rlk.cuda``: ``same_bits_as``)."""
    if first.id == TRITON_ID or first.same_bits_as == TRITON_ID or triton_ok is None or triton_ok[0]:
        return OK, ""
    return (FAIL if on_r_route else WARN), f"; rlk.triton unavailable: {triton_ok[1]}"


def diagnose(device: str, plan, selfcheck: bool = False, progress=None, engine: str = "local") -> list[Check]:
    """The checks, in order; ``progress(line)`` (e.g. :meth:`rlk_repro.progress.Progress.callback`) is told
    each self-check as it runs."""
    import torch

    from rlk_core import envs, routes
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import OP_CONTRACTS
    from rlk_core.errors import RlkBackendError, RlkConfigError

    out = [Check("python", OK, platform.python_version()),
           Check("torch", OK, f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})")]
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        out.append(Check("device", FAIL, f"{device} asked for, but this torch sees no CUDA GPU"))
        return out
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    out.append(Check("device", OK, f"{device}: {name}"))

    triton = _version("triton")
    if dev.type == "cuda":
        out.append(Check("triton", OK if triton and not triton.startswith("import") else FAIL,
                         triton or "not installed: CUDA ops would run rlk.reference (slow, and not the bits of a "
                         "side that has Triton)"))
    else:
        out.append(Check("triton", OK, triton or "not installed (only needed on a GPU)"))

    try:
        envs.snapshot()
        out.append(Check("environment", OK, "every RL_KERNEL_* / RLK_* variable parses"))
    except RlkConfigError as exc:
        out.append(Check("environment", FAIL, str(exc)))

    import rlk_core.ops  # noqa: F401  (registers every op's backends)

    out.append(_forced_backends(dev.type))

    r_ops = routes.rlk_ops(plan, "train", backward=True) | routes.rlk_ops(plan, "rollout")
    for op in sorted(OP_CONTRACTS):
        try:
            candidates = REGISTRY.candidates(op, dev.type)
        except RlkBackendError as exc:  # RLK_BACKENDS forces a backend that is not there (said above too)
            out.append(Check(f"op {op}", FAIL, str(exc)))
            continue
        registered = [b.id for b in REGISTRY.backends(op)]
        if not candidates:
            status = FAIL if op in r_ops else WARN
            out.append(Check(f"op {op}", status, f"no backend available on {dev.type} (registered: {registered})"))
            continue
        first = candidates[0]
        detail = f"{first.id} ({first.contract_id}); registered: {', '.join(registered)}"
        status = OK
        if dev.type == "cuda" and TRITON_ID in registered:
            triton_ok = REGISTRY.is_available(REGISTRY.get(op, TRITON_ID), "cuda")
            status, more = op_status(first, triton_ok, op in r_ops)
            detail += more
        if not first.builtin:
            qualified, why = REGISTRY.qualify(first, dev.type)
            status = status if qualified else (FAIL if op in r_ops else WARN)
            detail += f"; third-party ({first.origin}): {'qualified' if qualified else 'NOT qualified: ' + why}"
        out.append(Check(f"op {op}", status, detail + (" [used by the R routes]" if op in r_ops else "")))

    out.append(cuda_check(dev.type, REGISTRY))
    out += framework_checks(required=engine in ("frameworks", "vime"))
    validate = _version("rlk_validate")
    out.append(Check("rlk-validate", OK if validate else FAIL, validate or "not installed: runs cannot be checked"))
    mpl = _version("matplotlib")
    out.append(Check("matplotlib", OK if mpl else WARN,
                     mpl or "not installed: rlk-repro report and rlk-validate --report write no plots"))
    if selfcheck:
        from rlk_core.selfcheck import run as run_selfcheck

        rep = run_selfcheck(dev.type, progress=progress)
        failed = [f"{r['op']}.{k}" for r in rep["ops"] for k, c in r["checks"].items() if not c["passed"]]
        total = sum(len(r["checks"]) for r in rep["ops"])
        detail = f"{total - len(failed)}/{total} contract checks passed on {dev.type}"
        out.append(Check("selfcheck", FAIL if failed else OK, detail + (f"; failed: {failed}" if failed else "")))
    return out


def _forced_backends(device_type: str) -> Check:
    """``RLK_BACKENDS``: every op it names is an rlk op with that backend registered and available here."""
    import os

    from rlk_core.errors import RlkConfigError
    from rlk_repro.lifecycle import forced_backends_problem

    raw = os.environ.get("RLK_BACKENDS", "")
    try:
        problem = forced_backends_problem(device_type)
    except RlkConfigError as exc:  # does not parse: the environment check says so too
        problem = str(exc)
    return Check("RLK_BACKENDS", FAIL if problem else OK, problem or (f"forces {raw}" if raw.strip() else "unset"))


def cuda_check(device_type: str, registry) -> Check:
    """The compiled ops ``rlk.cuda``: built at all (``rlk_core._C`` is there), and on CUDA what the registry's
    probe says (cubins for this GPU, by this Triton). Never a FAIL: without them rlk.triton runs the same
    binaries, JIT-compiled on first use."""
    from rlk_core.contracts import OP_CONTRACTS

    backends = [b for op in sorted(OP_CONTRACTS) for b in registry.backends(op) if b.id == CUDA_ID]
    built = importlib.util.find_spec("rlk_core._C") is not None
    if not built:
        return Check(CUDA_ID, WARN if device_type == "cuda" else OK,
                     "this rlk-core lacks rlk.cuda: rlk_core._C is not built (a pure-Python wheel, or a build without "
                     "a CUDA toolchain and CUDA torch); R ops run rlk.triton's kernels, JIT-compiled on first use")
    if device_type != "cuda":
        return Check(CUDA_ID, OK, f"rlk_core._C is built ({len(backends)} ops); its cubins are checked on a CUDA "
                     "device (doctor --device cuda)")
    if not backends:
        return Check(CUDA_ID, WARN, "rlk_core._C is built, but no op registers rlk.cuda")
    answers = [registry.is_available(b, "cuda") for b in backends]
    good = sum(ok for ok, _ in answers)
    if good == len(backends):
        return Check(CUDA_ID, OK, f"available for {good} ops: {answers[0][1]}")
    why = next(reason for ok, reason in answers if not ok)
    return Check(CUDA_ID, WARN, f"available for {good} of {len(backends)} ops: {why}; those run rlk.triton's "
                 "kernels, JIT-compiled on first use")


def _installed(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def framework_checks(required: bool) -> list[Check]:
    """vLLM, megatron-core, the plugin's entry point and ``VLLM_PLUGINS`` (FAIL when ``required``, else warn)."""
    bad = FAIL if required else WARN
    out = []
    vllm = _installed("vllm")
    if vllm is None:
        out.append(Check("vllm", bad, "not installed (needed by --engine frameworks and the vLLM plugin)"))
    else:
        from rlk_vllm_plugin import _compat as vc  # imports no vLLM

        (lo, hi) = vc.SUPPORTED
        span = f"supported {lo[0]}.{lo[1]} <= v < {hi[0]}.{hi[1]}, verified {', '.join(vc.VERIFIED)}"
        out.append(Check("vllm", OK if vc.in_range(vllm) else bad,
                         f"{vllm} ({span})" if vc.in_range(vllm) else f"{vllm} is outside the range ({span})"))
    mcore = _installed("megatron-core")
    if mcore is None:
        out.append(Check("megatron-core", bad, "not installed (needed by --engine frameworks and the provider)"))
    else:
        try:
            with warnings.catch_warnings():  # megatron-core warns on import without TE / Apex
                warnings.simplefilter("ignore")
                from rlk_megatron_provider import _compat as mc

            ok, why = mc.supported(mcore)
            (lo, hi) = mc.SUPPORTED
            out.append(Check("megatron-core", OK if ok else bad,
                             f"{why} (supported {lo[0]}.{lo[1]} <= v < {hi[0]}.{hi[1]})"))
        except Exception as exc:  # a megatron-core that does not import is a finding
            out.append(Check("megatron-core", bad, f"{mcore}: the provider cannot import it: "
                             f"{type(exc).__name__}: {exc}"))
    eps = [e for e in md.entry_points(group=PLUGIN_GROUP) if e.name == PLUGIN_NAME]
    if any(e.value == PLUGIN_VALUE for e in eps):
        out.append(Check("vllm plugin", OK, f"entry point {PLUGIN_GROUP}: {PLUGIN_NAME} = {PLUGIN_VALUE}"))
    else:
        seen = ", ".join(f"{e.name} = {e.value}" for e in eps) or "none"
        out.append(Check("vllm plugin", bad, f"no entry point {PLUGIN_GROUP}: {PLUGIN_NAME} = {PLUGIN_VALUE} "
                         f"(found: {seen}); install rlk-vllm-plugin in this environment"))
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is None:
        out.append(Check("VLLM_PLUGINS", OK, "unset: vLLM loads every installed plugin, rlk included"))
    elif PLUGIN_NAME in [p.strip() for p in plugins.split(",")]:
        out.append(Check("VLLM_PLUGINS", OK, f"{plugins!r} lists {PLUGIN_NAME}"))
    else:
        out.append(Check("VLLM_PLUGINS", bad, f"{plugins!r} does not list {PLUGIN_NAME}: vLLM would not load rlk's "
                         "plugin and every rollout side would run production code"))
    return out


def format_checks(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = [f"{c.name.ljust(width)}  {c.status.ljust(4)}  {c.detail}" for c in checks]
    failed = sum(c.status == FAIL for c in checks)
    warned = sum(c.status == WARN for c in checks)
    lines.append(f"\nrlk-repro doctor: {'FAILED' if failed else 'ready'} ({failed} failed, {warned} warnings)")
    return "\n".join(lines)


def as_json(checks: list[Check], device: str, plan) -> dict[str, Any]:
    return {"schema": "rlk.repro-doctor.v1", "device": device, "plan": plan.as_dict(),
            "ready": not any(c.status == FAIL for c in checks), "checks": [asdict(c) for c in checks]}
