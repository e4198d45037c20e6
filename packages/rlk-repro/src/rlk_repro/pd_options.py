"""The single-node Prefill/Decode split of a frameworks run (issue 37, the seeds' ``--pd``): its layout, checked.

``rlk-repro plan --engine frameworks --pd`` resolves and checks the layout and prints it (the ``pd`` section): a
prefill engine (vLLM, ``kv_role="kv_producer"``: computes each prompt's KV cache, samples one token that is
dropped) and a decode engine (``kv_role="kv_consumer"``: loads that KV and samples the response, the tokens and
log-probs the trainer recomputes), joined by one KV-transfer connector, both on the rollout GPUs beside the trainer
(colocated; on one GPU all three share it), both holding the run's weights (every weight sync goes to both), both
running the run's rollout routes. Exact equality then requires that the KV the decode engine reads is the bytes
the prefill engine wrote, and that both engines run the same rlk contracts: each engine's readbacks carry the
contract digest, which must be the run's (``rlk-validate``, check ``pd``: :mod:`rlk_validate.pd`).

Refused (exit 2), naming the problem: ``--pd`` outside the frameworks engine; prefill routes
(``--pd-prefill-routes``) other than the decode engine's (the decode engine would attend over KV of another
arithmetic), or a connector that cannot move rlk's KV losslessly on one node
(:data:`CONNECTORS`: vLLM's ``ExampleConnector`` mis-reads rlk's layout, ``DecodeBenchConnector`` fills the cache
with placeholder values, ``P2pNcclConnector`` needs two NCCL ranks, which cannot share a GPU, the others need
packages or hardware this layout does not have or have not been checked) — in strict mode; audit mode plans
those and records them (``layout_problems``); engine memory shares that leave nothing
to the trainer; a Qwen3-MoE model (the decode engine does not compute the transferred prompt positions, so the
routing record that the MoE comparison needs lacks them).

``run --pd`` checks the same and then refuses: the frameworks engine's loop holds one vLLM engine in its process
(the weight sync passes tensors by reference), and two engines in one process would share vLLM's one KV-connector
agent per process (``vllm.distributed.kv_transfer.kv_transfer_state._KV_CONNECTOR_AGENT``) and rlk-vllm-plugin's one
runtime and readback per process. The pair itself, R/R on one GPU against the trainer's recompute:
``tests/frameworks/pd_worker.py`` (docs/frameworks.md, "Prefill/Decode split"). Kept apart from ``cli.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_core.plan import MODULES
from rlk_validate.evidence import PD_LAYOUT_SCHEMA

RLK_CONNECTOR = "rlk-shared-storage"


@dataclass(frozen=True)
class Connector:
    cls: str  # the KVTransferConfig kv_connector name
    module: str | None  # kv_connector_module_path (None: vLLM's registry)
    transport: str
    lossless_rlk: bool  # moves rlk's KV bytes unchanged, checked (tests/vllm/test_kv_connector.py)
    packages: tuple[str, ...] = ()  # importable modules it needs
    one_gpu: bool = True  # both engines on one GPU possible
    why: str | None = None  # why an exact run cannot take it


CONNECTORS: dict[str, Connector] = {
    RLK_CONNECTOR: Connector(
        "RlkSharedStorageConnector", "rlk_vllm_plugin.kv_connector",
        "files on a local disk (safetensors), a byte copy of each token's KV row in the engine's own layout",
        lossless_rlk=True),
    "example": Connector(
        "ExampleConnector", None, "files on a local disk (safetensors), rows found by FlashAttention's layout",
        lossless_rlk=False,
        why="vLLM 0.22's ExampleConnector reads every cache but Triton's and MLA's as FlashAttention's "
        "[2, B, N, H, D]: on rlk's [B, H, N, 2D] (R attention) a save indexes past the cache (IndexError) and a "
        "load writes into a copy (measured: tests/vllm/test_kv_connector.py); use rlk-shared-storage"),
    "decode-bench": Connector(
        "DecodeBenchConnector", None, "none: fills the decode engine's KV with placeholder values",
        lossless_rlk=False, why="DecodeBenchConnector transfers no KV (it fills the cache with placeholder values, a "
        "benchmark of decode alone): never a rollout"),
    "p2p-nccl": Connector(
        "P2pNcclConnector", None, "NCCL send/recv between the two engines' processes", lossless_rlk=False,
        one_gpu=False, why="P2pNcclConnector joins the engines by an NCCL communicator, and NCCL does not put two "
        "ranks on one GPU; with its own buffers and layout handling it is not checked against rlk's KV layout"),
    "nixl": Connector(
        "NixlConnector", None, "NIXL (UCX) block transfers between the engines' registered KV caches",
        lossless_rlk=False, packages=("nixl",), why="NixlConnector needs the nixl package (UCX), and its block "
        "transfer of rlk's KV layout has not been checked"),
    "lmcache": Connector(
        "LMCacheConnectorV1", None, "LMCache's store (its own KV format and serialisation)", lossless_rlk=False,
        packages=("lmcache",), why="LMCacheConnectorV1 needs the lmcache package, and its KV format and "
        "serialisation of rlk's layout have not been checked (lossless only if configured so)"),
}


def add_options(p: argparse.ArgumentParser) -> None:
    """``--pd`` and its options (``run`` and ``plan``: a matrix cell or a ladder rung takes no P/D layout)."""
    g = p.add_argument_group("--pd (the Prefill/Decode split; --engine frameworks)")
    g.add_argument("--pd", action="store_true",
                   help="a prefill engine and a decode engine joined by a KV-transfer connector on the rollout GPUs "
                   "(`plan` checks and prints the layout; docs/frameworks.md)")
    g.add_argument("--pd-connector", choices=tuple(CONNECTORS), default=RLK_CONNECTOR,
                   help=f"the KV-transfer connector ({RLK_CONNECTOR}: vLLM's shared-storage connector with rlk's KV "
                   "layout, rlk_vllm_plugin.kv_connector; the others are vLLM's own)")
    g.add_argument("--pd-prefill-routes", default=None, metavar="MODULE=P|R,...",
                   help="the prefill engine's rollout letters where they differ from the run's plan (default: the "
                   "plan's; an exact run refuses any difference)")
    g.add_argument("--pd-prefill-gpu-memory-utilization", type=float, default=None, metavar="F",
                   help="the prefill engine's share of the GPU memory; the decode engine takes the rest of "
                   "--gpu-memory-utilization (default: half of it each)")
    g.add_argument("--pd-kv-store", default=None, metavar="DIR",
                   help="the connector's shared directory (default: pd-kv-store/ in the run's scratch directory); "
                   "cleared at every weight sync")


def given(a: argparse.Namespace) -> bool:
    return bool(getattr(a, "pd", False))


def _routes(text: str | None, rollout: dict[str, str]) -> dict[str, str]:
    if text is None:
        return dict(rollout)
    out = dict(rollout)
    for part in filter(None, (x.strip() for x in text.split(","))):
        module, sep, letter = part.partition("=")
        if not sep or module not in MODULES or letter not in ("P", "R"):
            raise RlkConfigError(f"--pd-prefill-routes: {part!r} is not MODULE=P|R with MODULE one of "
                                 f"{', '.join(MODULES)}")
        out[module] = letter
    return out


def _stray(a: argparse.Namespace) -> str | None:
    for name in ("pd_prefill_routes", "pd_prefill_gpu_memory_utilization", "pd_kv_store"):
        if getattr(a, name, None) is not None:
            return f"--{name.replace('_', '-')} is an option of --pd"
    if getattr(a, "pd_connector", RLK_CONNECTOR) != RLK_CONNECTOR:
        return "--pd-connector is an option of --pd"
    return None


def layout(a: argparse.Namespace, cfg) -> dict[str, Any] | None:
    """The P/D layout of the run ``cfg`` (a resolved configuration) asked for by ``a``, checked: None without
    ``--pd``; raises :class:`RlkConfigError` for what cannot run in any mode and, in strict mode, for what would make
    the decode engine's rollout differ from a single engine's; audit mode records the latter as
    ``layout_problems``."""
    if not given(a):
        stray = _stray(a)
        if stray:
            raise RlkConfigError(stray)
        return None
    if getattr(a, "engine", "local") != "frameworks":
        raise RlkConfigError("--pd splits the frameworks engine's vLLM rollout: it needs --engine frameworks")
    conn = CONNECTORS[a.pd_connector]
    rollout = {m: c.split("/")[1] for m, c in cfg.plan.as_dict().items()}
    prefill_routes = _routes(a.pd_prefill_routes, rollout)
    total = cfg.gpu_memory_utilization
    share = a.pd_prefill_gpu_memory_utilization if a.pd_prefill_gpu_memory_utilization is not None else total / 2
    if not 0 < share < total:
        raise RlkConfigError(f"--pd-prefill-gpu-memory-utilization {share:g} must be in (0, {total:g}): the engines "
                             f"share --gpu-memory-utilization {total:g} (the trainer takes the rest of the GPU)")
    from rlk_repro import tp_options

    if tp_options.model_config(cfg).is_moe:
        raise RlkConfigError("--pd with a Qwen3-MoE model: the decode engine does not compute the prompt positions "
                             "whose KV it receives, so the routing record the MoE comparison needs lacks them "
                             "(vLLM 0.22 refuses its own routed-experts record with any KV connector for that reason)")
    if a.pd_connector == "decode-bench" or not conn.one_gpu:  # colocated engines: cannot run in any mode
        raise RlkConfigError(f"--pd-connector {a.pd_connector}: {conn.why}")
    problems = []
    differ = sorted(m for m in MODULES if prefill_routes[m] != rollout[m])
    if differ:
        problems.append("the prefill engine's routes differ from the decode engine's on "
                        + ", ".join(f"{m} ({prefill_routes[m]} vs {rollout[m]})" for m in differ)
                        + ": the decode engine would attend over KV computed by another arithmetic")
    if not conn.lossless_rlk and "R" in rollout.values():
        problems.append(f"--pd-connector {a.pd_connector}: {conn.why}")
    missing = [m for m in conn.packages if importlib.util.find_spec(m) is None]
    if missing:
        problems.append(f"--pd-connector {a.pd_connector} needs the package(s) {', '.join(missing)} (not importable "
                        "here)")
    if problems and cfg.readback_mode == "strict":
        raise RlkConfigError("; ".join(problems) + " (strict mode refuses this P/D layout; --audit plans it and "
                             "records the problem)")
    store = a.pd_kv_store or "<run scratch>/pd-kv-store"
    gpus = list(range(cfg.rollout_tp))

    def engine(role: str, kv_role: str, routes: dict[str, str], memory: float, samples: str) -> dict[str, Any]:
        return {"role": role, "engine": "vllm", "kv_role": kv_role, "tp": cfg.rollout_tp, "gpus": gpus,
                "routes": routes, "gpu_memory_utilization": round(memory, 6), "samples": samples,
                "kv_transfer_config": {"kv_connector": conn.cls, "kv_connector_module_path": conn.module,
                                       "kv_role": kv_role, "kv_connector_extra_config": {"shared_storage_path": store}},
                "cuda_graphs": cfg.cuda_graphs if role == "decode" else None,
                "readbacks": "its processes' vllm-rollout-<pid>.json, listed here by the run"}

    return {
        "schema": PD_LAYOUT_SCHEMA,
        "prefill": engine("prefill", "kv_producer", prefill_routes, share, "one token per prompt, dropped"),
        "decode": engine("decode", "kv_consumer", rollout, total - share,
                         "the response: the tokens and log-probs the trainer recomputes"),
        "connector": {"name": a.pd_connector, "class": conn.cls, "module": conn.module, "transport": conn.transport,
                      "lossless_for_rlk_layout": conn.lossless_rlk, "kv_store": store,
                      "kv_store_cleared": "at every weight sync (the files are keyed by prompt tokens, not weights)"},
        "placement": {"kind": "colocated", "gpus": gpus,
                      "trainer_gpus": list(range(cfg.train_tp * cfg.context_parallel)),
                      "note": "both engines and the trainer share the rollout GPUs (one GPU at TP 1)"},
        "shared": {"routes": rollout if not differ else None, "weights": "every weight sync goes to both engines",
                   "contracts": "both engines' readbacks must carry the run's contract digest (rlk-validate, check "
                   "pd)", "sampling": "the decode engine samples with the run's seeds and filters",
                   "prompt_prefix_moved": "the block-aligned prompt prefix; the decode engine computes the rest"},
        "layout_problems": problems,
        "engine_problem": engine_problem(),
    }


def engine_problem() -> str:
    """What ``run --pd`` says before it refuses (the frameworks engine's loop runs one vLLM engine)."""
    return ("the frameworks engine's loop holds one vLLM engine in its process, and two would share vLLM's one "
            "KV-connector agent and rlk-vllm-plugin's one runtime per process: `rlk-repro plan --pd` checks and "
            "records the layout; the pair runs on one GPU in tests/frameworks/pd_worker.py (docs/frameworks.md)")


def _module_file(name: str) -> bool:
    """Whether module ``name`` is installed, found from its top-level package's folder without importing anything
    (importing vLLM's packages would resolve its platform in this process)."""
    from pathlib import Path

    top, _, rest = name.partition(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None or not rest:
        return spec is not None
    sub = Path(*rest.split("."))
    return any((Path(p) / sub).with_suffix(".py").is_file() or (Path(p) / sub / "__init__.py").is_file()
               for p in spec.submodule_search_locations or ())


def doctor_checks(connector: str, plan) -> list:
    """``rlk-repro doctor --pd``: whether this machine has what the layout's connector needs (its module importable
    through vLLM, its packages), whether the connector moves this plan's KV unchanged, and what runs the pair."""
    from rlk_repro.doctor import FAIL, OK, WARN, Check

    conn = CONNECTORS[connector]
    module = conn.module or "vllm.distributed.kv_transfer.kv_connector.factory"
    found = _module_file(module)
    missing = [m for m in conn.packages if importlib.util.find_spec(m) is None]
    if not found or missing:
        what = ", ".join(([module] if not found else []) + missing)
        out = [Check("pd connector", FAIL, f"{conn.cls} needs {what} (not importable here)")]
    else:
        out = [Check("pd connector", OK, f"{conn.cls} ({module}): {conn.transport}")]
    r_rollout = any(plan.uses_rlk(m, "rollout") for m in MODULES)
    if conn.why and (r_rollout or not conn.one_gpu or connector == "decode-bench"):
        out.append(Check("pd kv layout", FAIL, conn.why))
    else:
        out.append(Check("pd kv layout", OK, "moves the engine's KV rows unchanged" if conn.lossless_rlk else
                         "vLLM's own layout handling (every rollout letter P)"))
    out.append(Check("pd engine", WARN, f"run --pd refuses: {engine_problem()}"))
    return out
