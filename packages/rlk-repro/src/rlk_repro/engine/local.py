"""The local experiment: N rounds of rollout -> train recompute -> compare -> update -> weight sync.

:func:`run_local` writes the whole run directory (``docs/evidence.md``) and returns a
:class:`LocalRunResult`; what it shows goes through :class:`rlk_repro.progress.Progress` (the run
directory first, then one line per round; the CLI prints the summary). Readbacks come from two recorders of
framework ``local``: the trainer's (side ``train``) and the rollout engine's (side ``rollout``).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlk_core.errors import RlkConfigError
from rlk_core.ops.rope import reserve_tables
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_repro import lifecycle, runs
from rlk_repro.engine.prompts import PromptSet, load_prompt_set, manifest_facts
from rlk_repro.engine.rollout import LOGPROBS, Request, RolloutEngine
from rlk_repro.engine.routing import rollout_routing, routing_metrics
from rlk_repro.engine.sampling import SamplingParams
from rlk_repro.engine.trainer import Sample, Trainer, group_advantages
from rlk_repro.jitwatch import JitWatch
from rlk_repro.jitwatch import counts as jit_counts
from rlk_repro.model.config import Qwen3Config, preset
from rlk_repro.model.ops import Ops
from rlk_repro.model.weights import load_checkpoint, random_weights, weights_sha256
from rlk_repro.progress import Progress
from rlk_repro.resume import STATE_DIR, STATE_DOC, Parent, inherit, save_state
from rlk_repro.trace import Tracer
from rlk_validate import evidence

log = logging.getLogger("rlk_repro")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LocalRunConfig:
    plan: RoutePlan = field(default_factory=lambda: RoutePlan("R/R", "R/R", "R/R"))
    plan_sources: dict[str, str] = field(default_factory=dict)  # module -> where its case came from
    readback_mode_source: str = "default"
    rounds: int = 5
    seed: int = 1234
    device: str = "cpu"
    dtype: str = "float32"
    model: str = "tiny"
    checkpoint: str | None = None
    prompts_per_round: int = 4
    samples_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    logprobs: str = "processed"  # the log-prob both sides record: over the kept set, or "unfiltered"
    train_logprobs: str | None = None  # the trainer's, where it differs (a semantic-mismatch run); None: logprobs
    chunk_size: int = 16
    page_size: int = 8
    max_num_seqs: int = 6
    arrivals_per_step: int = 2
    optimizer: str = "adamw"
    lr: float | None = None  # None: default_lr(the model), set by load_model (docs/local-engine.md, "Options")
    static_weights: bool = False  # no update: the checkpoint's weights every round (asked for explicitly)
    readback_mode: str = "strict"
    threads: int | None = None  # torch intra-op threads for the run (None: leave torch's setting)
    require_exact: bool | None = None  # default: the plan is all R/R
    state_every: int = 1  # save the round state (rlk_repro.resume) every N rounds; 0 = never
    # issue 37: a real model and data (rlk_repro.engine.prompts)
    model_path: str | None = None  # HF directory: config, safetensors and tokenizer files
    prompt_data: str | None = None  # VIME JSONL (rlk-repro prepare's output); None: the bundled prompts
    input_key: str = "prompt"
    label_key: str = "label"
    apply_chat_template: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    rm_type: str | None = None  # deepscaler / stand-in; None: deepscaler with --model-path, else stand-in
    stop_token_ids: list[int] | None = None  # besides the config's, generation config's and tokenizer's EOS
    trace: bool = False  # issue 37: profile the first round of both sides into kernel-trace.json (rlk_repro.trace)
    phase: str | None = None  # the seeds' phase this run belongs to (rlk_repro.phases), recorded for report
    command: list[str] = field(default_factory=lambda: list(sys.argv))

    def validate(self) -> None:
        for name in ("rounds", "prompts_per_round", "samples_per_prompt", "max_new_tokens", "chunk_size",
                     "page_size", "max_num_seqs", "arrivals_per_step"):
            if getattr(self, name) < 1:
                raise RlkConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise RlkConfigError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.checkpoint is None:
            preset(self.model)  # a preset's name, else an RlkConfigError naming them
        if self.checkpoint is not None:
            Qwen3Config.from_dir(self.checkpoint)  # a readable config.json, before any run directory exists
        if self.model_path is not None:  # issue 37
            if self.checkpoint is not None:
                raise RlkConfigError("--model-path and --checkpoint are exclusive (--model-path also reads the "
                                     "tokenizer)")
            Qwen3Config.from_dir(self.model_path)
        if self.prompt_data is not None and not os.path.isfile(self.prompt_data):
            raise RlkConfigError(f"--prompt-data {self.prompt_data}: no such file")
        if self.apply_chat_template and self.model_path is None:
            raise RlkConfigError("--apply-chat-template needs --model-path DIR (the chat template is the tokenizer's)")
        if self.rm_type not in (None, "deepscaler", "stand-in"):
            raise RlkConfigError(f"--rm-type {self.rm_type!r} is not deepscaler or stand-in")
        if self.lr is not None and self.lr <= 0:
            raise RlkConfigError(f"lr must be > 0, got {self.lr}")
        if self.state_every < 0:
            raise RlkConfigError(f"state-every must be >= 0 (0 = never), got {self.state_every}")
        if self.threads is not None and self.threads < 1:
            raise RlkConfigError(f"threads must be >= 1, got {self.threads}")
        for name, value in (("logprobs", self.logprobs), ("train-logprobs", self.train_semantics)):
            if value not in LOGPROBS:
                raise RlkConfigError(f"{name} {value!r} is not one of {', '.join(LOGPROBS)}")
        SamplingParams(self.temperature, self.top_p, self.top_k, 1, self.seed, self.min_p)  # ranges, before any run
        if self.readback_mode not in ("strict", "audit"):
            raise RlkConfigError(f"readback mode {self.readback_mode!r} is not strict or audit")

    @property
    def train_semantics(self) -> str:
        return self.train_logprobs or self.logprobs

    @property
    def mode(self) -> str:
        return {"P/P": "native", "R/R": "consistency"}.get(_uniform(self.plan), "mixed")

    @property
    def exact_required(self) -> bool:
        return self.require_exact if self.require_exact is not None else _uniform(self.plan) == "R/R"


def _uniform(plan: RoutePlan) -> str | None:
    cases = set(plan.as_dict().values())
    return cases.pop() if len(cases) == 1 else None


@dataclass
class LocalRunResult:
    run_id: str
    run_dir: Path
    rounds: list[dict[str, Any]]
    bitwise: dict[str, Any]
    exit_code: int
    weights_changed_every_round: bool


def resolve_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise RlkConfigError(f"device {name!r} is not a torch device ({exc})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RlkConfigError(f"device {name!r} asked for, but this torch ({torch.__version__}) sees no CUDA GPU")
    if device.type not in ("cpu", "cuda"):
        raise RlkConfigError(f"device {name!r}: the local engine runs on cpu or cuda")
    return device


#: the default learning rate of a model of hidden size 64 (the tiny preset); wider models get less (default_lr)
DEFAULT_LR_AT_64 = 1e-4


def default_lr(model_cfg: Qwen3Config) -> float:
    """``1e-4 * (64 / hidden_size) ** (5/3)`` to one significant digit: tiny 1e-4, small 3e-5, the 0.6B shape 1e-6,
    the 30B-A3B layer shape 3e-7. AdamW moves every weight by about the learning rate a step whatever its gradient, so
    the logits move faster the wider (and deeper) the model. The exponent is the fit through the two measured points:
    tiny at 1e-4 stays live over 10 rounds (tests/repro/test_evidence_strength.py); the 0.6B shape at 1e-6 on the
    H200 (frameworks engine, 10 rounds, T 0.9) kept an informative share >= 24.6% every round with the reward rising
    0.27 -> 0.38, where 6.25e-6 (a 1 / H rule) fell below 10% from round 5 and 1e-4 collapsed it in one update
    (issue 41, benchmarks/results/h200/frameworks/filtered/)."""
    return float(f"{DEFAULT_LR_AT_64 * (64 / model_cfg.hidden_size) ** (5 / 3):.0e}")


def load_model(cfg: LocalRunConfig) -> tuple[Qwen3Config, dict[str, torch.Tensor], str]:
    """The model's config, its fp32 weights and their hash; a ``cfg.lr`` left to its default (None) is set here to
    :func:`default_lr` of the model (both engines call this before building the trainer or writing the manifest)."""
    model_cfg, weights = _load_model(cfg)
    if cfg.lr is None:
        cfg.lr = default_lr(model_cfg)
    return model_cfg, weights, weights_sha256(weights)


def _load_model(cfg: LocalRunConfig) -> tuple[Qwen3Config, dict[str, torch.Tensor]]:
    if cfg.checkpoint or cfg.model_path:
        model_cfg, weights = load_checkpoint(cfg.checkpoint or cfg.model_path)
        weights = {k: v.float() for k, v in weights.items()}
    else:
        model_cfg = preset(cfg.model)
        weights = random_weights(model_cfg, cfg.seed)
    return model_cfg, weights


def run_local(cfg: LocalRunConfig, output: str | os.PathLike[str], run_name: str | None = None,
              progress: Progress | None = None, resume: Parent | None = None) -> LocalRunResult:
    """Create a run directory under ``output`` (named ``run_name``, e.g. a matrix cell, or by its run id)
    and run the experiment into it; ``progress`` shows the run directory first, then one line per round.
    ``resume``: the interrupted run this new attempt continues (:mod:`rlk_repro.resume`)."""
    cfg.validate()
    device = resolve_device(cfg.device)
    dtype = DTYPES[cfg.dtype]
    progress = progress or Progress(enabled=False)
    run = runs.begin_run(output, run_name, cfg.command)
    run_id, run_dir = run.run_id, run.path
    progress.note(f"run directory {run_dir}")
    code, failure = runs.EXIT_FAILED, None
    threads_before = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        result = _run(cfg, run_id, run_dir, device, dtype, progress, resume)
        code = result.exit_code
        return result
    except BaseException as exc:  # the exit-code file says what the process will exit with, Ctrl-C included
        code, failure = runs.exit_code_for(exc), exc
        log.error("run %s: %s: %s", runs.ended_how(code), type(exc).__name__, exc)
        if (run_dir / STATE_DIR / STATE_DOC).is_file():
            progress.note(f"continue this run with: rlk-repro run --resume {run_dir}")
        raise
    finally:
        torch.set_num_threads(threads_before)
        runs.end_run(run, code, failure)


@dataclass
class _Session:
    """What one run holds while it goes: the two sides, their recorders and the prompts."""

    model_cfg: Qwen3Config
    engine: RolloutEngine
    trainer: Trainer
    recorders: tuple[ReadbackRecorder, ReadbackRecorder]
    prompts: list[Any]
    encoded: list[list[int]]
    checkpoint_hash: str
    max_len: int
    prompt_set: PromptSet
    tracer: Tracer = field(default_factory=lambda: Tracer(False, "cpu"))  # issue 37: run --trace
    digest: str | None = None  # the contract digest both sides agreed on at the start (rlk_core.digest)


def _run(cfg: LocalRunConfig, run_id: str, run_dir: Path, device: torch.device, dtype: torch.dtype,
         progress: Progress, resume: Parent | None = None) -> LocalRunResult:
    log.info("run %s: engine local, mode %s, plan %s, device %s, dtype %s", run_id, cfg.mode, cfg.plan.as_dict(),
             device, cfg.dtype)
    torch.manual_seed(cfg.seed)
    watch = JitWatch()
    try:
        ses = _start(cfg, run_id, run_dir, device, dtype, resume)
        ses.digest = _handshake(cfg, ses, "start")  # issue 37: before anything is compared
        manifest = _manifest(cfg, run_id, ses, device)
        first, rounds = 0, []
        if resume is not None:  # the parent's rounds before its state, then this attempt's from there
            manifest["resume"] = inherit(run_dir, resume)
            first, rounds = resume.next_round, resume.rows()
            log.info("run %s: resumes %s at round %d", run_id, resume.path, first)
        runs.write_json_atomic(run_dir / "manifest.json", manifest)
        all_changed = all(r["weights_changed"] for r in rounds)
        clock = progress.rounds(cfg.rounds, first)
        for rnd in range(first, cfg.rounds):
            row = _round(cfg, ses, run_dir, rnd, watch, progress)
            all_changed &= row["weights_changed"]
            rounds.append(row)
            if cfg.state_every and (rnd + 1) % cfg.state_every == 0 and rnd + 1 < cfg.rounds:
                save_state(run_dir, rnd + 1, ses.trainer.master, ses.trainer.opt, ses.engine.cache.free)
            clock.done(rnd, row)
            for rec in ses.recorders:
                rec.flush()
        return _finish(cfg, ses, run_id, run_dir, rounds, all_changed)
    finally:
        watch.close()


def _start(cfg: LocalRunConfig, run_id: str, run_dir: Path, device: torch.device, dtype: torch.dtype,
           resume: Parent | None = None) -> _Session:
    """The model, the prompts, one recorder per side and the two sides built on them (from ``resume``'s round
    state where one is given: its master weights, optimizer state and KV free list)."""
    plan = cfg.plan
    state = None
    if resume is None:
        model_cfg, weights, ckpt_hash = load_model(cfg)
    else:
        state = resume.load_state()
        model_dir = cfg.checkpoint or cfg.model_path
        model_cfg = Qwen3Config.from_dir(model_dir) if model_dir else preset(cfg.model)
        weights, ckpt_hash = state["master"], resume.manifest["inputs"]["checkpoint"]
    ps = load_prompt_set(cfg, model_cfg)  # issue 37: the model's tokenizer and template, or the bundled bytes
    prompts, encoded = ps.prompts, ps.encoded
    max_len = max(len(e) for e in encoded) + cfg.max_new_tokens
    readbacks = run_dir / "readbacks"
    rec_train = ReadbackRecorder("local", "train", plan, mode=cfg.readback_mode, directory=readbacks, run_id=run_id)
    rec_roll = ReadbackRecorder("local", "rollout", plan, mode=cfg.readback_mode, directory=readbacks, run_id=run_id)
    for rec, target in ((rec_train, "local.trainer"), (rec_roll, "local.rollout_engine")):
        for module in ("attention", "ffn", "logp"):
            rec.add_hook(f"rlk_repro.ops.{module}", f"{target}.{module}", "ops_table",
                         installed=plan.uses_rlk(module, rec.side))
    if any(plan.uses_rlk("attention", side) for side in ("train", "rollout")):
        # as the vLLM plugin and the Megatron provider do: rlk's rope reads this cos/sin table as it is; without it
        # every rope call sizes its table from positions.max(), a host sync (two per layer in every rollout step and
        # training forward). The rows are the same whatever the table's size: the bits do not change.
        rows = max(max_len, model_cfg.max_position_embeddings)  # a position past the table would give NaN
        reserve_tables(device, model_cfg.head_dim, model_cfg.rope_theta, rows)
    engine = RolloutEngine(model_cfg, weights, Ops(plan, "rollout", rec_roll), device=device, dtype=dtype,
                           page_size=cfg.page_size, chunk_size=cfg.chunk_size, max_num_seqs=cfg.max_num_seqs,
                           max_model_len=max_len, seed=cfg.seed, stop_token_ids=ps.stop_token_ids,
                           logprobs=cfg.logprobs)
    trainer = Trainer(model_cfg, weights, Ops(plan, "train", rec_train), device=device, dtype=dtype,
                      temperature=cfg.temperature, optimizer=cfg.optimizer, lr=cfg.lr, update=not cfg.static_weights,
                      sampling=sampling_params(cfg), logprobs=cfg.train_semantics)
    if state is not None:
        trainer.opt.load_state_dict(state["optimizer"])
        engine.cache.free = list(state["kv_free"])
    return _Session(model_cfg, engine, trainer, (rec_train, rec_roll), prompts, encoded, ckpt_hash, max_len, ps,
                    Tracer(cfg.trace, str(device)))


def _manifest(cfg: LocalRunConfig, run_id: str, ses: _Session, device: torch.device) -> dict[str, Any]:
    plan = cfg.plan
    sources = {m: cfg.plan_sources.get(m, "config") for m in plan.as_dict()}
    return {
        "schema": evidence.MANIFEST_SCHEMA, "run_id": run_id, "created_at": lifecycle.utc_now(), "engine": "local",
        "mode": cfg.mode, "command": [str(c) for c in cfg.command], "plan": plan.as_dict(),
        "plan_sources": sources, "readback_mode": {"mode": cfg.readback_mode, "source": cfg.readback_mode_source},
        "rounds": cfg.rounds, "ranks": 1, "repos": [runs.repo_state(Path(__file__).resolve().parent)],
        "packages": runs.package_versions(), "hardware": runs.hardware(device),
        "inputs": {"prompts": ses.prompt_set.sha256, "checkpoint": ses.checkpoint_hash},
        "sampling": runs.sampling_semantics(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.logprobs,
                                            cfg.train_semantics),
        **manifest_facts(cfg, ses.prompt_set),  # issue 37: what the run may claim, its model, data and reward
        "seeds": {"train": cfg.seed, "rollout": cfg.seed},
        "contract_digest": ses.digest,
        "config": {**{k: v for k, v in asdict(cfg).items() if k not in ("plan", "command", "plan_sources")},
                   "env": plan.env(), "model_config": ses.model_cfg.as_dict(), "require_exact": cfg.exact_required,
                   "max_model_len": ses.max_len, "max_batched_tokens": ses.engine.max_batched_tokens,
                   "torch_threads": torch.get_num_threads()},
    }


def _handshake(cfg: LocalRunConfig, ses: _Session, at: str) -> str:
    """The contract digest handshake of the two sides (:func:`rlk_core.digest.handshake`), each described from what
    it holds: its ops' plan and side, the sampling its requests / training step apply, its log-prob semantics."""
    from rlk_core.digest import handshake, side_document

    roll, train = ses.engine, ses.trainer
    sides = {}
    for side, holder, recorder, s, temperature, semantics in (
            ("train", train, ses.recorders[0], train.sampling, train.temperature, cfg.train_semantics),
            ("rollout", roll, ses.recorders[1], sampling_params(cfg), sampling_params(cfg).temperature,
             cfg.logprobs)):
        doc, detail = side_document(holder.ops.plan, holder.ops.side, holder.device.type, temperature=temperature,
                                    top_k=s.top_k, top_p=s.top_p, min_p=s.min_p, logprobs=semantics)
        sides[side] = (recorder, doc, detail)
    return handshake(sides, at, expected=ses.digest)


