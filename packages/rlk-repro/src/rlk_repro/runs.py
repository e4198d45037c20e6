"""The run directory (``docs/evidence.md``): creation, manifest, logs, train-data, metrics, bitwise file.

A run directory is append-only: :func:`create_run_dir` makes a new ``<UTC time>-<6 hex>`` directory
under the output root and refuses to reuse one. Every writer here writes whole files atomically
(temp file + ``os.replace``) except ``run.log`` and ``metrics.jsonl``, which are appended line by line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import platform
import secrets
import statistics
import subprocess
import sys
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlk_core.errors import RlkConfigError
from rlk_repro import lifecycle
from rlk_validate import evidence
from rlk_validate.evidence import BITWISE_SCHEMA, TRAIN_DATA_SCHEMA

log = logging.getLogger("rlk_repro")
PACKAGES = ("torch", "numpy", "safetensors", "rlk-core", "rlk-repro", "rlk-validate")
# Exit statuses of rlk-repro; a run directory's exit-code file holds the one its process exits with.
EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def exit_code_for(exc: BaseException) -> int:
    """The exit status for a run ended by ``exc``: 130 for Ctrl-C, 143 for SIGTERM, 2 for a configuration error,
    else 3."""
    if isinstance(exc, KeyboardInterrupt):
        return lifecycle.interrupt_status(exc)
    if isinstance(exc, RlkConfigError):
        return EXIT_USAGE
    return EXIT_FAILED


def ended_how(code: int) -> str:
    """How a run with exit status ``code`` ended, for its log line."""
    return {EXIT_INTERRUPTED: "interrupted (SIGINT)", lifecycle.EXIT_TERMINATED: "terminated (SIGTERM)"}.get(
        code, "failed")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def create_run_dir(output: str | os.PathLike[str], name: str | None = None) -> tuple[str, Path]:
    """A new run directory under ``output``: named by a fresh run id, or ``name`` (a matrix cell), which
    must not exist yet. Returns ``(run_id, path)``. ``output`` inside a run directory is refused."""
    root = Path(output)
    if root.exists() and not root.is_dir():
        raise RlkConfigError(f"--output {root} exists and is not a directory")
    lifecycle.refuse_inside_run_dir(root, "--output")
    root.mkdir(parents=True, exist_ok=True)
    for _ in range(16 if name is None else 1):
        run_id = new_run_id()
        path = root / (name or run_id)
        try:
            path.mkdir()
        except FileExistsError:
            if name is not None:
                raise RlkConfigError(f"{path} already exists; a run never writes into an existing directory") from None
            continue
        for sub in (evidence.READBACKS_DIR, evidence.TRAIN_DATA_DIR, evidence.REPORT_DIR):
            (path / sub).mkdir()
        return run_id, path
    raise RlkConfigError(f"could not create a new run directory under {root}")


@dataclass
class Run:
    """A run directory this process writes: its id, path, writer lock and ``run.log`` handler."""

    run_id: str
    path: Path
    lock: lifecycle.Lock
    log_handler: logging.Handler


def begin_run(output: str | os.PathLike[str], name: str | None = None, command: list[str] | None = None) -> Run:
    """Create a run directory (:func:`create_run_dir`), hold its writer lock and open its ``run.log``. Signals
    raise again (:func:`rlk_repro.lifecycle.arm_signals`: one held since the last run ended is raised here, before
    anything is created). End it with :func:`end_run` on every path."""
    lifecycle.arm_signals()
    run_id, path = create_run_dir(output, name)
    lock = lifecycle.lock_run_dir(path)
    handler = open_run_log(path)
    log.info("run %s: written by pid %d on %s: %s", run_id, os.getpid(), platform.node(),
             " ".join(str(c) for c in (command if command is not None else sys.argv)))
    if lock.fd is None:
        log.warning("run %s: this file system has no flock for directories; the run directory is not locked",
                    run_id)
    return Run(run_id, path, lock, handler)


def end_run(run: Run, code: int, failure: BaseException | None) -> None:
    """The run ended with status ``code`` (``failure``: the exception ending it, if any): from here signals are
    held (:mod:`rlk_repro.lifecycle`), ``exit-code`` is written, the log closed and the lock released — on every
    path. Where ``exit-code`` cannot be written, a failing run's own error stays the one raised (this one goes to
    stderr and the log); a run that had succeeded fails with it."""
    with lifecycle.held():
        try:
            write_exit_code(run.path, code)
        except OSError as exc:
            what = f"cannot write {run.path / evidence.EXIT_CODE}: {exc.strerror or exc}"
            log.error("run %s: %s", run.run_id, what)
            if failure is None:
                raise OSError(exc.errno, what) from None
            print(f"rlk-repro: also {what} (the run had already failed; its own error follows)", file=sys.stderr)
        finally:
            close_run_log(run.log_handler)
            run.lock.release()


def write_json_atomic(path: Path, doc: Any) -> None:
    evidence.write_json_atomic(path, doc)


def append_jsonl(path: Path, doc: dict[str, Any]) -> None:
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(doc, allow_nan=False) + "\n")


class RunLogHandler(logging.FileHandler):
    """``run.log``: no traceback is ever formatted there; a write that fails (a full disk) is said once on
    stderr — not a "Logging error" traceback per record — and the records after it are dropped."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, encoding="utf-8")
        self.setFormatter(_NoTracebackFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.failed: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.failed is None:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        self.failed = f"{type(exc).__name__}: {exc}"
        print(f"rlk-repro: cannot write {self.baseFilename}: {self.failed}; later lines of this run's log are lost",
              file=sys.stderr)

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # the final flush on a full disk: already said (or nothing left to say)
            pass


def open_run_log(run_dir: Path) -> logging.Handler:
    """Send the ``rlk`` and ``rlk_repro`` loggers to ``run.log`` (:class:`RunLogHandler`)."""
    handler = RunLogHandler(run_dir / "run.log")
    for name in ("rlk", "rlk_repro"):
        lg = logging.getLogger(name)
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    return handler


def close_run_log(handler: logging.Handler) -> None:
    """Detach ``handler`` from every logger it was added to, then close it (both always happen)."""
    try:
        for name in ("rlk", "rlk_repro"):
            logging.getLogger(name).removeHandler(handler)
    finally:
        handler.close()


class _NoTracebackFormatter(logging.Formatter):
    def formatException(self, ei) -> str:
        return f"{ei[0].__name__}: {ei[1]}" if ei and ei[0] else ""


def write_exit_code(run_dir: Path, code: int) -> None:
    evidence.write_bytes_atomic(run_dir / evidence.EXIT_CODE, f"{int(code)}\n".encode())


# -- manifest ----------------------------------------------------------------------------------
def repo_state(path: Path) -> dict[str, Any]:
    """Name, path, HEAD SHA and dirty state of the git checkout holding ``path`` (best effort)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None:
        archived = archive_revision()
        if archived is not None:  # a `git archive` of a commit: exactly that commit's files
            return {"name": "rlk", "path": str(path), "sha": archived, "dirty": False, "source": "git archive"}
        return {"name": "rlk", "path": str(path), "sha": None, "dirty": None, "error": "not a git checkout"}
    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=normal")
    dirty = bool(status) if status is not None else None
    out: dict[str, Any] = {"name": "rlk", "path": top, "sha": sha, "dirty": dirty}
    if sha is None:
        out["error"] = "the checkout has no commit"
    return out


REVISION_FILE = Path(__file__).resolve().parent / "REVISION"


def archive_revision(path: Path | None = None) -> str | None:
    """The commit ``git archive`` wrote into ``rlk_repro/REVISION`` (``export-subst`` in .gitattributes), or
    None where the file still holds the placeholder (a checkout, or a copy made another way)."""
    try:
        text = (path or REVISION_FILE).read_text().strip()
    except OSError:
        return None
    return text if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else None


def package_versions() -> dict[str, str]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    out["python"] = platform.python_version()
    return out


def hardware(device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": str(device), "name": props.name, "driver": None, "cuda_runtime": torch.version.cuda,
                "capability": f"{props.major}.{props.minor}", "memory_bytes": props.total_memory}
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"device": "cpu", "name": name, "driver": None, "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count()}


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


# -- train-data --------------------------------------------------------------------------------
def write_train_data(run_dir: Path, rnd: int, rank: int, prompts: list[list[int]], responses: list[list[int]],
                     rollout_logps: list[torch.Tensor], train_logps: list[torch.Tensor], rewards: list[float],
                     advantages: list[float]) -> Path:
    """One round's train data of one rank: token ids, response mask, both sides' log-probs and the
    per-sequence rewards and advantages the update used."""
    s = len(prompts)
    t = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.zeros((s, t), dtype=torch.int64)
    mask = torch.zeros((s, t), dtype=torch.bool)
    rl = torch.zeros((s, t), dtype=torch.float32)
    tl = torch.zeros((s, t), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        lp, n = len(p), len(r)
        ids[i, : lp + n] = torch.tensor(p + r, dtype=torch.int64)
        mask[i, lp : lp + n] = True
        rl[i, lp : lp + n] = rollout_logps[i].cpu()
        tl[i, lp : lp + n] = train_logps[i].cpu()
    path = run_dir / evidence.TRAIN_DATA_DIR / evidence.train_data_name(rnd, rank)
    tmp = path.with_name(f".{path.name}.tmp")
    tensors = {"token_ids": ids, "response_mask": mask, "rollout_logprobs": rl, "train_logprobs": tl,
               "rewards": torch.tensor(rewards, dtype=torch.float32),
               "advantages": torch.tensor(advantages, dtype=torch.float32)}
    save_file(tensors, str(tmp),
              metadata={"schema": TRAIN_DATA_SCHEMA, "round": str(rnd), "rank": str(rank)})
    os.replace(tmp, path)
    return path


def compare(rollout: torch.Tensor, train: torch.Tensor) -> dict[str, Any]:
    """Bitwise comparison of two fp32 vectors of active tokens (bit patterns; diffs in float64), also over the
    informative tokens (rollout log-prob < :data:`~rlk_validate.evidence.INFORMATIVE_LOGP`: probability < 0.999)."""
    r, t = rollout.detach().cpu().float().contiguous(), train.detach().cpu().float().contiguous()
    neq = r.view(torch.int32) != t.view(torch.int32)
    diff = (r.double() - t.double()).abs()
    finite = diff[torch.isfinite(diff)]
    informative = r < evidence.INFORMATIVE_LOGP
    return {
        "element_count": int(r.numel()),
        "mismatch_count": int(neq.sum()),
        "informative_count": int(informative.sum()),
        "informative_mismatch_count": int((neq & informative).sum()),
        "max_abs_diff": float(finite.max()) if finite.numel() else 0.0,
        "mean_abs_diff": float(finite.mean()) if finite.numel() else 0.0,
        # pairs whose difference is not finite (a log-prob of -inf on one side: a token outside that side's kept
        # set); counted as mismatches above, left out of the two differences
        "nonfinite_diff_count": int(diff.numel() - finite.numel()),
    }


_ROUND_KEYS = ("round", "element_count", "mismatch_count", "informative_count", "informative_mismatch_count",
               "max_abs_diff", "mean_abs_diff")


def sampling_semantics(temperature: float, top_k: int, top_p: float, min_p: float, rollout_logprobs: str,
                       train_logprobs: str) -> dict[str, Any]:
    """The manifest's ``sampling``: the filters the rollout sampled with and what each side's log-prob is —
    ``processed`` (over the kept set, contract ``rlk.logp.processed.v1`` under R) or ``unfiltered`` (over the whole
    vocabulary). Without a filter the two are the same distribution (``filtered`` False). rlk-validate refuses a
    comparison of a processed log-prob with an unfiltered one when the rollout filtered."""
    filtered = top_p < 1.0 or top_k > 0 or min_p > 0.0
    return {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p, "filtered": filtered,
            "rollout": {"logprobs": rollout_logprobs}, "train": {"logprobs": train_logprobs}}


def kept_metrics(rollout_sizes: list[int], train_sizes: torch.Tensor | None) -> dict[str, Any]:
    """A round's kept-set statistics (the rollout's kept-set size per sampled token: mean, median, p99, the fraction
    of singletons) and, where the trainer found its own kept sets, how many positions' sizes differ."""
    if not rollout_sizes:
        return {}
    ordered = sorted(rollout_sizes)
    n = len(ordered)
    out: dict[str, Any] = {"kept_set": {
        "tokens": n, "mean": round(statistics.fmean(ordered), 4), "median": float(statistics.median(ordered)),
        "p99": ordered[min(n - 1, int(0.99 * n))], "singletons": round(sum(x == 1 for x in ordered) / n, 6)}}
    if train_sizes is not None:
        train = [int(x) for x in train_sizes.tolist()]
        out["kept_set_mismatches"] = (sum(a != b for a, b in zip(rollout_sizes, train, strict=True))
                                      if len(train) == n else n)
    return out


