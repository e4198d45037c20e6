"""CUDA-graph evidence against the manifest: did decode replay the graphs the run asked for?

The vLLM plugin's readbacks carry ``cuda_graphs`` (rlk_vllm_plugin.cudagraphs): vLLM's settings as it resolved
them (``cudagraph_mode``, ``capture_sizes``, ...), the graphs it captured, and every step's graph decision counted
per ``(mode, graph_tokens, batch_tokens, num_reqs, decode)``. A run *asked for* a profile when its manifest says so:
``config.cuda_graphs`` (``{"cudagraph_mode", "capture_sizes"}``), a ``--vllm-compilation-config`` /
``--compilation-config`` JSON in its ``command``, or an imported VIME launch with ``config.vime.cuda_graph_decode``
(sizes ``1 .. prompts_per_round x samples_per_prompt``). For ``FULL_DECODE_ONLY`` — the seeds' profile, exact sizes
``1..N`` — :func:`check_cuda_graphs` requires: vLLM resolved exactly that mode and those sizes; a ``FULL`` graph
was captured for every size; every decode step (a uniform batch of ``decode_query_len`` tokens per request)
replayed a ``FULL`` graph of exactly its own batch size — an eager decode step (a batch larger than the largest
size included) and a replay of another size are errors. Prefill and mixed steps run eagerly in this mode by design.
Any run's evidence is summarised (replays per size).
"""

from __future__ import annotations

import json
from typing import Any

from .evidence import READBACKS_DIR
from .findings import Finding, finding
from .readbacks import _list_readbacks, _load_readback
from .safeio import InputError, Root

CHECK = "cuda-graphs"
FULL_DECODE_ONLY = "FULL_DECODE_ONLY"
_FLAGS = ("--vllm-compilation-config", "--compilation-config", "-cc", "-O")


def _f(code: str, msg: str, path: str | None = None, **kw: Any) -> Finding:
    return finding(code, msg, check=CHECK, path=path, **kw)


def _int(v: Any, lo: int = 0) -> bool:
    return type(v) is int and lo <= v < 1 << 40


def _sizes(v: Any) -> list[int] | None:
    return sorted(v) if isinstance(v, list) and v and all(_int(s, 1) for s in v) else None


def _sizes_field(v: Any) -> bool:
    """A recorded ``capture_sizes``: null, or a list of sizes >= 1 — empty where vLLM captures nothing
    (``enforce_eager``, ``cudagraph_mode`` NONE)."""
    return v is None or (isinstance(v, list) and all(_int(s, 1) for s in v))


def requested(manifest: Any) -> dict[str, Any] | None:
    """``{"cudagraph_mode", "capture_sizes", "source"}`` the run asked for, or None where the manifest says nothing."""
    if not isinstance(manifest, dict):
        return None
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    cg = config.get("cuda_graphs")
    if isinstance(cg, dict) and isinstance(cg.get("cudagraph_mode"), str):
        return {"cudagraph_mode": cg["cudagraph_mode"], "capture_sizes": _sizes(cg.get("capture_sizes")),
                "source": "manifest config.cuda_graphs"}
    command = manifest.get("command")
    if isinstance(command, list):
        for i, arg in enumerate(command[:-1]):
            if arg in _FLAGS and isinstance(command[i + 1], str):
                try:
                    doc = json.loads(command[i + 1])
                except ValueError:
                    continue
                if isinstance(doc, dict) and isinstance(doc.get("cudagraph_mode"), str):
                    return {"cudagraph_mode": doc["cudagraph_mode"],
                            "capture_sizes": _sizes(doc.get("cudagraph_capture_sizes")),
                            "source": f"command {arg}"}
    vime = config.get("vime") if isinstance(config.get("vime"), dict) else {}
    if vime.get("cuda_graph_decode") is True and _int(vime.get("prompts_per_round"), 1) \
            and _int(vime.get("samples_per_prompt"), 1):
        n = vime["prompts_per_round"] * vime["samples_per_prompt"]
        return {"cudagraph_mode": FULL_DECODE_ONLY, "capture_sizes": list(range(1, n + 1)),
                "source": "VIME launch --cuda-graph-decode"}
    return None


def _section_problem(s: Any) -> str | None:
    if not isinstance(s, dict) or type(s.get("recorded")) is not bool:
        return "cuda_graphs must be an object with recorded (bool)"
    if not s["recorded"]:
        return None if isinstance(s.get("reason"), str) else "cuda_graphs.recorded is false without a reason"
    st = s.get("settings")
    if st is not None and not (isinstance(st, dict) and isinstance(st.get("cudagraph_mode"), str)
                               and _sizes_field(st.get("capture_sizes"))
                               and _int(st.get("decode_query_len"), 1)):
        return "cuda_graphs.settings needs cudagraph_mode, capture_sizes (list or null), decode_query_len"
    if not isinstance(s.get("captured"), list) or not all(
            isinstance(c, dict) and isinstance(c.get("mode"), str) and _int(c.get("num_tokens"), 1)
            for c in s["captured"]):
        return "cuda_graphs.captured must be a list of {mode, num_tokens, ...}"
    if not isinstance(s.get("dispatch"), list) or not all(
            isinstance(d, dict) and isinstance(d.get("mode"), str) and _int(d.get("graph_tokens"))
            and _int(d.get("batch_tokens")) and _int(d.get("num_reqs")) and type(d.get("decode")) is bool
            and _int(d.get("count"), 1) for d in s["dispatch"]):
        return "cuda_graphs.dispatch must be a list of {mode, graph_tokens, batch_tokens, num_reqs, decode, count > 0}"
    if s["dispatch"] and st is None:
        return "cuda_graphs has dispatches but no settings"
    return None


