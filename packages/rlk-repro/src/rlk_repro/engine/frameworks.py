"""``--engine frameworks``: N rounds of real vLLM rollout -> real megatron-core recompute + GRPO step ->
compare -> in-place weight update of the running vLLM.

One GPU = one process: vLLM's engine core in-process with a bounded ``gpu_memory_utilization`` and
Megatron beside it, on one default process group (NCCL) that both frameworks share. Tensor parallelism N:
``torchrun --nproc-per-node N``, every rank holding ``LLM(tensor_parallel_size=N,
distributed_executor_backend="external_launcher")`` and the Megatron model with the same TP. Rank 0 creates
the run directory and writes the manifest, train-data, metrics and bitwise report (one data-parallel rank:
the TP ranks hold the same log-probs); a Qwen3-MoE model (TP 1) adds each round's routing diagnostic (tokens the
two sides sent to another expert set, ``rlk_repro.engine.routing``); every process writes its two readbacks
(``vllm-rollout-<pid>.json`` from the plugin, ``megatron-train-<pid>.json`` from the provider). The artifacts are the
local engine's, so ``rlk-validate RUN --require-bitwise`` checks such a run unchanged.

With ``--state-every N`` (TP 1; default 0 here: a large model's state is 12 bytes a parameter) rank 0 saves the round
state every N rounds (:mod:`rlk_repro.resume`: the Megatron trainer's fp32 masters and AdamW state, the process's RNG
streams), and ``run --resume RUN_DIR`` continues an interrupted run from it in a new attempt: Megatron built, the state
loaded, vLLM started and given the state's weights by the ordinary weight sync, the RNG streams put back, then the
remaining rounds.
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from rlk_core.errors import RlkConfigError
from rlk_repro import lifecycle, runs
from rlk_repro.engine.local import DTYPES, LocalRunConfig, LocalRunResult, load_model, sampling_params
from rlk_repro.engine.prompts import load_prompt_set, manifest_facts
from rlk_repro.engine.routing import routing_metrics
from rlk_repro.engine.trainer import Sample, group_advantages
from rlk_repro.jitwatch import JitWatch
from rlk_repro.jitwatch import counts as jit_counts
from rlk_repro.model.config import preset
from rlk_repro.progress import Progress
from rlk_repro.resume import STATE_DIR, STATE_DOC, Parent, inherit, write_state
from rlk_repro.trace import Tracer
from rlk_validate import evidence

log = logging.getLogger("rlk_repro")


@dataclass
class FrameworksRunConfig(LocalRunConfig):
    tp: int = 1
    gpu_memory_utilization: float = 0.3
    enforce_eager: bool = False
    train_micro_tokens: int = 8192
    vllm_max_num_seqs: int = 256
    vllm_max_num_batched_tokens: int = 8192
    cuda_graph_decode: bool = False  # issue 37: FULL_DECODE_ONLY graphs of sizes 1..prompts x samples
    # the parallel layout (rlk_repro.tp_options): what `plan` checks and prints; run takes train_tp == rollout_tp
    train_tp: int = 1
    rollout_tp: int = 1
    sequence_parallel: bool = False
    context_parallel: int = 1
    tp_invariant: int = 0  # G of RL_KERNEL_TP_INVARIANT (0: off)
    tp_invariant_source: str = "default (off)"
    train_tp_emulated: str = ""  # "on" / "bi-control": --train-tp emulated in this process (RL_KERNEL_TP_EMULATE)
    rollout_quantization: str = "none"  # issue 38: "fp8" = vLLM's FP8 W8A8 rollout (rlk_repro.engine.fp8)
    state_every: int = 0  # round state every N rounds (TP 1): off by default, 12 bytes a parameter (the CLI's default)

    @property
    def cuda_graphs(self) -> dict[str, Any] | None:
        """The CUDA-graph profile vLLM is asked for (the manifest's ``config.cuda_graphs``; rlk_validate.cuda_graphs
        checks the readbacks against it), or None: vLLM's default."""
        if not self.cuda_graph_decode:
            return None
        return {"cudagraph_mode": "FULL_DECODE_ONLY",
                "capture_sizes": list(range(1, self.prompts_per_round * self.samples_per_prompt + 1))}

    def validate(self) -> None:
        super().validate()
        from rlk_repro import tp_options

        tp_options.check(self)
        if self.cuda_graph_decode and self.enforce_eager:
            raise RlkConfigError("--cuda-graph-decode asks for CUDA graphs, --enforce-eager for none")
        if not 0 < self.gpu_memory_utilization < 1:
            raise RlkConfigError(f"gpu-memory-utilization must be in (0, 1), got {self.gpu_memory_utilization}")
        for name in ("tp", "train_micro_tokens", "vllm_max_num_seqs", "vllm_max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise RlkConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        filtered = self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0
        if filtered and self.logprobs == "unfiltered" and not self.plan.uses_rlk("logp", "rollout"):
            raise RlkConfigError("--logprobs unfiltered with filters needs rlk on vLLM's logp (R): vLLM's own "
                                 "processed log-probs are over the kept set")
        if not self.device.startswith("cuda"):
            raise RlkConfigError(f"--engine frameworks runs on cuda, not {self.device!r}")
        if self.static_weights:
            raise RlkConfigError("--static-weights is an option of the local engine")
        if self.state_every and self.tp != 1:
            raise RlkConfigError(f"--state-every: the frameworks engine saves round state at --tp 1, not --tp "
                                 f"{self.tp} (each rank's masters and optimizer state are not gathered); use "
                                 "--state-every 0")
        if self.dtype != "bfloat16":
            raise RlkConfigError(f"--engine frameworks runs bfloat16 (vLLM and Megatron), not {self.dtype}")
        from rlk_repro.engine.fp8 import config_problem  # issue 38

        rollout = {m: c.split("/")[1] for m, c in self.plan.as_dict().items()}
        problem = config_problem(self.rollout_quantization, rollout, self.cuda_graph_decode)
        if problem:
            raise RlkConfigError(problem)
        if self.checkpoint is None and self.model_path is None and preset(self.model).is_moe and self.tp != 1:
            raise RlkConfigError(f"--model {self.model}: the frameworks engine runs a Qwen3-MoE model at TP 1, not "
                                 f"--tp {self.tp} (issue 36: expert / tensor parallelism on GPUs is not covered yet)")


def contract_handshake(cfg: FrameworksRunConfig, device_type: str, train: tuple[Any, Any, int | None],
                       rollout: tuple[Any, Any, int | None], train_temperature: float, train_sampling: Any, at: str,
                       expected: str | None = None) -> str:
    """The frameworks run's contract digest handshake (:func:`rlk_core.digest.handshake`): ``train`` and ``rollout``
    are each side's ``(plan, recorder, TP-invariant leaves or None: RL_KERNEL_TP_INVARIANT)`` as the Megatron
    provider and the vLLM plugin hold them; the trainer's temperature and sampling filters, and the ones this run
    asks vLLM for (``cfg``). Returns the digest both sides agreed on; raises ContractDigestError otherwise."""
    from rlk_core.digest import handshake, side_document

    sides = {}
    for side, (plan, recorder, leaves), temperature, s, semantics in (
            ("train", train, train_temperature, train_sampling, cfg.train_semantics),
            ("rollout", rollout, cfg.temperature, sampling_params(cfg), cfg.logprobs)):
        doc, detail = side_document(plan, side, device_type, temperature=temperature, top_k=s.top_k, top_p=s.top_p,
                                    min_p=s.min_p, logprobs=semantics, tp_leaves=leaves)
        sides[side] = (recorder, doc, detail)
    return handshake(sides, at, expected=expected)


def requirements(tp: int = 1) -> str | None:
    """What this machine lacks for ``--engine frameworks``, as one sentence; ``None`` when nothing. Imports
    neither vLLM nor megatron-core (``find_spec`` only), creates nothing."""
    missing = []
    if not torch.cuda.is_available():
        missing.append(f"a CUDA GPU (torch {torch.__version__} sees none)")
    elif torch.cuda.device_count() < 1:
        missing.append("a visible CUDA device")
    for mod, what in (("vllm", "vLLM 0.22+ (`import vllm`)"), ("megatron.core", "megatron-core 0.16+"),
                      ("rlk_vllm_plugin", "rlk-vllm-plugin"), ("rlk_megatron_provider", "rlk-megatron-provider")):
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(what)
    if not any(e.name == "rlk" and e.value.startswith("rlk_vllm_plugin")
               for e in md.entry_points(group="vllm.general_plugins")):
        missing.append("rlk-vllm-plugin's entry point (vllm.general_plugins: rlk = rlk_vllm_plugin:register; "
                       "pip install it, or put its dist-info on PYTHONPATH)")
    plugins = os.environ.get("VLLM_PLUGINS")
    if plugins is not None and "rlk" not in plugins.split(","):
        missing.append(f"VLLM_PLUGINS to include rlk (it is {plugins!r})")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp > 1 and world != tp:
        missing.append(f"a torchrun launch with one process per TP rank (--tp {tp}: "
                       f"`torchrun --nproc-per-node {tp} -m rlk_repro run ...`; WORLD_SIZE is {world})")
    if tp == 1 and world != 1:
        missing.append(f"--tp {world} to match WORLD_SIZE={world} (data parallelism is not covered)")
    if not missing:
        return None
    return "--engine frameworks needs " + "; ".join(missing)


def state_problem(parent: Parent, state: dict[str, Any]) -> str | None:
    """Why ``state`` (``parent``'s round state, :meth:`Parent.peek_state` or :meth:`Parent.load_state`) is not one a
    frameworks run continues from, as one line; None when it is: a TP-1 frameworks state for the round its document
    names, with masters, optimizer state and RNG streams."""
    got = {k: state.get(k) for k in ("engine", "tp", "next_round")}
    if got != {"engine": "frameworks", "tp": 1, "next_round": parent.next_round} or \
            not {"master", "optimizer", "rng"} <= set(state):
        return (f"--resume {parent.path}: its {STATE_DIR} is not a TP-1 frameworks state for round "
                f"{parent.next_round} (engine {got['engine']!r}, tp {got['tp']!r}, next_round {got['next_round']!r}, "
                f"holding {sorted(state)})")
    return None


def round_requests(cfg: FrameworksRunConfig, num_prompts: int, rnd: int) -> tuple[list[int], list[int], list[int]]:
    """Round ``rnd``'s prompt indices, one seed per prompt (vLLM gives sample ``i`` seed + i) and per-prompt token
    limits in [max/2, max], so responses differ in length (the run's, and the attribution's replay of it)."""
    chosen = [(rnd * cfg.prompts_per_round + j) % num_prompts for j in range(cfg.prompts_per_round)]
    seeds = [cfg.seed * 7919 + rnd * 1_000_003 + j * 1009 for j in range(len(chosen))]
    limits = [max(1, cfg.max_new_tokens - (j * 7 + rnd) % (cfg.max_new_tokens // 2 + 1))
              for j in range(len(chosen))]
    return chosen, seeds, limits


# -- process group and run directory ---------------------------------------------------------------------
def _init_world(cfg: FrameworksRunConfig) -> tuple[int, int, torch.device]:
    import torch.distributed as dist

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group("nccl", init_method="env://")
        else:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def _shared_run(output, run_name: str | None, rank: int, command: list[str]) -> runs.Run | SimpleNamespace:
    """Rank 0 creates the run directory (:func:`rlk_repro.runs.begin_run`: lock, run.log); every rank learns its
    id and path (the others get a plain namespace: they only add their readbacks to it)."""
    import torch.distributed as dist

    run: runs.Run | SimpleNamespace | None = None
    box: list[Any] = [None, None]
    if rank == 0:
        run = runs.begin_run(output, run_name, command)
        box = [run.run_id, str(run.path)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return run if run is not None else SimpleNamespace(run_id=box[0], path=Path(box[1]))


def _set_env(cfg: FrameworksRunConfig, run_id: str, run_dir: Path) -> None:
    """The routes and evidence settings both adapters read from the environment (before either starts)."""
    from rlk_repro.engine.frameworks_vllm import VLLM_ENV

    os.environ.update(cfg.plan.env())
    os.environ["RL_KERNEL_MODE"] = cfg.readback_mode
    os.environ["RL_KERNEL_READBACK_DIR"] = str(run_dir / evidence.READBACKS_DIR)
    os.environ["RL_KERNEL_RUN_ID"] = run_id
    for k, v in VLLM_ENV.items():
        os.environ.setdefault(k, v)


# -- the run ---------------------------------------------------------------------------------------------
def run_frameworks(cfg: FrameworksRunConfig, output: str | os.PathLike[str], run_name: str | None = None,
                   progress: Progress | None = None, resume: Parent | None = None) -> LocalRunResult:
    """The run (a new directory under ``output``); ``resume``: the interrupted frameworks run this new attempt
    continues from its round state (:mod:`rlk_repro.resume`)."""
    from rlk_repro import tp_options

    cfg.validate()
    problem = requirements(cfg.tp) or tp_options.engine_problem(cfg)
    if problem:
        raise RlkConfigError(problem)
    tp_options.apply_environment(cfg)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast off (the device machines' rule)
    rank, world, device = _init_world(cfg)
    run = _shared_run(output, run_name, rank, cfg.command)
    run_id, run_dir = run.run_id, run.path
    progress = (progress or Progress()) if rank == 0 else Progress(enabled=False)  # rank 0 shows it
    if rank == 0:
        progress.note(f"run directory {run_dir}")
    code, failure = runs.EXIT_FAILED, None
    scratch = Path(tempfile.mkdtemp(prefix="rlk-frameworks-"))
    try:
        _set_env(cfg, run_id, run_dir)
        result = _Run(cfg, run_id, run_dir, rank, world, device, scratch, progress, resume).go()
        code = result.exit_code
        return result
    except BaseException as exc:
        code, failure = runs.exit_code_for(exc), exc
        log.error("run %s: %s: %s", runs.ended_how(code), type(exc).__name__, exc)
        if rank == 0 and (run_dir / STATE_DIR / STATE_DOC).is_file():
            progress.note(f"continue this run with: rlk-repro run --resume {run_dir}")
        raise
    finally:
        _flush_readbacks()
        if isinstance(run, runs.Run):
            runs.end_run(run, code, failure)
        shutil.rmtree(scratch, ignore_errors=True)


def _flush_readbacks() -> None:
    try:
        from rlk_vllm_plugin import _runtime

        rt = _runtime.current()
        if rt is not None:
            rt.flush()
    except Exception as exc:
        log.error("vLLM readback flush failed: %s: %s", type(exc).__name__, exc)
    try:
        from rlk_megatron_provider import _state

        if _state.current() is not None:
            _state.get().recorder.flush()
    except Exception as exc:
        log.error("Megatron readback flush failed: %s: %s", type(exc).__name__, exc)


class _Run:
    def __init__(self, cfg: FrameworksRunConfig, run_id: str, run_dir: Path, rank: int, world: int,
                 device: torch.device, scratch: Path, progress: Progress, resume: Parent | None = None) -> None:
        self.cfg, self.run_id, self.run_dir, self.rank, self.world = cfg, run_id, run_dir, rank, world
        self.device, self.scratch, self.progress, self.resume = device, scratch, progress, resume
        self.lead = rank == 0

    def go(self) -> LocalRunResult:
        cfg = self.cfg
        log.info("run %s: engine frameworks, mode %s, plan %s, TP %d, device %s", self.run_id, cfg.mode,
                 cfg.plan.as_dict(), cfg.tp, self.device)
        self.watch = JitWatch()  # vLLM runs in this process too (VLLM_ENABLE_V1_MULTIPROCESSING=0): both sides seen
        try:
            return self._go()
        finally:
            self.watch.close()

    def _go(self) -> LocalRunResult:
        from rlk_repro import tp_options
        from rlk_repro.engine.frameworks_megatron import MegatronTrainer, init_model_parallel, set_rng_state
        from rlk_repro.engine.frameworks_vllm import VllmRollout, write_model_dir

        cfg = self.cfg
        state = self._resume_state()  # before anything is built: a state of another engine or TP stops here
        torch.manual_seed(cfg.seed)
        self.model_cfg, weights, self.ckpt_hash = load_model(cfg)
        # issue 37: the model's tokenizer, prompt data, chat template, stop tokens and reward (--model-path ...), or
        # the bundled prompts as byte tokens and the stand-in reward (stand_in_reward), as the local engine; load_model
        # sets a default --lr from the model's width (default_lr)
        self.ps = load_prompt_set(cfg, self.model_cfg)
        self.prompts, self.encoded = self.ps.prompts, self.ps.encoded
        self.max_len = max(len(e) for e in self.encoded) + cfg.max_new_tokens
        if cfg.logprobs == "unfiltered":  # the plugin returns log softmax(z) over the whole vocabulary (logp R)
            os.environ["RL_KERNEL_VLLM_UNFILTERED_LOGPROBS"] = "1"
        self.progress.line(f"starting vLLM (TP {cfg.tp}, gpu_memory_utilization {cfg.gpu_memory_utilization}, "
                  f"{'eager' if cfg.enforce_eager else 'CUDA graphs'})")
        self.vllm = VllmRollout(write_model_dir(self.scratch / "model", self.model_cfg), dtype=cfg.dtype,
                                seed=cfg.seed, tp=cfg.tp, max_model_len=self.max_len + 16,
                                gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
                                cuda_graphs=cfg.cuda_graphs,
                                attention_r=cfg.plan.uses_rlk("attention", "rollout"),
                                max_num_seqs=cfg.vllm_max_num_seqs,
                                max_num_batched_tokens=cfg.vllm_max_num_batched_tokens,
                                routed_experts=self.model_cfg.is_moe,
                                quantization=cfg.rollout_quantization)
        self.progress.line(f"vLLM ready in {self.vllm.start_seconds:.0f} s; building Megatron")
        init_model_parallel(cfg.tp, cfg.seed)
        self.trainer = MegatronTrainer(self.model_cfg, weights, tp=cfg.tp, rank=self.rank, device=self.device,
                                       dtype=DTYPES[cfg.dtype], temperature=cfg.temperature,
                                       optimizer=cfg.optimizer, lr=cfg.lr, micro_tokens=cfg.train_micro_tokens,
                                       sampling=sampling_params(cfg), processed=cfg.train_semantics == "processed",
                                       pad_tokens_to=tp_options.token_multiple(cfg))
        if self.model_cfg.is_moe and cfg.tp != 1:
            raise RlkConfigError(f"a Qwen3-MoE model runs at TP 1 in the frameworks engine, not --tp {cfg.tp}")
        del weights
        if state is not None:  # the masters and optimizer of the parent's last state; vLLM gets them by the sync below
            self.trainer.load_round_state(state)
        self.initial_sync = self.vllm.load_weights(self.trainer.hf_weights())
        self.digest = None
        self.digest = self._handshake("start")  # issue 37: before anything is compared
        self.progress.line(f"Megatron ready (rlk layers {self.trainer.layer_counts}); initial weights loaded into vLLM "
                  f"({self.initial_sync['loaded']} of {self.initial_sync['parameters']} parameters)")
        manifest = self._manifest() if self.lead else None
        first, rounds = 0, []
        if self.resume is not None:  # the parent's rounds before its state, then this attempt's from there
            first, rounds = self.resume.next_round, self.resume.rows()
            if self.lead:
                manifest["resume"] = inherit(self.run_dir, self.resume)
            log.info("run %s: resumes %s at round %d", self.run_id, self.resume.path, first)
        if self.lead:
            runs.write_json_atomic(self.run_dir / "manifest.json", manifest)
        self.tracer = Tracer(cfg.trace and self.lead, str(self.device), cfg.tp)  # issue 37: run --trace (rank 0)
        self.clock = self.progress.rounds(cfg.rounds, first)
        if state is not None:  # the RNG streams as the parent left them after round first - 1
            set_rng_state(state["rng"], self.device)
        for rnd in range(first, cfg.rounds):
            rounds.append(self._round(rnd))
            if cfg.state_every and (rnd + 1) % cfg.state_every == 0 and rnd + 1 < cfg.rounds:
                self._save_state(rnd + 1)
        return self._finish(rounds)

    def _resume_state(self) -> dict[str, Any] | None:
        """The parent's round state (checked against its recorded hash), or None for a new run."""
        if self.resume is None:
            return None
        state = self.resume.load_state()
        problem = state_problem(self.resume, state)
        if problem:
            raise RlkConfigError(problem)
        return state

    def _save_state(self, next_round: int) -> None:
        """Rank 0's round state (TP 1: the one rank holds the whole model): the trainer's masters and optimizer
        state and the process's RNG streams, after round ``next_round - 1``'s weight sync."""
        from rlk_repro.engine.frameworks_megatron import rng_state

        if self.lead:
            write_state(self.run_dir, next_round, {"engine": "frameworks", "tp": self.cfg.tp,
                                                   **self.trainer.round_state(), "rng": rng_state(self.device)})

    def _manifest(self) -> dict[str, Any]:
        from rlk_repro import tp_options

        cfg, plan = self.cfg, self.cfg.plan
        packages = runs.package_versions()
        for name in ("vllm", "megatron-core", "rlk-vllm-plugin", "rlk-megatron-provider", "rlk-collectives"):
            try:
                packages[name] = md.version(name)
            except md.PackageNotFoundError:
                packages[name] = "not installed"
        try:
            import vllm

            packages["vllm"] = vllm.__version__
        except Exception:
            pass
        try:
            from rlk_megatron_provider import _compat

            packages["megatron-core"] = _compat.version()
        except Exception:
            pass
        return {
            "schema": evidence.MANIFEST_SCHEMA, "run_id": self.run_id, "created_at": lifecycle.utc_now(),
            "engine": "frameworks", "mode": cfg.mode, "command": [str(c) for c in cfg.command],
            "plan": plan.as_dict(), "plan_sources": {m: cfg.plan_sources.get(m, "config") for m in plan.as_dict()},
            "readback_mode": {"mode": cfg.readback_mode, "source": cfg.readback_mode_source},
            "rounds": cfg.rounds, "ranks": 1, "repos": [runs.repo_state(Path(__file__).resolve().parent)],
            "packages": packages, "hardware": runs.hardware(self.device),
            "inputs": {"prompts": self.ps.sha256, "checkpoint": self.ckpt_hash},
            "sampling": runs.sampling_semantics(cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p, cfg.logprobs,
                                                cfg.train_semantics),
            "seeds": {"train": cfg.seed, "rollout": cfg.seed},
            "contract_digest": self.digest,
            "rollout_quantization": cfg.rollout_quantization,  # issue 38: fp8 is a mismatch knob, never bitwise
            "config": {**{k: v for k, v in asdict(cfg).items() if k not in ("plan", "command", "plan_sources")},
                       "env": plan.env(), "model_config": self.model_cfg.as_dict(),
                       "require_exact": cfg.exact_required, "max_model_len": self.max_len + 16,
                       "world_size": self.world, "tensor_parallel": cfg.tp, "reward": self.ps.rm_type,
                       "cuda_graphs": cfg.cuda_graphs},  # issue 37: what rlk-validate holds the readbacks to
            **manifest_facts(cfg, self.ps),  # issue 37: what the run may claim, its model, data and reward
            "parallel": tp_options.section(cfg, None),  # issue 35: the layout; train_tp_emulated where emulated
            # what the engines reported at start-up: follows from the routes (attention backend, rlk layers,
            # THD vs padded) or is a measurement (start time), so a matrix does not compare it across cells
            "runtime": {"vllm": self.vllm.info(), "megatron_rlk_layers": self.trainer.layer_counts,
                        "train_layout": "thd" if self.trainer.r_attention else "sbhd (padded; P attention)",
                        **({"megatron_experts": self.trainer.experts,
                            "vllm_routing_record": "rlk_vllm_plugin.moe (Model Runner V2)"}
                           if self.model_cfg.is_moe else {}),
                        "initial_weight_sync": self.initial_sync},
        }

    def _requests(self, rnd: int) -> tuple[list[int], list[int], list[int]]:
        return round_requests(self.cfg, len(self.prompts), rnd)

    def _round(self, rnd: int) -> dict[str, Any]:
        cfg, n = self.cfg, self.cfg.samples_per_prompt
        chosen, seeds, limits = self._requests(rnd)
        with self.watch.phase("rollout"), self.tracer.side("rollout", rnd):
            roll = self.vllm.generate([self.encoded[i] for i in chosen], seeds, limits, n, cfg.temperature,
                                      cfg.top_p, cfg.top_k, cfg.min_p, stop_token_ids=self.ps.stop_token_ids)
        comps = roll.completions
        rewards = [self.ps.reward(c.tokens, self.prompts[chosen[c.prompt_index]].answer) for c in comps]
        adv = group_advantages(rewards, n)
        if self.lead and (why := runs.no_learning_signal(rnd, adv, n, False)) is not None:
            log.warning("%s", why)
            self.progress.note(f"warning: {why}")
        samples = [Sample(list(self.encoded[chosen[c.prompt_index]]), c.tokens, c.logprobs, a)
                   for c, a in zip(comps, adv, strict=True)]
        with self.watch.phase("train"), self.tracer.side("train", rnd):
            res = self.trainer.step(samples)
        self.tracer.write(self.run_dir)
        roll_lp = [torch.tensor(c.logprobs, dtype=torch.float32) for c in comps]
        cmp = runs.compare(torch.cat(roll_lp), torch.cat(res.train_logprobs))
        if self.lead:
            runs.write_train_data(self.run_dir, rnd, 0, [s.prompt for s in samples], [c.tokens for c in comps],
                                  roll_lp, res.train_logprobs, rewards, adv)
        with self.watch.phase("sync"):
            sync = self.vllm.load_weights(self.trainer.hf_weights())
        changed = sync["changed"] > 0
        digest = self._handshake(f"sync {rnd + 1}")  # issue 37: both sides again, after the weight sync
        row = {
            **runs.round_metrics(rnd, cmp, rewards, res, roll.prompt_tokens + roll.generated, roll.generated,
                                 roll.seconds, self.device, changed, len(comps), [c.tokens for c in comps],
                                 torch.cat(roll_lp), vocab_size=self.model_cfg.vocab_size),
            "weight_sync_seconds": sync["seconds"], "vllm_parameters_changed": sync["changed"],
            "eos_finished": sum(c.finish_reason == "stop" for c in comps),
            # issue 36: an MoE model's tokens the two sides routed to another expert set (rlk_repro.engine.routing)
            **(routing_metrics([c.routing for c in comps], res.routing) if res.routing is not None else {}),
            "contract_digest": digest,
            "triton_jit": self.watch.take(),  # this rank's JIT compiles per phase (round 0's "setup": start-up)
            "python_gc": self.watch.take_gc(),  # this process's garbage collections per phase (their pauses)
            # the trainer's kept sets (it finds them from its own logits; vLLM does not report its own)
            **runs.kept_metrics([int(x) for t in self.trainer.kept_sizes for x in t.tolist()], None),
        }
        if self.lead:
            runs.append_jsonl(self.run_dir / "metrics.jsonl", row)
        log.info("round %d: %d tokens compared, %d mismatches (max |diff| %.3g), reward %.3f, loss %.4g, "
                 "vLLM parameters changed: %d%s", rnd, cmp["element_count"], cmp["mismatch_count"],
                 cmp["max_abs_diff"], row["reward_mean"], res.loss, sync["changed"],
                 f"; routing differs for {row['routing_mismatch_tokens']} of {row['routing_compared_tokens']} tokens"
                 if "routing_compared_tokens" in row else "")
        self.progress.line(
            f"{self.clock.text(rnd, row)}; weight sync {sync['seconds']:.1f} s, vLLM parameters changed "
            f"{sync['changed']}; Triton JIT compiled / loaded: rollout "
            f"{'{} / {}'.format(*jit_counts(row['triton_jit'], 'rollout'))}, train "
            f"{'{} / {}'.format(*jit_counts(row['triton_jit'], 'train'))}")
        return {"round": rnd, **cmp, **{k: row[k] for k in row if k not in cmp and k != "schema"}}

    def _handshake(self, at: str) -> str:
        """The contract digest handshake of the Megatron provider's and the vLLM plugin's sides in this process."""
        from rlk_core.digest import ContractDigestError
        from rlk_megatron_provider import _state
        from rlk_vllm_plugin import _runtime

        st, rt = _state.get(), _runtime.current()
        if rt is None:
            raise ContractDigestError(f"contract digest handshake at {at}: the vLLM plugin has no runtime in this "
                                      "process, so the rollout side cannot say what it runs; stopped")
        return contract_handshake(self.cfg, self.device.type, (st.plan, st.recorder, None),
                                  (rt.plan, rt.recorder, rt.tp_leaves), self.trainer.temperature,
                                  self.trainer.sampling, at, self.digest)

    def _fallbacks(self) -> int:
        from rlk_megatron_provider import _state
        from rlk_vllm_plugin import _runtime

        docs = [_state.get().recorder.to_dict()]
        rt = _runtime.current()
        if rt is not None:
            docs.append(rt.recorder.to_dict())
        return sum(1 for d in docs for m in d["modules"].values() if m.get("fallback"))

    def _finish(self, rounds: list[dict[str, Any]]) -> LocalRunResult:
        cfg, plan = self.cfg, self.cfg.plan
        fallbacks = self._fallbacks()
        bitwise, failed = runs.write_verdict(
            self.run_dir if self.lead else None,
            f"{self.run_id}: engine frameworks, mode {cfg.mode}, plan {plan.as_dict()}, TP {cfg.tp}",
            rounds, plan, cfg.exact_required, cfg.readback_mode, fallbacks)
        self.vllm.shutdown()
        return LocalRunResult(self.run_id, self.run_dir, rounds, bitwise,
                              runs.EXIT_MISMATCH if failed else runs.EXIT_OK,
                              all(r["weights_changed"] for r in rounds))
