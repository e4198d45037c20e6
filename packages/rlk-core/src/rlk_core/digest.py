"""The contract digest handshake (issue 37): each side says what it runs; a difference stops the run.

Before the first round and after every weight sync, each side builds its document (:func:`side_document`) from
what it holds — its route plan, the device, the sampling parameters it applies, its TP-invariance setting — and
:func:`handshake` compares the two sides' digests with each other and with the run's first one. A difference
raises :class:`ContractDigestError` naming the fields that differ, before anything of that round is compared.
Both engines call :func:`handshake` (the local engine with its two :class:`~rlk_core.readback.ReadbackRecorder` s,
the frameworks engine with the Megatron provider's and the vLLM plugin's), which records every check in the
recorders, so the readbacks carry the digest (``rlk_validate.digest`` checks it).

The document (``rlk.contract-digest.v1``), the same on both sides when they run the same arithmetic:

- ``plan``: module -> case; ``device_type``; ``tp_invariant_leaves``: G of ``RL_KERNEL_TP_INVARIANT`` (0: off);
- ``sampling``: ``temperature``, ``top_k``, ``top_p``, ``min_p`` (what both sides apply to the logits);
- ``modules``: per module its ``case``; for an ``R/R`` module also ``contracts`` (the contract ids of the ops the
  module runs on this side, its MoE form's included: the same set on both sides, see
  :data:`rlk_core.routes.MODULE_OPS`), ``backends`` (the
  backend families the registry prefers for those ops on this device; ``rlk.cuda`` counts as ``rlk.triton``, whose
  binaries it launches) and ``builds``: per contract id, the SHA-256 of the source files of the preferred
  family's backends of every op under that contract — the installed kernels' source, not a compiled binary.

What may differ by side stays out of the digest and goes into the side's ``detail``: its op -> backend id, and the
log-prob semantics it records (a run that compares processed with unfiltered log-probs does so on purpose).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkPolicyError
from rlk_core.plan import MODULES, RoutePlan
from rlk_validate.digest import DIGEST_SCHEMA, differences, digest_of, family


class ContractDigestError(RlkPolicyError):
    """The two sides' contract digests differ (or changed during the run): nothing is compared."""


def _module_ops(module: str, side: str, tp_leaves: int) -> tuple[str, ...]:
    from rlk_core import routes

    ops = routes.ops_for(module, side) + routes.FORM_OPS.get(module, ())  # with the module's other form (MoE)
    if tp_leaves and module in ("attention", "ffn"):  # the row-parallel projection in TP-invariant mode
        ops = ops + routes.TP_OPS[module]
    return ops


def _preferred(op: str, device_type: str) -> str:
    import rlk_core.ops  # noqa: F401  (registers every op's backends)
    from rlk_core.backends import REGISTRY

    candidates = REGISTRY.candidates(op, device_type)
    return candidates[0].id if candidates else "none"


@functools.cache
def _build_hash(contract: str, families: tuple[str, ...], device_type: str) -> str:
    """SHA-256 over (module, source SHA-256) of every backend of ``families`` registered for an op of ``contract``."""
    import rlk_core.ops  # noqa: F401
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import OP_CONTRACTS

    parts = set()
    for op, cid in OP_CONTRACTS.items():
        if cid != contract:
            continue
        for b in REGISTRY.backends(op):
            if device_type not in b.devices or family(b.id) not in families:
                continue
            fn = inspect.unwrap(b.fn)
            try:
                source = inspect.getsourcefile(fn)
            except TypeError:  # a compiled op's handle (rlk.cuda: torch.ops.rlk_cuda.*), a partial: no Python source
                source = None
            text = Path(source).read_bytes() if source else f"{b.id} {b.op} {fn!r}".encode()
            parts.add((str(getattr(fn, "__module__", type(fn).__module__)), hashlib.sha256(text).hexdigest()))
    return "sha256:" + hashlib.sha256(repr(sorted(parts)).encode()).hexdigest()


def side_document(plan: RoutePlan, side: str, device_type: str, *, temperature: float, top_k: int, top_p: float,
                  min_p: float, logprobs: str, tp_leaves: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(document, detail)`` of ``side`` (``train`` / ``rollout``) running ``plan`` on ``device_type``; ``tp_leaves``
    None reads ``RL_KERNEL_TP_INVARIANT``."""
    from rlk_core.contracts import OP_CONTRACTS
    from rlk_core.tp import tp_invariant_leaves

    leaves = tp_invariant_leaves() if tp_leaves is None else int(tp_leaves)
    modules: dict[str, Any] = {}
    chosen: dict[str, str] = {}
    for m in MODULES:
        case = plan.case(m)
        entry: dict[str, Any] = {"case": case}
        ops = _module_ops(m, side, leaves) if plan.uses_rlk(m, side) else ()
        for op in ops:
            chosen[op] = _preferred(op, device_type)
        if case == "R/R":
            contracts = sorted({OP_CONTRACTS[op] for op in ops})
            families = tuple(sorted({family(chosen[op]) for op in ops}))
            entry.update(contracts=contracts, backends=list(families),
                         builds={c: _build_hash(c, families, device_type) for c in contracts})
        modules[m] = entry
    document = {"schema": DIGEST_SCHEMA, "plan": plan.as_dict(), "device_type": device_type,
                "tp_invariant_leaves": leaves, "modules": modules,
                "sampling": {"temperature": float(temperature), "top_k": int(top_k), "top_p": float(top_p),
                             "min_p": float(min_p)}}
    return document, {"side": side, "logprobs": logprobs, "ops": dict(sorted(chosen.items()))}


def handshake(sides: dict[str, tuple[Any, dict[str, Any], dict[str, Any]]], at: str,
              expected: str | None = None) -> str:
    """Compare the sides' digests at ``at`` (``start``, ``sync <n>``): ``sides`` maps a side to ``(recorders,
    document, detail)`` (one recorder or a list: every process of that side records the check). Returns the digest;
    raises :class:`ContractDigestError` where the sides differ, or where the digest is not ``expected`` (the
    start's)."""
    digests = {side: digest_of(doc) for side, (_, doc, _) in sides.items()}
    names = sorted(sides)
    first = digests[names[0]]
    for other in names[1:]:
        if digests[other] != first:
            diff = sorted(differences(sides[names[0]][1], sides[other][1]),  # the shallowest first
                          key=lambda d: d.partition(":")[0].count("."))
            raise ContractDigestError(
                f"contract digest handshake at {at}: the {names[0]} and {other} sides run different contracts "
                f"({first} vs {digests[other]}; {names[0]} vs {other}: {'; '.join(diff[:4])}"
                f"{' ...' if len(diff) > 4 else ''}); stopped before anything was compared")
    if expected is not None and first != expected:
        raise ContractDigestError(f"contract digest handshake at {at}: both sides now run {first}, not the run's "
                                  f"{expected} (the contracts changed during the run); stopped before anything "
                                  "more was compared")
    for recorders, doc, detail in sides.values():
        for rec in recorders if isinstance(recorders, (list, tuple)) else [recorders]:
            rec.record_digest(first, doc, detail, at)
    return first
