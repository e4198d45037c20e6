"""Check one run directory: every check, in order, into one :class:`Report`. Reads only."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .bitwise import check_train_data
from .chain import check_chain
from .claims import all_rr, check_bitwise_file, check_metrics, is_int
from .coverage import digest_tree
from .cuda_graphs import check_cuda_graphs
from .digest import check_digests
from .drift import DEFAULT_CLIP_EPS
from .evidence import EXIT_CODE, INFORMATIVE_LOGP, MIN_INFORMATIVE_FRACTION, RUN_MARKERS, expected_plan
from .findings import finding
from .greedy import check_greedy
from .kernel_trace import check_kernel_trace
from .pd import check_pd
from .readbacks import check_readbacks
from .report import Report
from .run import check_exit_and_log, check_manifest
from .safeio import Caps, InputError, Root
from .seal import SEAL_WAIT_S, check_complete, run_dir_lock


@dataclass(frozen=True)
class Options:
    """What to require and how much to read."""

    require_bitwise: bool = False
    clip_eps: float = DEFAULT_CLIP_EPS
    worst_k: int = 10
    allowed_backends: frozenset[str] = frozenset()
    caps: Caps = field(default_factory=Caps)
    #: a PEM Ed25519 public key the seal must be signed by (``--verify-key``)
    verify_key: str | None = None
    #: the least fraction of informative tokens (rollout log-prob < -1e-3) every round must have
    min_informative_fraction: float = MIN_INFORMATIVE_FRACTION

    def to_json(self) -> dict[str, Any]:
        return {
            "require_bitwise": self.require_bitwise,
            "verify_key": self.verify_key,
            "min_informative_fraction": self.min_informative_fraction,
            "clip_eps": self.clip_eps,
            "worst_k": self.worst_k,
            "allowed_backends": sorted(self.allowed_backends),
            "caps": {
                "json_bytes": self.caps.json_bytes,
                "log_bytes": self.caps.log_bytes,
                "tensor_bytes": self.caps.tensor_bytes,
                "stream_bytes": self.caps.stream_bytes,
            },
        }


def unusable_reason(path: str) -> str | None:
    """Why ``path`` cannot be checked at all, or None."""
    if not os.path.lexists(path):
        return f"{path} does not exist"
    if not os.path.isdir(path):
        return f"{path} is not a directory"
    try:
        os.listdir(path)
    except OSError as e:
        return f"{path} cannot be listed: {e.strerror or e}"
    return None


def not_a_run_reason(path: str) -> str | None:
    """Why the (listable) directory ``path`` is not a run directory at all, or None."""
    names = os.listdir(path)
    if any(n in RUN_MARKERS for n in names):
        return None
    cells = sorted(n for n in names if expected_plan(n) is not None and os.path.isdir(os.path.join(path, n)))
    if cells:
        return (f"{path} is a matrix root (cells {', '.join(cells[:3])}{', ...' if len(cells) > 3 else ''}), "
                f"not a run directory: check it with `rlk-validate matrix {path}`")
    return (f"{path} is not a run directory (none of {', '.join(RUN_MARKERS)} is there); "
            "a matrix root is checked with `rlk-validate matrix DIR`")


def _silent(x: Any) -> Any:
    """A VIME run that finished with no readback from one side will never have it: its processes did not
    see ``RL_KERNEL_*`` (Ray workers do not inherit the launcher's environment), so that side ran
    production code whatever the plan said. An error, not missing evidence."""
    if x.code != "READBACKS_MISSING" or not x.message.startswith("no readback from the "):
        return x
    return finding("READBACKS_SIDE_SILENT", x.message + "; the run finished, so its processes never saw "
                   "RL_KERNEL_* (forward them through Ray's runtime env: docs/vime.md)", check=x.check, path=x.path)


def _manifest_doc(root: Root) -> Any:
    """manifest.json as parsed (None where unreadable: check_manifest has reported why)."""
    try:
        return root.read_json("manifest.json")
    except InputError:
        return None


def validate_run(path: str | os.PathLike[str], options: Options | None = None, *, locked: bool = False) -> Report:
    """Check the run directory at ``path``; never writes anything. Waits up to a few seconds for a sealer holding
    the run directory's lock (``locked``: the caller holds it)."""
    opts = options or Options()
    run_dir = os.path.abspath(os.fspath(path))
    report = Report(run_dir=run_dir, options=opts.to_json())
    why = unusable_reason(run_dir) or not_a_run_reason(run_dir)
    if why:
        report.unusable = True
        report.findings.append(finding("INPUT_UNUSABLE", why, check="run"))
        return report
    if locked:
        _validate(run_dir, opts, report)
        return report
    with run_dir_lock(run_dir, SEAL_WAIT_S, shared=True) as busy:
        if busy:
            report.findings.append(finding("RUN_DIR_BUSY", f"{busy}; this check read it as it was", check="run"))
        _validate(run_dir, opts, report)
    return report


def _validate(run_dir: str, opts: Options, report: Report) -> None:
    root = Root(run_dir, opts.caps, check="run")
    f = report.findings

    mf, info = check_manifest(root)
    f.extend(mf)
    f.extend(check_chain(root, _manifest_doc(root)))  # a resumed attempt: its link to the run it continued
    report.plan, report.run_id = info["plan"], info["run_id"]
    f.extend(check_exit_and_log(root))

    rf, summary = check_readbacks(root, info["plan"], info["run_id"], opts.allowed_backends)
    if info.get("engine") == "vime" and root.lexists(EXIT_CODE):
        rf = [_silent(x) for x in rf]
    f.extend(rf)
    report.readbacks = summary

    report.require_exact = opts.require_bitwise or all_rr(info["plan"])
    bf, bitwise, drift = check_train_data(
        root,
        require_exact=report.require_exact,
        expected_rounds=info["rounds"],
        expected_ranks=info["ranks"],
        clip_eps=opts.clip_eps,
        worst_k=opts.worst_k,
    )
    f.extend(bf)
    report.bitwise, report.drift = bitwise, drift
    mfind, rows = check_metrics(root, info["rounds"], bitwise)
    f.extend(mfind)
    f.extend(check_digests(root, _manifest_doc(root), rows))  # issue 37: the contract digest handshake
    f.extend(check_bitwise_file(root, info["plan"], bitwise, info["rounds"]))
    f.extend(_informative(bitwise, report.require_exact, opts.min_informative_fraction))
    f.extend(_static_weights(rows, bitwise, info, report.require_exact))
    f.extend(_zero_advantage_rounds(bitwise, info))
    f.extend(_sampling(_manifest_doc(root), rows, report.require_exact))
    f.extend(_rollout_quantization(_manifest_doc(root), report.require_exact))  # issue 38
    f.extend(check_greedy(root, _manifest_doc(root), report.require_exact))  # issue 40: greedy rollout requests
    f.extend(check_kernel_trace(root, info["plan"], _manifest_doc(root)))  # issue 37: run --trace
    f.extend(check_cuda_graphs(root, _manifest_doc(root)))  # issue 37: CUDA-graph evidence vs the manifest
    f.extend(check_pd(root, _manifest_doc(root), report.require_exact))  # issue 37: the Prefill/Decode layout
    f.extend(digest_tree(root))
    report.inputs = dict(sorted(root.digests.items()))
    check_complete(root, report, opts.verify_key)


def _rollout_quantization(manifest: Any, require_exact: bool) -> list[Any]:
    """A quantized rollout (``rollout_quantization``, top level or in ``config``) against an unquantized trainer is
    a mismatch knob of the ladder (docs/ladder.md): required bitwise, it is an error whatever the counts say."""
    if not isinstance(manifest, dict):
        return []
    config = manifest.get("config") if isinstance(manifest.get("config"), dict) else {}
    quant = manifest.get("rollout_quantization", config.get("rollout_quantization"))
    if quant in (None, "none"):
        return []
    return [finding("QUANTIZED_ROLLOUT", f"the rollout ran quantized ({str(quant)[:40]!r}) and the trainer did not: "
                    "a mismatch knob, not a bitwise claim" + (" (bitwise equality was required)" if require_exact
                                                                 else ""), check="run", path="manifest.json",
                    severity=None if require_exact else "info", quantization=str(quant)[:40])]


def _informative(bitwise: dict[str, Any] | None, require_exact: bool, bound: float) -> list[Any]:
    """Rounds whose compared tokens are mostly saturated (rollout log-prob >= -1e-3): their equal bits prove little."""
    if not bitwise:
        return []
    low = [r for r in bitwise["rounds"] if r["element_count"] and r["informative_fraction"] < bound]
    if not low:
        return []
    shown = ", ".join(f"round {r['round']}: {r['informative_count']} of {r['element_count']} "
                      f"({100 * r['informative_fraction']:.1f}%)" for r in low[:6]) + (" ..." if len(low) > 6 else "")
    return [finding("INFORMATIVE_FRACTION_LOW", f"informative tokens (rollout log-prob < {INFORMATIVE_LOGP:g}) below "
                    f"{100 * bound:g}% of the compared ones in {len(low)} round(s): {shown}; the policy has saturated, "
                    "so bitwise equality over those rounds proves little", check="bitwise", path="train-data",
                    severity=None if require_exact else "warning", rounds=[r["round"] for r in low])]


def _sampling(manifest: Any, rows: dict[int, dict[str, Any]], require_exact: bool) -> list[Any]:
    """The sampling semantics of the manifest (``sampling``: the rollout's filters, each side's log-prob) and the
    kept-set statistics of the metrics: a comparison of different semantics under filters, and kept sets that
    differ between the sides, are findings; the size distribution is reported."""
    out: list[Any] = []
    sampling = manifest.get("sampling") if isinstance(manifest, dict) else None
    if isinstance(sampling, dict) and sampling.get("filtered") is True:
        sides = {side: (sampling.get(side) or {}).get("logprobs") for side in ("rollout", "train")}
        if sides["rollout"] != sides["train"]:
            out.append(finding("SAMPLING_SEMANTICS_DIFFER", f"the rollout sampled with top_k={sampling.get('top_k')}, "
                               f"top_p={sampling.get('top_p')}, min_p={sampling.get('min_p')}; its log-probs are "
                               f"{sides['rollout']}, the trainer's {sides['train']}: the two sides compared different "
                               "distributions", check="run", path="manifest.json",
                               severity=None if require_exact else "warning"))
    stats = [(r, row["kept_set"]) for r, row in sorted(rows.items()) if _kept_stats_ok(row.get("kept_set"))]
    differ = {r: row["kept_set_mismatches"] for r, row in rows.items() if is_int(row.get("kept_set_mismatches"))
              and row["kept_set_mismatches"] > 0}
    if differ:
        out.append(finding("KEPT_SET_MISMATCH", f"kept-set sizes differ at {sum(differ.values())} position(s) in "
                           f"round(s) {sorted(differ)}", check="run", path="metrics.jsonl",
                           severity=None if require_exact else "warning", rounds=sorted(differ)))
    tokens = sum(s["tokens"] for _, s in stats)
    if stats and tokens:
        mean = sum(s["mean"] * s["tokens"] for _, s in stats) / tokens
        singles = sum(s["singletons"] * s["tokens"] for _, s in stats) / tokens
        medians = sorted(s["median"] for _, s in stats)
        p99 = max(s["p99"] for _, s in stats)
        out.append(finding("KEPT_SET_SIZES", f"{tokens} sampled tokens: kept-set size mean {mean:.2f}, median of the "
                           f"rounds' medians {medians[len(medians) // 2]:g}, largest round p99 {p99}, singletons "
                           f"{100 * singles:.1f}%", check="run", path="metrics.jsonl", tokens=tokens,
                           mean=round(mean, 4), singletons=round(singles, 6), p99=p99))
    return out


def _kept_stats_ok(s: Any) -> bool:
    """A metrics row's ``kept_set`` as the engines write it (an untrusted file: anything else is not summarised)."""
    def num(x: Any) -> bool:
        return type(x) in (int, float) and x == x and abs(x) < 1e18
    return (isinstance(s, dict) and is_int(s.get("tokens")) and 0 < s["tokens"] < 10**15
            and all(num(s.get(k)) for k in ("mean", "median", "p99", "singletons")))


def _zero_advantage_rounds(bitwise: dict[str, Any] | None, info: dict[str, Any]) -> list[Any]:
    """Rounds, some but not all, in which every sequence's advantage was 0 (the reward did not separate the samples
    of any group, e.g. a saturated reward): their update had no learning signal and the weights moved only by the
    optimizer's momentum and decay. Every round so: :func:`_static_weights`."""
    rounds = (bitwise or {}).get("rounds") or []
    zero = [r["round"] for r in rounds if r.get("advantages_all_zero") is True]
    n = info["rounds"] or len(rounds)
    if not zero or len(zero) >= n or info.get("static_weights"):
        return []
    shown = ", ".join(map(str, zero[:12])) + (" ..." if len(zero) > 12 else "")
    return [finding("ADVANTAGES_ZERO", f"every advantage was 0 in {len(zero)} of {n} round(s) "
                    f"({shown}): those updates had no learning signal (the reward did not separate the samples of "
                    "any group), so the policy the later rounds compare barely moved", check="bitwise",
                    path="train-data", rounds=zero)]


def _static_weights(rows: dict[int, dict[str, Any]], bitwise: dict[str, Any] | None, info: dict[str, Any],
                    require_exact: bool) -> list[Any]:
    """A run of several rounds whose weights never changed between them (metrics say so, or no sequence had a
    non-zero advantage): its claim over rounds is about one fixed model."""
    n = info["rounds"]
    if not n or n < 2:
        return []
    updates = [row.get("weights_changed") for r, row in rows.items() if r < n - 1]  # bounded by the file
    why = None
    if len(updates) == n - 1 and all(u is False for u in updates):
        why = f"metrics.jsonl says no update of the {n - 1} between rounds changed the weights"
    rounds = (bitwise or {}).get("rounds") or []
    if why is None and len(rounds) == n and all(r.get("advantages_all_zero") for r in rounds):
        why = "every advantage of every round is 0: no update had a learning signal"
    if why is None:
        return []
    if info.get("static_weights"):
        return [finding("WEIGHTS_STATIC", f"{why}; the run asked for static weights (config.static_weights)",
                        check="run", path="metrics.jsonl", severity="info")]
    return [finding("WEIGHTS_STATIC", f"{why}: a bitwise claim over rounds then holds for one fixed model "
                    "(e.g. --samples-per-prompt 1 makes every GRPO advantage 0)", check="run", path="metrics.jsonl",
                    severity=None if require_exact else "warning")]
