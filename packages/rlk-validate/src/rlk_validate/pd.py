"""A run's Prefill/Decode layout against its evidence (issue 37, check ``pd``).

A run that split its rollout into a prefill engine and a decode engine joined by a KV-transfer connector records
the layout in its manifest (``pd``, schema ``rlk.pd-layout.v1``, written by ``rlk-repro``: ``rlk_repro.pd_options``):
per engine (``prefill``, ``decode``) its ``kv_role`` (``kv_producer`` / ``kv_consumer``), its rollout ``routes``
(module -> ``P`` / ``R``) and ``readbacks``, the readbacks its processes wrote (run-directory paths); the
``connector`` with ``lossless_for_rlk_layout``. :func:`check_pd` requires, for such a run:

- the layout well formed (``PD_LAYOUT_INVALID``: roles, routes, a readback listed by both engines);
- both engines on the same routes, and the decode engine on the plan's rollout letters (``PD_ROUTES_DIFFER``;
  an error where exactness is required, a warning otherwise);
- under an exact run with an ``R`` rollout letter, a connector that moves rlk's KV unchanged
  (``PD_CONNECTOR_LOSSY``);
- every listed readback present (``PD_READBACK_MISSING``), a vLLM rollout readback that executed ops
  (``PD_ENGINE_SILENT``), carrying a contract digest (``PD_DIGEST_MISSING``), and one digest over both engines'
  readbacks, the manifest's where it records one (``PD_DIGEST_DIFFERS``): the two engines ran the same rlk
  contracts.

A run without ``pd`` in its manifest is not checked here.
"""

from __future__ import annotations

from typing import Any

from .evidence import PD_LAYOUT_SCHEMA as SCHEMA
from .findings import Finding, finding
from .safeio import Root

CHECK = "pd"
ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
MODULE_LETTERS = ("P", "R")