def _finite(r: dict[str, Any]) -> int:
    """A round's compared pairs with a finite difference (those its ``mean_abs_diff`` is over)."""
    return r["element_count"] - r.get("nonfinite_diff_count", 0)


def bitwise_document(rounds: list[dict[str, Any]], require_exact: bool, fallback_failures: int) -> dict[str, Any]:
    elements = sum(r["element_count"] for r in rounds)
    finite = sum(_finite(r) for r in rounds)
    mismatches = sum(r["mismatch_count"] for r in rounds)
    return {
        "schema": BITWISE_SCHEMA,
        "require_exact": require_exact,
        "torch_equal": mismatches == 0,
        "element_count": elements,
        "mismatch_count": mismatches,
        "informative_count": sum(r["informative_count"] for r in rounds),
        "informative_mismatch_count": sum(r["informative_mismatch_count"] for r in rounds),
        "max_abs_diff": max((r["max_abs_diff"] for r in rounds), default=0.0),
        # each round's mean is over its finite pairs (compare leaves the non-finite out): weighted by those
        "mean_abs_diff": (sum(r["mean_abs_diff"] * _finite(r) for r in rounds) / finite) if finite else 0.0,
        "rounds": [{k: r[k] for k in _ROUND_KEYS} for r in rounds],
        "fallback_failures": fallback_failures,
    }