def _sections(root: Root) -> tuple[list[tuple[str, Any]], list[Finding]]:
    out, bad = [], []
    try:
        names = _list_readbacks(root) or []
    except InputError:
        return out, bad  # check_readbacks reports it
    for host, name in names:
        rel = f"{READBACKS_DIR}/{host}/{name}" if host else f"{READBACKS_DIR}/{name}"
        doc, _ = _load_readback(root, rel)  # its own problems are check_readbacks' findings
        if isinstance(doc, dict) and doc.get("framework") == "vllm" and "cuda_graphs" in doc:
            problem = _section_problem(doc["cuda_graphs"])
            if problem:
                bad.append(_f("CUDA_GRAPH_EVIDENCE_INVALID", f"{rel}: {problem}", rel))
            else:
                out.append((rel, doc["cuda_graphs"]))
    return out, bad


def _check_full_decode_only(rel: str, s: dict[str, Any], want: list[int] | None) -> list[Finding]:
    out: list[Finding] = []
    st = s["settings"]
    if st is None:
        return out  # a process without a model runner (front end, engine core): no graphs of its own
    if st["cudagraph_mode"] != FULL_DECODE_ONLY or (want is not None and st.get("capture_sizes") != want):
        out.append(_f("CUDA_GRAPH_SETTINGS_MISMATCH", f"{rel}: vLLM ran cudagraph_mode {st['cudagraph_mode']} with "
                      f"capture sizes {_short(st.get('capture_sizes'))}; the run asked for {FULL_DECODE_ONLY} "
                      f"with {_short(want)}", rel))
    captured = {c["num_tokens"] for c in s["captured"] if c["mode"] == "FULL"}
    missing = sorted(set(want or st.get("capture_sizes") or []) - captured)
    if missing:
        out.append(_f("CUDA_GRAPH_NOT_CAPTURED", f"{rel}: no FULL graph was captured for batch size(s) "
                      f"{_short(missing)}", rel, sizes=missing))
    eager = [d for d in s["dispatch"] if d["decode"] and d["mode"] != "FULL"]
    if eager:
        steps = sum(d["count"] for d in eager)
        sizes = sorted({d["batch_tokens"] for d in eager})
        top = max(captured, default=0)
        outside = [b for b in sizes if b > top]
        out.append(_f("CUDA_GRAPH_DECODE_EAGER", f"{rel}: {steps} decode step(s) ran without a FULL CUDA graph (mode "
                      f"{', '.join(sorted({d['mode'] for d in eager}))}) at batch size(s) {_short(sizes)}"
                      + (f"; {_short(outside)} outside the captured sizes (largest {top})" if outside else ""),
                      rel, steps=steps, sizes=sizes))
    padded = [d for d in s["dispatch"] if d["decode"] and d["mode"] == "FULL"
              and (d["graph_tokens"] != d["batch_tokens"] or d["graph_tokens"] not in captured)]
    if padded:
        pairs = sorted({(d["batch_tokens"], d["graph_tokens"]) for d in padded})
        out.append(_f("CUDA_GRAPH_DECODE_PADDED", f"{rel}: {sum(d['count'] for d in padded)} decode step(s) replayed "
                      "a graph that is not the captured graph of their own batch size (batch -> graph: "
                      + ", ".join(f"{b} -> {g}" for b, g in pairs[:8]) + ")", rel, pairs=[list(p) for p in pairs]))
    return out


def _short(v: Any) -> str:
    if not isinstance(v, list):
        return str(v)
    if len(v) > 4 and v == list(range(v[0], v[0] + len(v))):
        return f"{v[0]}..{v[-1]}"
    return ", ".join(map(str, v[:12])) + (" ..." if len(v) > 12 else "")


def check_cuda_graphs(root: Root, manifest: Any) -> list[Finding]:
    """The CUDA-graph gate of a run directory (see the module doc)."""
    req = requested(manifest)
    sections, out = _sections(root)
    recorded = [(rel, s) for rel, s in sections if s["recorded"]]
    if req is not None and req["cudagraph_mode"] == FULL_DECODE_ONLY:
        decode_steps = sum(d["count"] for _, s in recorded for d in s["dispatch"] if d["decode"])
        if not recorded or decode_steps == 0:
            why = ("no vLLM readback carries recorded CUDA-graph evidence" if not recorded
                   else "the vLLM readbacks record no decode step")
            reasons = sorted({s["reason"] for _, s in sections if not s["recorded"]})
            out.append(_f("CUDA_GRAPH_EVIDENCE_MISSING", f"the run asked for {FULL_DECODE_ONLY} CUDA graphs "
                          f"({req['source']}) but {why}" + (f" ({reasons[0]})" if reasons else "")))
        for rel, s in recorded:
            out += _check_full_decode_only(rel, s, req["capture_sizes"])
    replays: dict[int, int] = {}
    eager = 0
    for _, s in recorded:
        for d in s["dispatch"]:
            if d["mode"] == "FULL":
                replays[d["graph_tokens"]] = replays.get(d["graph_tokens"], 0) + d["count"]
            else:
                eager += d["count"]
    if recorded and (replays or eager):
        out.append(_f("CUDA_GRAPH_SUMMARY", f"{len(recorded)} vLLM process(es): FULL replays per size "
                      + (", ".join(f"{k}: {v}" for k, v in sorted(replays.items())) or "none")
                      + f"; {eager} step(s) without a FULL graph", replays={str(k): v for k, v in replays.items()},
                      eager_steps=eager))
    return out