def _f(code: str, msg: str, path: str | None = "manifest.json", **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def _engines(pd: dict[str, Any]) -> tuple[dict[str, dict[str, Any]], list[Finding]]:
    out: dict[str, dict[str, Any]] = {}
    bad: list[Finding] = []
    for role, kv_role in ROLES.items():
        e = pd.get(role)
        if not isinstance(e, dict):
            bad.append(_f("PD_LAYOUT_INVALID", f"manifest pd.{role} is not an object"))
            continue
        if e.get("kv_role") != kv_role:
            bad.append(_f("PD_LAYOUT_INVALID", f"manifest pd.{role}.kv_role is {e.get('kv_role')!r}, not {kv_role!r}"))
        routes = e.get("routes")
        if not isinstance(routes, dict) or not routes or any(v not in MODULE_LETTERS for v in routes.values()):
            bad.append(_f("PD_LAYOUT_INVALID", f"manifest pd.{role}.routes is not module -> P / R"))
            continue
        rbs = e.get("readbacks")
        if not isinstance(rbs, list) or not rbs or not all(isinstance(r, str) and r for r in rbs):
            bad.append(_f("PD_LAYOUT_INVALID", f"manifest pd.{role}.readbacks is not a non-empty list of the "
                          "readback paths of its processes"))
            continue
        out[role] = e
    if len(out) == 2:
        both = set(out["prefill"]["readbacks"]) & set(out["decode"]["readbacks"])
        if both:
            bad.append(_f("PD_LAYOUT_INVALID", f"manifest pd lists {sorted(both)[0]} as a readback of both engines"))
    return out, bad


def _rollout_letters(plan: Any) -> dict[str, str] | None:
    if not isinstance(plan, dict):
        return None
    try:
        return {m: str(c).split("/")[1] for m, c in plan.items()}
    except IndexError:
        return None


def _readback(root: Root, rel: str) -> tuple[dict[str, Any] | None, Finding | None]:
    if not rel.startswith("readbacks/") or ".." in rel.split("/"):
        return None, _f("PD_LAYOUT_INVALID", f"manifest pd names {rel!r}, not a path under readbacks/")
    if not root.lexists(rel):
        return None, _f("PD_READBACK_MISSING", f"{rel}, a readback the P/D layout lists, is absent", rel)
    from .readbacks import _load_readback  # its reading findings are the readback check's

    doc, _ = _load_readback(root, rel)
    if doc is None:
        return None, _f("PD_READBACK_MISSING", f"{rel}, a readback the P/D layout lists, is unusable (see the "
                        "readbacks check)", rel)
    return doc, None


def check_pd(root: Root, manifest: Any, require_exact: bool) -> list[Finding]:
    """Findings about the P/D layout of the run at ``root`` (``manifest`` as parsed; None where unreadable)."""
    if not isinstance(manifest, dict) or manifest.get("pd") is None:
        return []
    pd = manifest["pd"]
    if not isinstance(pd, dict) or pd.get("schema") != SCHEMA:
        return [_f("PD_LAYOUT_INVALID", f"manifest pd is not a {SCHEMA} object")]
    engines, out = _engines(pd)
    if len(engines) < 2:
        return out
    strength = None if require_exact else "warning"
    pre, dec = engines["prefill"]["routes"], engines["decode"]["routes"]
    if pre != dec:
        differ = sorted(m for m in set(pre) | set(dec) if pre.get(m) != dec.get(m))
        out.append(_f("PD_ROUTES_DIFFER", "the prefill and decode engines ran different routes ("
                      + ", ".join(f"{m}: {pre.get(m)} vs {dec.get(m)}" for m in differ)
                      + "): the decode engine attended over KV of another arithmetic", severity=strength))
    plan = _rollout_letters(manifest.get("plan"))
    if plan is not None and plan != dec:
        out.append(_f("PD_ROUTES_DIFFER", f"the decode engine's routes {dec} are not the plan's rollout letters "
                      f"{plan}", severity=strength))
    conn = pd.get("connector") if isinstance(pd.get("connector"), dict) else {}
    if require_exact and "R" in {*pre.values(), *dec.values()} and conn.get("lossless_for_rlk_layout") is not True:
        out.append(_f("PD_CONNECTOR_LOSSY", f"the connector {conn.get('class')!r} is not recorded as moving rlk's KV "
                      "layout unchanged (lossless_for_rlk_layout), and bitwise equality is required"))
    declared = manifest.get("contract_digest")
    digests: dict[str, str] = {}  # digest -> the first readback carrying it
    for role, e in engines.items():
        for rel in e["readbacks"]:
            doc, problem = _readback(root, rel)
            if problem is not None:
                out.append(problem)
                continue
            if doc.get("framework") != "vllm" or doc.get("target") != "rollout":
                out.append(_f("PD_LAYOUT_INVALID", f"{rel} ({doc.get('framework')} {doc.get('target')}) is not a "
                              f"vLLM rollout readback, yet the {role} engine lists it", rel))
                continue
            calls = sum(int(m.get("call_count", 0)) for m in (doc.get("modules") or {}).values()
                        if isinstance(m, dict) and isinstance(m.get("call_count"), int))
            if calls == 0:
                out.append(_f("PD_ENGINE_SILENT", f"{rel}: the {role} engine's readback records no executed op", rel))
            rec = doc.get("contract_digest")
            digest = rec.get("digest") if isinstance(rec, dict) else None
            if not isinstance(digest, str) or not digest.startswith("sha256:"):
                out.append(_f("PD_DIGEST_MISSING", f"{rel}: the {role} engine's readback carries no contract digest",
                              rel))
                continue
            digests.setdefault(digest, rel)
    if len(digests) > 1:
        out.append(_f("PD_DIGEST_DIFFERS", "the prefill and decode engines' readbacks carry different contract "
                      "digests: " + "; ".join(f"{d} ({rel})" for d, rel in digests.items())))
    elif isinstance(declared, str) and digests and declared not in digests:
        out.append(_f("PD_DIGEST_DIFFERS", f"the engines' readbacks carry {next(iter(digests))}, not the manifest's "
                      f"contract digest {declared}"))
    return out