def no_learning_signal(rnd: int, advantages: list[float], samples_per_prompt: int, static: bool) -> str | None:
    """What a round says when every advantage is 0 (issue 41, item 13: the reward separated the samples of no group,
    e.g. a saturated reward; rlk-validate names such rounds ADVANTAGES_ZERO); None while there is a learning signal,
    or where no signal was possible and the run said so at start (one sample per prompt, static weights)."""
    if static or samples_per_prompt < 2 or any(a != 0 for a in advantages):
        return None
    return (f"round {rnd}: every advantage is 0 (the reward separated the samples of no group): this update has no "
            "learning signal")


def round_metrics(rnd: int, cmp: dict[str, Any], rewards: list[float], train: Any, rollout_tokens: int,
                  generated: int, rollout_seconds: float, device: torch.device, changed: bool,
                  samples: int, responses: list[list[int]], rollout_logps: torch.Tensor,
                  entropy_mean: float | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """The fields of one round's ``metrics.jsonl`` row that every engine writes (``train``: the trainer's
    step result with ``loss``, ``grad_norm``, ``tokens``, ``seconds``); an engine adds its own after them.

    How much the round's evidence says: the informative tokens (counts and fraction), ``sampled_nll_mean`` (the mean
    of ``-log p`` of the sampled tokens: an estimate of the sampling distribution's entropy, in nats, exact in
    expectation where the tokens are drawn from the distribution the log-prob is of), ``entropy_mean`` where the
    engine computes it exactly (the mean over sampled positions of the entropy of ``softmax(logits / T)``), its
    ceiling ``max_entropy`` (``log V``), and how many of the responses are distinct."""
    lp = rollout_logps.double()
    return {
        "schema": evidence.METRICS_SCHEMA, "round": rnd, "compared_tokens": cmp["element_count"],
        "mismatch_count": cmp["mismatch_count"], "informative_tokens": cmp["informative_count"],
        "informative_mismatch_count": cmp["informative_mismatch_count"],
        "informative_fraction": cmp["informative_count"] / max(cmp["element_count"], 1),
        "sampled_nll_mean": float(-lp.mean()) if lp.numel() else 0.0,
        **({"entropy_mean": entropy_mean} if entropy_mean is not None else {}),
        **({"max_entropy": math.log(vocab_size)} if vocab_size else {}),
        "distinct_responses": len({tuple(x) for x in responses}),
        "max_abs_diff": cmp["max_abs_diff"],
        "mean_abs_diff": cmp["mean_abs_diff"], "reward_mean": sum(rewards) / len(rewards),
        "reward_std": float(torch.tensor(rewards, dtype=torch.float64).std(unbiased=False)),
        "loss": train.loss, "grad_norm": train.grad_norm,
        "rollout_tokens_per_s": rollout_tokens / max(rollout_seconds, 1e-9),
        "rollout_generated_tokens_per_s": generated / max(rollout_seconds, 1e-9),
        "train_tokens_per_s": train.tokens / max(train.seconds, 1e-9),
        "rollout_seconds": rollout_seconds, "train_seconds": train.seconds,
        "rollout_tokens": rollout_tokens, "train_tokens": train.tokens,
        "peak_memory_bytes": peak_memory_bytes(device), "weights_changed": changed,
        "samples": samples, "response_tokens": generated,
    }


def write_verdict(run_dir: Path | None, heading: str, rounds: list[dict[str, Any]], plan: Any, exact_required: bool,
                  readback_mode: str, fallbacks: int) -> tuple[dict[str, Any], bool]:
    """The bitwise document and the run summary (written unless ``run_dir`` is ``None``: a rank that is not
    the lead), the verdict logged; returns ``(bitwise document, failed)``. A run fails where the plan requires
    exact equality, strict readbacks are on and a token differs or a fallback ran."""
    bitwise = bitwise_document(rounds, exact_required, fallbacks)
    if run_dir is not None:
        write_json_atomic(run_dir / "bitwise-validation.json", bitwise)
        (run_dir / "report" / "summary.md").write_text(
            f"# {heading}\n\n```\n" + summary_table(rounds, bitwise) + "\n```\n", encoding="utf-8")
    failed = exact_required and readback_mode == "strict" and (bitwise["mismatch_count"] > 0 or fallbacks > 0)
    if failed:
        log.error("bitwise check FAILED: %d of %d compared tokens differ (plan %s requires exact equality)",
                  bitwise["mismatch_count"], bitwise["element_count"], plan.as_dict())
    else:
        log.info("bitwise: %d of %d compared tokens differ (exact equality %s)", bitwise["mismatch_count"],
                 bitwise["element_count"], "required" if exact_required else "not required")
    return bitwise, failed


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(rss if sys.platform == "darwin" else rss * 1024)
    except (ImportError, OSError):
        return 0


# -- report ------------------------------------------------------------------------------------
def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.3g}"