def sampling_params(cfg: LocalRunConfig, max_new_tokens: int = 16) -> SamplingParams:
    return SamplingParams(cfg.temperature, cfg.top_p, cfg.top_k, max_new_tokens, cfg.seed, cfg.min_p)


def _requests(cfg: LocalRunConfig, ses: _Session, rnd: int) -> tuple[list[int], list[Request]]:
    """The round's prompts (indices) and one request per sample, with per-request token limits that vary
    (in [max/2, max]) so responses end at different steps."""
    n = cfg.samples_per_prompt
    chosen = [(rnd * cfg.prompts_per_round + j) % len(ses.prompts) for j in range(cfg.prompts_per_round)]
    requests = []
    for j, pi in enumerate(chosen):
        for s in range(n):
            k = j * n + s
            limit = cfg.max_new_tokens - (k * 7 + rnd) % (cfg.max_new_tokens // 2 + 1)
            requests.append(Request(rid=rnd * 100_000 + k, prompt=list(ses.encoded[pi]),
                                    params=sampling_params(cfg, max(1, limit)),
                                    arrival_step=k // cfg.arrivals_per_step))
    return chosen, requests


def step_summary(seconds: list[float], tokens: list[int], slowest: int = 5,
                 launch: list[float] | None = None) -> dict[str, Any]:
    """A rollout's step times: ``median``, ``p90`` and ``max`` milliseconds, ``total`` seconds, and the
    ``slowest`` steps as ``[step, ms, tokens]`` — where a slow round's time went (a few long stalls, or every step
    slower); with ``launch`` (each step's host time before its first wait on the device), ``launch_median`` and
    ``rest_median`` — whether a slower round's steps were slower on the host or in the wait."""
    if not seconds:
        return {}
    ms = sorted(x * 1e3 for x in seconds)
    top = sorted(range(len(seconds)), key=lambda i: -seconds[i])[:slowest]
    out = {"steps": len(ms), "median": round(statistics.median(ms), 3),
           "p90": round(ms[min(len(ms) - 1, int(0.9 * len(ms)))], 3), "max": round(ms[-1], 3),
           "total_s": round(sum(seconds), 4),
           "slowest": [[i, round(seconds[i] * 1e3, 3), tokens[i]] for i in sorted(top)]}
    if launch is not None:
        out["launch_median"] = round(statistics.median(x * 1e3 for x in launch), 3)
        out["rest_median"] = round(statistics.median((t - x) * 1e3 for t, x in zip(seconds, launch, strict=True)), 3)
    return out


def _round(cfg: LocalRunConfig, ses: _Session, run_dir: Path, rnd: int, watch: JitWatch,
           progress: Progress) -> dict[str, Any]:
    """One round: rollout, rewards, the train recompute + update, the comparison, the weight sync; writes the
    round's train-data and metrics line (with the Triton compiles of each phase: ``watch``) and returns its
    summary row."""
    n = cfg.samples_per_prompt
    chosen, requests = _requests(cfg, ses, rnd)
    with progress.counter(sum(r.params.max_new_tokens for r in requests), f"round {rnd + 1} rollout") as bar, \
            watch.phase("rollout"), ses.tracer.side("rollout", rnd):
        stats = ses.engine.generate(requests, on_token=bar.update)

    # the stand-in reward (stand_in_reward), as the frameworks engine: graded on every token id, so it varies within a
    # group for any vocabulary and does not saturate while the policy has entropy (the byte-token rule alone is 0 for
    # every sample of a large-vocabulary random model, issue 41); the deepscaler rule for a real model (--model-path)
    rewards = [ses.prompt_set.reward(r.output, ses.prompts[chosen[i // n]].answer) for i, r in enumerate(requests)]
    adv = group_advantages(rewards, n)
    if (why := runs.no_learning_signal(rnd, adv, n, cfg.static_weights)) is not None:
        log.warning("%s", why)
        progress.note(f"warning: {why}")
    samples = [Sample(r.prompt, r.output, r.logprobs, a) for r, a in zip(requests, adv, strict=True)]
    with progress.counter(sum(len(r.prompt) + len(r.output) - 1 for r in requests), f"round {rnd + 1} train") as bar, \
            watch.phase("train"), ses.tracer.side("train", rnd):
        bar.update(0)  # shown while the step runs
        res = ses.trainer.step(samples)

    roll = [torch.tensor(r.logprobs, dtype=torch.float32) for r in requests]
    cmp = runs.compare(torch.cat(roll), torch.cat([t.cpu() for t in res.train_logprobs]))
    ses.tracer.write(run_dir)  # issue 37: kernel-trace.json once the traced round's two sides are in
    runs.write_train_data(run_dir, rnd, 0, [r.prompt for r in requests], [r.output for r in requests], roll,
                          res.train_logprobs, rewards, adv)
    with watch.phase("sync"):
        changed = ses.engine.load_weights(ses.trainer.export_weights())
    digest = _handshake(cfg, ses, f"sync {rnd + 1}")  # issue 37: both sides again, after the weight sync
    device = ses.trainer.device
    row = {
        **runs.round_metrics(rnd, cmp, rewards, res, stats.tokens, stats.generated, stats.seconds, device, changed,
                             len(requests), [r.output for r in requests], torch.cat(roll),
                             entropy_mean=statistics.fmean(h for r in requests for h in r.entropies),
                             vocab_size=ses.model_cfg.vocab_size),
        "rollout_steps": stats.steps, "batch_composition_changes": stats.composition_changes,
        "max_batch": stats.max_batch, "chunked_prompts": stats.chunked_prompts,
        "decode_steps": stats.decode_calls, "prefill_steps": stats.prefill_calls,
        "eos_finished": sum(r.finish_reason == "eos" for r in requests),
        "triton_jit": watch.take(),  # the round's JIT compiles per phase (round 0's "setup": model and engine)
        "python_gc": watch.take_gc(),  # the round's garbage collections per phase (their pauses)
        "contract_digest": digest,
        "rollout_step_ms": step_summary(stats.step_seconds, stats.step_tokens, launch=stats.step_launch_seconds),
        **runs.kept_metrics([n for r in requests for n in r.kept_sizes], ses.trainer.kept_sizes
                       if ses.trainer.processed else None),
        # issue 36: an MoE model's tokens routed to other experts by the two sides (rlk_repro.engine.routing)
        **(routing_metrics(rollout_routing(requests), res.routing) if res.routing is not None else {}),
    }
    runs.append_jsonl(run_dir / "metrics.jsonl", row)
    log.info("round %d: %d tokens compared, %d mismatches (max |diff| %.3g), reward %.3f, loss %.4g, "
             "weights changed: %s, %d steps / %d composition changes, %d chunked prompts; Triton JIT (compiled / "
             "loaded from its cache): rollout %d / %d, train %d / %d", rnd,
             cmp["element_count"], cmp["mismatch_count"], cmp["max_abs_diff"], row["reward_mean"], res.loss,
             changed, stats.steps, stats.composition_changes, stats.chunked_prompts,
             *jit_counts(row["triton_jit"], "rollout"), *jit_counts(row["triton_jit"], "train"))
    return {"round": rnd, **cmp, **{k: row[k] for k in row if k not in cmp and k != "schema"}}


def _finish(cfg: LocalRunConfig, ses: _Session, run_id: str, run_dir: Path, rounds: list[dict[str, Any]],
            all_changed: bool) -> LocalRunResult:
    """The bitwise document, the summary and the verdict."""
    plan = cfg.plan
    fallbacks = sum(1 for rec in ses.recorders for m in rec.to_dict()["modules"].values() if m["fallback"])
    bitwise, failed = runs.write_verdict(run_dir, f"{run_id}: engine local, mode {cfg.mode}, plan {plan.as_dict()}",
                                         rounds, plan, cfg.exact_required, cfg.readback_mode, fallbacks)
    return LocalRunResult(run_id, run_dir, rounds, bitwise, runs.EXIT_MISMATCH if failed else runs.EXIT_OK,
                          all_changed)
