"""Check one run directory: every check, in order, into one :class:`Report`. Reads only."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .bitwise import check_train_data
from .chain import check_chain
from .claims import all_rr, check_bitwise_file, check_metrics
from .drift import DEFAULT_CLIP_EPS
from .evidence import EXIT_CODE, RUN_MARKERS, expected_plan
from .findings import finding
from .readbacks import check_readbacks
from .report import Report
from .run import check_exit_and_log, check_manifest
from .safeio import Caps, InputError, Root
from .seal import check_complete


@dataclass(frozen=True)
class Options:
    """What to require and how much to read."""

    require_bitwise: bool = False
    clip_eps: float = DEFAULT_CLIP_EPS
    worst_k: int = 10
    allowed_backends: frozenset[str] = frozenset()
    caps: Caps = field(default_factory=Caps)

    def to_json(self) -> dict[str, Any]:
        return {
            "require_bitwise": self.require_bitwise,
            "clip_eps": self.clip_eps,
            "worst_k": self.worst_k,
            "allowed_backends": sorted(self.allowed_backends),
            "caps": {
                "json_bytes": self.caps.json_bytes,
                "log_bytes": self.caps.log_bytes,
                "tensor_bytes": self.caps.tensor_bytes,
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


def validate_run(path: str | os.PathLike[str], options: Options | None = None) -> Report:
    """Check the run directory at ``path``; never writes anything."""
    opts = options or Options()
    run_dir = os.path.abspath(os.fspath(path))
    report = Report(run_dir=run_dir, options=opts.to_json())
    why = unusable_reason(run_dir) or not_a_run_reason(run_dir)
    if why:
        report.unusable = True
        report.findings.append(finding("INPUT_UNUSABLE", why, check="run"))
        return report
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
    f.extend(check_metrics(root, info["rounds"], bitwise))
    f.extend(check_bitwise_file(root, info["plan"], bitwise, info["rounds"]))
    report.inputs = dict(sorted(root.digests.items()))
    check_complete(root, report)
    return report