def summary_table(rounds: list[dict[str, Any]], bitwise: dict[str, Any]) -> str:
    """The per-round table the CLI prints and ``report/summary.md`` holds: ``informative`` is the share of compared
    tokens with a rollout log-prob below -1e-3 (and the mismatches among them), ``entropy`` the mean entropy of the
    sampling distribution in nats (``~`` where only estimated from the sampled tokens' log-probs); an MoE run adds
    ``routing``: the tokens the two sides routed to different expert sets, of those both routed (issue 36)."""
    moe = any("routing_compared_tokens" in r for r in rounds)
    head = ("round", "compared", "mismatch", *(("routing",) if moe else ()), "informative", "entropy", "max|diff|",
            "mean|diff|", "reward", "loss", "roll tok/s", "train tok/s", "changed")
    rows = [head]
    for r in rounds:
        ent = (f"{r['entropy_mean']:.3g}" if r.get("entropy_mean") is not None
               else f"~{r['sampled_nll_mean']:.3g}" if "sampled_nll_mean" in r else "")
        routing = (f"{r['routing_mismatch_tokens']}/{r['routing_compared_tokens']}",) if moe else ()
        rows.append((str(r["round"]), str(r["element_count"]), str(r["mismatch_count"]), *routing,
                     _informative(r.get("informative_count"), r.get("informative_mismatch_count"), r["element_count"]),
                     ent, _fmt(r["max_abs_diff"]), _fmt(r["mean_abs_diff"]), f"{r['reward_mean']:.3f}",
                     f"{r['loss']:.4g}", f"{r['rollout_tokens_per_s']:.0f}", f"{r['train_tokens_per_s']:.0f}",
                     "yes" if r["weights_changed"] else "NO"))
    b = bitwise
    routing = ((f"{sum(r['routing_mismatch_tokens'] for r in rounds)}/"
                f"{sum(r['routing_compared_tokens'] for r in rounds)}",) if moe else ())
    rows.append(("total", str(b["element_count"]), str(b["mismatch_count"]), *routing,
                 _informative(b.get("informative_count"), b.get("informative_mismatch_count"), b["element_count"]),
                 "", _fmt(b["max_abs_diff"]), _fmt(b["mean_abs_diff"]), "", "", "", "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.insert(len(lines) - 1, lines[1])
    return "\n".join(lines)


def _informative(n: int | None, mismatches: int | None, compared: int) -> str:
    if n is None:
        return ""
    return f"{100 * n / max(compared, 1):.0f}% ({mismatches} diff)"
