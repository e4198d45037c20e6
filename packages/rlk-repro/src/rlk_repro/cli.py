"""``rlk-repro``: command line.

``rlk-repro run --engine local`` runs the embedded experiment and writes a new run directory under
``--output``. Exit codes: 0 done (and, for an exact run, bitwise equal); 1 an exact (all R/R, strict)
run found mismatches or fallbacks; 2 bad arguments or configuration; 3 the run failed (see run.log).

``rlk-repro matrix`` runs the operator ablation matrix (``control-RR``, each module at ``P/R``, ``R/P``
and ``P/P`` with the others ``R/R``, and ``native-PP``) as cell directories of one matrix root, then
checks it with ``rlk-validate matrix``; ``--resume ROOT`` runs only the cells that have not finished.
Exit codes: 0 the matrix validates; 1 it does not (a cell failed or is incomplete); 2 and 3 as for run.

``rlk-repro report RUN_DIR [RUN_DIR ...]`` writes plots and a summary table of the runs' metrics.
``rlk-repro doctor`` says whether this machine is ready for the requested routes (exit 1 if not);
``rlk-repro plan`` prints what ``run`` would do with the same options, and runs nothing.
Errors are one line on stderr, never a traceback (``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from rlk_core.errors import RlkConfigError, RlkError
from rlk_repro._args import positive_int
from rlk_repro.progress import Progress

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, no usage dump
        raise _Usage(f"{self.prog}: {message}")


class _Usage(Exception):
    pass


def _case(value: str) -> str:
    """The spelling rule of ``RL_KERNEL_<MODULE>_CASE`` (:func:`rlk_core.envs.parse_case`), for the flags."""
    from rlk_core.envs import parse_case

    try:
        return parse_case(value, "case")
    except RlkConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("case=")) from None


def build_parser() -> argparse.ArgumentParser:
    from rlk_repro import __version__

    p = _Parser(prog="rlk-repro", description="Train/rollout numerical-consistency experiments (rlk).")
    p.add_argument("--version", action="version", version=f"rlk-repro {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    r = sub.add_parser("run", help="run rounds of rollout -> train -> compare -> update and write a run directory",
                       description="Run the experiment; a new run directory is created under --output.")
    r.add_argument("--engine", choices=("local", "frameworks", "vime"), default="local",
                   help="local: the embedded Qwen3 rollout engine + trainer on this machine (default); frameworks: "
                   "real vLLM + real megatron-core with rlk's adapters on CUDA GPUs (docs/frameworks.md); vime: "
                   "launched on your cluster with the command `rlk-repro plan --engine vime` prints")
    _plan_options(r)
    r.add_argument("--output", default="rlk-runs", help="directory under which the run directory is created (rlk-runs; "
                   "not with --resume, whose attempt goes beside the resumed run)")
    r.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue an interrupted local or frameworks run in a new attempt directory beside it, from "
                   "its last round state, with its recorded options (a conflicting option exits 2); RUN_DIR is not "
                   "written")
    _experiment_options(r)
    from rlk_repro import pd_options  # issue 37: the Prefill/Decode split (run and plan only)

    pd_options.add_options(r)
    pl = sub.add_parser("plan", help="print the resolved plan, environment and configuration of a run; runs nothing",
                        description="Resolve the options of `rlk-repro run` and print them as JSON (plan, the "
                        "RL_KERNEL_* variables that select it, the full configuration); nothing is run or written.")
    pl.add_argument("--engine", choices=("local", "frameworks", "vime"), default="local",
                    help="local (default) or frameworks: the run as JSON; vime: the launch of a VIME/slime cluster "
                    "run (a shell script, or --json; its own options: `rlk-repro plan --engine vime --help`)")
    _plan_options(pl)
    _experiment_options(pl)
    pd_options.add_options(pl)
    m = sub.add_parser("matrix", help="run the operator ablation matrix and check it with rlk-validate matrix",
                       description="Run every cell of the ablation matrix into one new matrix root under --output "
                       "(or finish an interrupted one with --resume), then validate it.")
    m.add_argument("--output", default="rlk-runs", help="directory under which the matrix root is created (rlk-runs)")
    m.add_argument("--resume", metavar="ROOT", help="an existing matrix root: run only its unfinished cells")
    m.add_argument("--cells", default=None, metavar="A,B,...",
                   help="cells to run (default: control-RR, the 9 isolation cells and native-PP)")
    m.add_argument("--engine", choices=("local", "frameworks"), default="local",
                   help="local (default) or frameworks (each cell a `rlk-repro run --engine frameworks` process)")
    _experiment_options(m)
    d = sub.add_parser("doctor", help="check that this machine is ready for the requested routes",
                       description="Device, Triton, environment variables, the backend each op would run, "
                       "rlk-validate and plotting; --selfcheck adds the op contract checks on the device.")
    d.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    d.add_argument("--engine", choices=("local", "frameworks", "vime"), default="local",
                   help="the engine to check for: frameworks / vime require vLLM, megatron-core and the plugin in "
                   "their supported ranges (FAIL otherwise); local reports them (default local)")
    _plan_options(d)
    d.add_argument("--selfcheck", action="store_true",
                   help="also run rlk-selfcheck's contract checks on the device (about 10 s on a 2-core CPU)")
    d.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    d.add_argument("--workspace", metavar="W", default=None,  # issue 37
                   help="also check a prepared workspace: its recorded layout, data, manifests and checkpoint")
    d.add_argument("--pd", action="store_true", help="also check what a Prefill/Decode split needs (issue 37)")
    d.add_argument("--pd-connector", choices=tuple(pd_options.CONNECTORS), default=pd_options.RLK_CONNECTOR,
                   help="the split's KV-transfer connector (rlk-shared-storage)")
    d.add_argument("--debug", action="store_true", help="show tracebacks")
    rp = sub.add_parser("report", help="plots and a summary table of run directories and matrix roots",
                        description="consistency.png, learning.png, optimization.png, performance.png and "
                        "metrics-summary.md/.json for the given runs (e.g. a native and a consistency run); a matrix "
                        "root stands for its cells, side by side, and adds matrix.png.")
    rp.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                    help="run directories and/or matrix roots (rlk-repro matrix's output)")
    rp.add_argument("--output", default=None,
                    help="where to write (default: the report/ folder of a single run directory or matrix root)")
    rp.add_argument("--debug", action="store_true", help="show tracebacks")
    # issue 37: prepare (rlk_repro.prepare_cli)
    from rlk_repro import prepare_cli

    prepare_cli.add_parser(sub)
    from rlk_repro import attribute_cli  # issue 38: attribute, abtest (each sets its own `main`)

    attribute_cli.add_parser(sub)
    from rlk_repro import ladder_cli  # issue 38: the mismatch-knob ladder

    ladder_cli.add_parser(sub, _experiment_options)
    from rlk_repro import learn_cli  # issue 37: synthetic-math, warmstart (each sets its own `main`)

    learn_cli.add_parser(sub)
    return p


def _plan_options(r: argparse.ArgumentParser) -> None:
    r.add_argument("--mode", choices=("native", "consistency"), default=None,
                   help="native = all P/P, consistency = all R/R (default: consistency); RL_KERNEL_<MODULE>_CASE "
                   "and the per-module flags override it")
    from rlk_core.envs import CASE_VARS

    for module, var in CASE_VARS.items():
        r.add_argument(f"--{module}-case", type=_case, default=None, metavar="X/Y",
                       help=f"{module} case, train/rollout, each P (production) or R (rlk); overrides {var}, "
                       "which overrides --mode")


def _experiment_options(r: argparse.ArgumentParser) -> None:
    """The options of one experiment (model, rollout, training), shared by ``run`` and ``matrix``."""
    r.add_argument("--rounds", type=positive_int, default=5, help="rounds (rollout steps) to run (5)")
    r.add_argument("--seed", type=int, default=1234, help="seed of the checkpoint, sampling and training (1234)")
    r.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cpu; cuda for --engine frameworks)")
    r.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="compute dtype (default: float32 on cpu, bfloat16 on cuda)")
    from rlk_repro.model.config import MOE_30B_A3B_PREFIX, PRESETS, preset_name

    r.add_argument("--model", type=preset_name, default="tiny", metavar="PRESET",
                   help=f"model shape preset with random weights: {', '.join(PRESETS)} or "
                   f"{MOE_30B_A3B_PREFIX}<layers> (Qwen3-30B-A3B's layer shape; local engine) (tiny)")
    r.add_argument("--checkpoint", metavar="DIR",
                   help="Hugging Face Qwen3 directory (config.json + safetensors); overrides --model")
    r.add_argument("--prompts-per-round", type=positive_int, default=4, help="prompts (GRPO groups) per round (4)")
    r.add_argument("--samples-per-prompt", type=positive_int, default=4,
                   help="samples per prompt, the GRPO group size (4)")
    r.add_argument("--max-new-tokens", type=positive_int, default=16, help="response token limit (16)")
    r.add_argument("--chunk-size", type=positive_int, default=16,
                   help="chunked-prefill chunk size per request and step (16)")
    r.add_argument("--page-size", type=positive_int, default=8, help="KV cache page size (8)")
    r.add_argument("--max-num-seqs", type=positive_int, default=6, help="running requests at most (6)")
    r.add_argument("--temperature", type=float, default=1.0, help="sampling temperature, > 0 (1.0)")
    r.add_argument("--top-p", type=float, default=None,
                   help="nucleus sampling threshold in (0, 1] (0.95; --engine frameworks: 1, the only value it takes)")
    r.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (0)")
    r.add_argument("--min-p", type=float, default=0.0, help="min-p sampling in [0, 1], 0 = off (0)")
    r.add_argument("--logprobs", choices=("processed", "unfiltered"), default="processed",
                   help="the log-prob both sides record and compare: over the kept set of the filters (processed, "
                   "vLLM's processed_logprobs; contract rlk.logp.processed.v1 under R) or over the whole vocabulary "
                   "(unfiltered). Without filters the two are the same (processed)")
    r.add_argument("--train-logprobs", choices=("processed", "unfiltered"), default=None,
                   help="the trainer's log-prob where it should differ from --logprobs: e.g. unfiltered, as a stock "
                   "trainer recomputes the full softmax, to measure the semantic mismatch (rlk-validate reports it)")
    r.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="optimizer of the trainer (adamw)")
    r.add_argument("--lr", type=float, default=None,
                   help="learning rate (default 1e-4 x (64 / the model's hidden size)^(5/3), one digit: tiny 1e-4, "
                   "the 0.6B shape 1e-6; a 10-round run keeps learning without collapsing its policy; 1e-3 saturates "
                   "the tiny model's in 4 rounds, 6.25e-6 the 0.6B shape's by round 5, 1e-4 in one update)")
    r.add_argument("--static-weights", action="store_true",
                   help="train nothing: the weights stay those of the checkpoint every round (a fixed-policy run, "
                   "asked for explicitly; local engine)")
    r.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default 1 on cpu: the small ops of a tiny model lose more to OpenMP "
                   "spinning than they gain, badly so on a shared machine; raise it for larger models)")
    r.add_argument("--state-every", type=int, default=None, metavar="N",
                   help="save the round state (weights, optimizer, KV free list; frameworks: Megatron masters, "
                   "optimizer, RNG streams, TP 1) every N rounds so that `run --resume` can continue the run; 0 = "
                   "never "
                   "(default 1 for the local engine, 0 for the frameworks engine)")
    r.add_argument("--audit", action="store_true",
                   help="record fallbacks and route violations instead of failing (default: RL_KERNEL_MODE, "
                   "else strict)")
    r.add_argument("--debug", action="store_true", help="show tracebacks")
    f = r.add_argument_group("--engine frameworks")
    f.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel size of vLLM and Megatron (1); > 1 under `torchrun --nproc-per-node N`")
    f.add_argument("--gpu-memory-utilization", type=float, default=0.3,
                   help="vLLM's share of the GPU memory; Megatron uses the rest (0.3)")
    f.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs / torch.compile")
    f.add_argument("--cuda-graph-decode", action="store_true",
                   help="vLLM CUDA graphs FULL_DECODE_ONLY with exact capture sizes 1..prompts x samples (the seeds' "
                   "profile); rlk-validate then fails the run if decode ran eager or outside those sizes")
    f.add_argument("--train-micro-tokens", type=positive_int, default=8192,
                   help="tokens per Megatron forward/backward (padded tokens for a P attention) (8192)")
    f.add_argument("--vllm-max-num-seqs", type=positive_int, default=256, help="vLLM max_num_seqs (256)")
    f.add_argument("--vllm-max-num-batched-tokens", type=positive_int, default=8192,
                   help="vLLM max_num_batched_tokens (8192)")
    f.add_argument("--rollout-quantization", choices=("none", "fp8"), default="none",
                   help="fp8: vLLM's FP8 weight + activation quantization serves the rollout (training stays BF16; "
                   "every weight sync re-quantizes); a mismatch knob of the ladder, never bitwise, rollout side P "
                   "(docs/ladder.md) (none)")
    f.add_argument("--run-name", default=None, help=argparse.SUPPRESS)  # a matrix cell's directory name
    from rlk_repro import model_options, tp_options, trace  # issue 37: model, data, reward; --trace; issue 35

    tp_options.add_options(f)  # issue 35 / 39: train TP != rollout TP, SP, CP, TP-invariant mode
    model_options.add_options(r)
    trace.add_options(r)


FRAMEWORKS_ONLY = ("tp", "gpu_memory_utilization", "enforce_eager", "cuda_graph_decode", "train_micro_tokens",
                   "vllm_max_num_seqs",
                   "vllm_max_num_batched_tokens", "rollout_quantization")


def _resolve(a: argparse.Namespace, all_variables: bool = True):
    """The plan and where each case came from: flag > RL_KERNEL_<MODULE>_CASE > --mode > consistency.
    With ``all_variables`` every rlk variable is parsed here, so a bad one stops the command before
    anything is created (``doctor`` reports the others as a check instead)."""
    from rlk_core import envs, routes

    if all_variables:
        envs.snapshot()
    flags = {m: getattr(a, f"{m}_case") for m in ("attention", "ffn", "logp")}
    return routes.resolve(flags, a.mode, default="consistency")


def _readback_mode(a: argparse.Namespace) -> tuple[str, str]:
    """strict or audit, and its origin: --audit > RL_KERNEL_MODE > strict."""
    import os

    from rlk_core import envs

    if getattr(a, "audit", False):
        return "audit", "flag --audit"
    if os.environ.get("RL_KERNEL_MODE", "") != "":
        return envs.get("RL_KERNEL_MODE"), "RL_KERNEL_MODE"
    return "strict", "default"


def _frameworks(a: argparse.Namespace) -> bool:
    return getattr(a, "engine", "local") == "frameworks"


def _config(a: argparse.Namespace, argv: Sequence[str], resolved):
    from rlk_repro.engine.frameworks import FrameworksRunConfig
    from rlk_repro.engine.local import LocalRunConfig
    from rlk_repro.engine.sampling import SamplingParams

    frameworks = _frameworks(a)
    device = a.device or ("cuda" if frameworks else "cpu")
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    top_p = a.top_p if a.top_p is not None else (1.0 if frameworks else 0.95)
    mode, mode_source = _readback_mode(a)
    extra = {k: getattr(a, k) for k in FRAMEWORKS_ONLY} if frameworks else {}
    state_every = getattr(a, "state_every", None)
    state_every = (0 if frameworks else 1) if state_every is None else state_every
    if not frameworks:
        given = [k for k in FRAMEWORKS_ONLY if getattr(a, k, None) != _DEFAULTS.get(k)]
        if given:
            raise RlkConfigError(f"--{given[0].replace('_', '-')} is an option of --engine frameworks")
    model_kw = _model_options(a, argv, frameworks)  # issue 37 (before the fields: --phase sets rounds and seed)
    from rlk_repro import tp_options  # issue 35 / 39

    model_kw.update(tp_options.config_kwargs(a, frameworks))
    cfg = (FrameworksRunConfig if frameworks else LocalRunConfig)(
        plan=resolved.plan, plan_sources=dict(resolved.sources), readback_mode_source=mode_source,
        rounds=a.rounds, seed=a.seed, device=device, dtype=dtype, model=a.model, checkpoint=a.checkpoint,
        prompts_per_round=a.prompts_per_round, samples_per_prompt=a.samples_per_prompt,
        max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=top_p, top_k=a.top_k, min_p=a.min_p,
        logprobs=a.logprobs, train_logprobs=a.train_logprobs,
        chunk_size=a.chunk_size, page_size=a.page_size, max_num_seqs=a.max_num_seqs, optimizer=a.optimizer,
        lr=a.lr, static_weights=a.static_weights, readback_mode=mode, command=["rlk-repro", *argv],
        threads=a.threads or (1 if device == "cpu" else None), state_every=state_every, trace=a.trace, **extra,
        **model_kw,
    )
    SamplingParams(a.temperature, top_p, a.top_k, a.max_new_tokens, min_p=a.min_p)  # argument errors first
    cfg.validate()
    return cfg


def _model_options(a: argparse.Namespace, argv: Sequence[str], frameworks: bool) -> dict:
    from rlk_repro import model_options  # issue 37

    return model_options.config_kwargs(a, argv, frameworks)


def _needs(a: argparse.Namespace) -> None:
    """--engine frameworks on a machine that cannot run it: one line naming what is missing, before anything
    is created."""
    from rlk_repro.engine.frameworks import requirements

    problem = requirements(a.tp)
    if problem:
        raise RlkConfigError(problem)


def _preflight(cfg, output: str) -> None:
    """What stops or weakens a run, said before anything is created: ``RLK_BACKENDS`` naming an op or a backend
    that is not there (exit 2), ``--output`` inside a run directory (exit 2), a run whose weights cannot change."""
    from rlk_repro import lifecycle
    from rlk_repro.matrix import static_weights_warning

    problem = lifecycle.forced_backends_problem(cfg.device.split(":")[0])
    if problem:
        raise RlkConfigError(problem)
    lifecycle.refuse_inside_run_dir(output, "--output")
    if cfg.samples_per_prompt == 1 and not cfg.static_weights:
        lifecycle.warn(static_weights_warning())


def _resumed(a: argparse.Namespace, argv: Sequence[str]):
    """``run --resume RUN_DIR``: the parent and the run's recorded configuration; an option given here that
    differs from the recorded one exits 2 naming both."""
    from dataclasses import replace

    from rlk_core import envs
    from rlk_repro.engine.frameworks import FrameworksRunConfig
    from rlk_repro.engine.local import LocalRunConfig
    from rlk_repro.resume import read_parent, recorded_config

    envs.snapshot()
    parent = read_parent(a.resume)
    engine = parent.manifest["engine"]
    config_cls = FrameworksRunConfig if engine == "frameworks" else LocalRunConfig
    cfg = config_cls(**recorded_config(parent, config_cls), command=["rlk-repro", *argv])
    defaults = build_parser().parse_args(["run"])
    conflicts = []
    if a.engine != defaults.engine and a.engine != engine:
        conflicts.append(f"--engine {a.engine}: the run is a {engine}-engine run")
    for key, value in vars(a).items():
        if key in ("resume", "output", "command", "engine", "debug") or value == getattr(defaults, key, value):
            continue
        if key in ("mode", "attention_case", "ffn_case", "logp_case"):
            wanted = _resolve(a, all_variables=False).plan.as_dict()
            if wanted != cfg.plan.as_dict():
                conflicts.append(f"--{key.replace('_', '-')} gives plan {wanted}, the run has {cfg.plan.as_dict()}")
        elif key == "audit":
            if cfg.readback_mode != "audit":
                conflicts.append(f"--audit: the run is {cfg.readback_mode}")
        elif not hasattr(cfg, key):
            conflicts.append(f"--{key.replace('_', '-')} is not an option of a {engine} run")
        elif getattr(cfg, key) != value:
            conflicts.append(f"--{key.replace('_', '-')} {value} differs from the recorded {getattr(cfg, key)}")
    if conflicts:
        raise RlkConfigError(f"--resume takes the run's recorded options: {'; '.join(conflicts)}")
    cfg.validate()
    return parent, replace(cfg)


def _cmd_run(a: argparse.Namespace, argv: Sequence[str]) -> int:
    from rlk_repro.engine.local import run_local

    if a.resume is not None:
        if "--output" in argv or any(x.startswith("--output=") for x in argv):
            raise RlkConfigError("--resume writes the new attempt beside RUN_DIR, where rlk-validate follows the "
                                 "chain; --output is not taken with it")
        parent, cfg = _resumed(a, argv)
        output = parent.path.parent
        frameworks = parent.manifest["engine"] == "frameworks"
        if frameworks:
            from rlk_repro.engine.frameworks import requirements, state_problem

            # before anything is created: what a new frameworks run needs, and a state the engine continues from
            problem = requirements(cfg.tp) or state_problem(parent, parent.peek_state())
            if problem:
                raise RlkConfigError(problem)
        print(f"rlk-repro: resuming {parent.path} (run {parent.manifest.get('run_id')}) at round "
              f"{parent.next_round + 1} of {cfg.rounds}, engine {parent.manifest['engine']}, mode {cfg.mode}, plan "
              f"{cfg.plan.as_dict()}", file=sys.stderr)
        if frameworks:
            from rlk_repro.engine.frameworks import run_frameworks

            result = run_frameworks(cfg, output, None, Progress(), resume=parent)
            if int(os.environ.get("RANK", "0")) != 0:
                return result.exit_code
        else:
            result = run_local(cfg, output, progress=Progress(), resume=parent)
        return _report_run(cfg, result)
    from rlk_repro import pd_options  # issue 37

    if pd_options.given(a) and (a.resume is not None or a.pair):
        raise RlkConfigError(f"--pd with {'--resume' if a.resume is not None else '--pair'}: a P/D run is one new "
                             "frameworks run")
    if a.pair:  # issue 37: a phase's native / consistency pairs (rlk_repro.phase_pairs)
        from rlk_repro import phase_pairs

        return phase_pairs.run_pairs(a, argv, build_parser, _resolve, _config, _preflight, _needs)
    resolved = _resolve(a)
    cfg = _config(a, argv, resolved)
    plan = resolved.plan
    if pd_options.layout(a, cfg) is not None:  # checked first: a layout problem is said before the refusal
        raise RlkConfigError(f"run --pd: {pd_options.engine_problem()}")
    if _frameworks(a):
        _needs(a)
    _preflight(cfg, a.output)
    print(f"rlk-repro: engine {a.engine}, mode {cfg.mode}, plan {plan.as_dict()}, {a.rounds} rounds, model "
          f"{a.checkpoint or a.model}, {cfg.device}/{cfg.dtype}", file=sys.stderr)
    if _frameworks(a):
        from rlk_repro.engine.frameworks import run_frameworks

        result = run_frameworks(cfg, a.output, a.run_name, Progress())
        if int(os.environ.get("RANK", "0")) != 0:  # rank 0 reports; the others only exit with its verdict
            return result.exit_code
    else:
        if a.run_name is not None:
            raise RlkConfigError("--run-name is internal to `rlk-repro matrix --engine frameworks`")
        result = run_local(cfg, a.output, progress=Progress())
    return _report_run(cfg, result)


def _report_run(cfg, result) -> int:
    """The run's summary on stdout; its exit status (a reader that left early, `| head`, changes nothing)."""
    try:
        _print_result(cfg, result)
    except BrokenPipeError:  # `rlk-repro run | head`: the reader left; the status is still the run's own
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return result.exit_code


def _print_result(cfg, result) -> None:
    from rlk_repro.runs import summary_table

    print(summary_table(result.rounds, result.bitwise))
    b = result.bitwise
    informative = (f"{b['informative_mismatch_count']} of the {b['informative_count']} informative tokens (log-prob "
                   "< -1e-3)")
    verdict = (f"PASS: bitwise equal over {b['element_count']} tokens, {informative} differ" if b["mismatch_count"] == 0
               else f"{'FAIL' if result.exit_code else 'info'}: {b['mismatch_count']} of {b['element_count']} tokens "
               f"differ, {informative}")
    print(f"{verdict} ({'exact equality required' if cfg.exact_required else 'exact equality not required'}); "
          f"weights changed every round: {'yes' if result.weights_changed_every_round else 'NO'}")
    print(f"run directory: {result.run_dir}")


def _cmd_matrix(a: argparse.Namespace, argv: Sequence[str]) -> int:
    from rlk_repro.matrix import run_matrix

    return run_matrix(a, argv, _config, _frameworks_cell, _needs, build_parser)


def _cmd_plan(a: argparse.Namespace, argv: Sequence[str]) -> int:
    import json
    from dataclasses import asdict

    resolved = _resolve(a)
    cfg = _config(a, argv, resolved)
    plan = resolved.plan
    # one name, as in the manifest and the bitwise file: require_exact, resolved (the config's own field is
    # None where the plan decides; printing both said two different things)
    config = {k: v for k, v in asdict(cfg).items() if k not in ("plan", "command", "plan_sources", "require_exact")}
    doc = {"engine": a.engine, "mode": cfg.mode, "plan": plan.as_dict(), "routes": resolved.as_dict(),
           "readback_mode": {"mode": cfg.readback_mode, "source": cfg.readback_mode_source},
           "env": plan.env(), "require_exact": cfg.exact_required, "config": config}
    if _frameworks(a):  # issue 35 / 39: the parallel layout and RL_KERNEL_TP_INVARIANT
        from rlk_repro import tp_options

        doc["parallel"] = tp_options.section(cfg, tp_options.check(cfg))
        doc["env"].update(tp_options.env(cfg))
    from rlk_repro import pd_options  # issue 37: the Prefill/Decode split

    pd = pd_options.layout(a, cfg)
    if pd is not None:
        doc["pd"] = pd
    print(json.dumps(doc, indent=2))
    return EXIT_OK


_DEFAULTS = {"tp": 1, "gpu_memory_utilization": 0.3, "enforce_eager": False, "cuda_graph_decode": False,
             "train_micro_tokens": 8192, "vllm_max_num_seqs": 256, "vllm_max_num_batched_tokens": 8192,
             "rollout_quantization": "none"}
# run/matrix options a frameworks matrix cell passes on to its `rlk-repro run` process
_CELL_OPTIONS = ("rounds", "seed", "device", "dtype", "model", "checkpoint", "prompts_per_round", "samples_per_prompt",
                 "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "logprobs", "train_logprobs",
                 "optimizer", "lr",
                 "static_weights", "audit",
                 *FRAMEWORKS_ONLY, "train_tp", "rollout_tp", "sequence_parallel", "context_parallel", "tp_invariant",
                 # issue 37: the real model and data (--workspace is resolved into the first two by then)
                 "model_path", "prompt_data", "input_key", "label_key", "apply_chat_template",
                 "apply_chat_template_kwargs", "rm_type", "rollout_stop_token_ids", "phase")


def _cell_argv(a: argparse.Namespace, plan: dict[str, str], root, cell: str) -> list[str]:
    out = ["run", "--engine", "frameworks", "--output", str(root), "--run-name", cell]
    for module, case in plan.items():
        out += [f"--{module}-case", case]
    for k in _CELL_OPTIONS:
        v = getattr(a, k, None)
        if v is None or v is False:
            continue
        if isinstance(v, dict):  # --apply-chat-template-kwargs JSON
            import json

            v = json.dumps(v)
        out += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(x) for x in v] if isinstance(v, list)
                                               else [str(v)])
    return out


def _frameworks_cell(a: argparse.Namespace, cfg, root, cell: str):
    """One frameworks matrix cell in its own process (each process holds one plan: vLLM's plugin and the
    Megatron provider read the routes once), then its bitwise file read back."""
    import json
    import subprocess
    from types import SimpleNamespace

    argv = _cell_argv(a, cfg.plan.as_dict(), root, cell)
    proc = subprocess.run([sys.executable, "-m", "rlk_repro", *argv], check=False)
    path = root / cell / "bitwise-validation.json"
    if proc.returncode not in (EXIT_OK, EXIT_MISMATCH) or not path.is_file():
        raise RuntimeError(f"`rlk-repro {' '.join(argv)}` exited {proc.returncode}")
    return SimpleNamespace(bitwise=json.loads(path.read_text(encoding="utf-8")))


def _cmd_doctor(a: argparse.Namespace) -> int:

    import torch

    from rlk_repro.doctor import FAIL, as_json, diagnose, format_checks

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    resolved = _resolve(a, all_variables=False)
    plan = resolved.plan
    checks = diagnose(device, plan, selfcheck=a.selfcheck, progress=Progress().callback(), engine=a.engine)
    if a.workspace is not None:  # issue 37
        from rlk_repro.workspace import checks as workspace_checks

        checks += workspace_checks(a.workspace)
    if a.pd:  # issue 37: the Prefill/Decode split
        from rlk_repro import pd_options

        checks += pd_options.doctor_checks(a.pd_connector, plan)
    print(f"rlk-repro doctor: device {device}, plan "
          + ", ".join(f"{m} {c['case']} ({c['source']})" for m, c in resolved.as_dict().items()))
    print(format_checks(checks))
    if a.json:
        from rlk_validate.evidence import write_json_atomic

        write_json_atomic(a.json, as_json(checks, device, plan), indent=1)
    return EXIT_MISMATCH if any(c.status == FAIL for c in checks) else EXIT_OK


def _cmd_report(a: argparse.Namespace) -> int:
    from rlk_repro.lifecycle import refuse_sealed
    from rlk_repro.report import SUMMARY_COLUMNS, write_report

    if a.output is None and len(a.run_dirs) == 1:
        refuse_sealed(a.run_dirs[0], "writing report/ into it")
    elif a.output is not None:
        refuse_sealed(a.output, f"--output {a.output}")

    summaries, written, no_plots, cells_skipped, warnings = write_report(a.run_dirs, a.output)
    for warning in warnings:
        print(f"rlk-repro report: warning: {warning}", file=sys.stderr)
    for s in summaries:
        print("  ".join(f"{h}: {s[k]:.4g}" if isinstance(s[k], float) else f"{h}: {s[k]}" for k, h in SUMMARY_COLUMNS))
    for cell in cells_skipped:
        print(f"rlk-repro report: matrix cell not reported: {cell}", file=sys.stderr)
    if no_plots:
        print(f"rlk-repro report: plots skipped: {no_plots}", file=sys.stderr)
    for path in written:
        print(f"wrote {path}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; ``argv`` None: this is the process (the console script), whose SIGINT / SIGTERM
    handling then lasts until it exits (:mod:`rlk_repro.lifecycle`)."""
    from rlk_repro import lifecycle

    process = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    with lifecycle.handle_signals(process):
        try:
            code = _main(argv)
            sys.stdout.flush()
        except BrokenPipeError:  # `rlk-repro plan | head`: the reader left; say nothing more
            import os

            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            code = EXIT_OK
        late = lifecycle.held_signal()
        if late is not None:
            print(f"rlk-repro: {late} arrived after the run had ended and written its exit-code; exiting with "
                  f"that status ({code})", file=sys.stderr)
        return code



def _engine(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--engine" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--engine="):
            return arg.partition("=")[2]
    return None


def _vime(argv: list[str]) -> int:
    """``plan --engine vime`` (its own options, in rlk_repro.vime) and ``run --engine vime`` (refused)."""
    if argv[0] == "run":
        print("rlk-repro run: --engine vime runs on your cluster: launch it with the command "
              "`rlk-repro plan --engine vime ...` prints (docs/vime.md)", file=sys.stderr)
        return EXIT_USAGE
    from rlk_repro import vime_cli

    p = _Parser(prog="rlk-repro plan --engine vime", description="Print the launch of a VIME cluster run with "
                "rlk's routes: a bash script for the Ray head node (or --json); nothing is run or written.")
    p.add_argument("--engine", choices=("vime",), required=True, help="vime")
    _plan_options(p)
    vime_cli.add_options(p)
    a = vime_cli.parse(p, argv[1:])
    resolved = _resolve(a)
    return vime_cli.plan_main(a, argv, resolved, _readback_mode(a)[0])


def _main(argv: list[str]) -> int:
    debug = "--debug" in argv
    commands = ("run", "plan", "matrix", "doctor", "report", "prepare", "attribute", "abtest", "ladder",
                "synthetic-math", "warmstart")
    name = "rlk-repro" + next((f" {c}" for c in argv if c in commands), "")
    try:
        if argv[:1] in (["plan"], ["run"]) and _engine(argv) == "vime":
            return _vime(argv)
        a = build_parser().parse_args(argv)
        if a.command is None:
            build_parser().print_help()
            return EXIT_USAGE
        if getattr(a, "main", None) is not None:  # a subcommand module's own command (attribute_cli)
            return a.main(a)
        if a.command == "report":
            return _cmd_report(a)
        if a.command == "doctor":
            return _cmd_doctor(a)
        if a.command == "prepare":  # issue 37
            from rlk_repro import prepare_cli

            return prepare_cli.main(a)
        if a.command == "ladder":  # issue 38
            from rlk_repro import ladder_cli

            return ladder_cli.main(a, argv, _config, _frameworks_cell, _needs, build_parser, _cell_argv)
        if a.command == "plan":
            return _cmd_plan(a, argv)
        return _cmd_matrix(a, argv) if a.command == "matrix" else _cmd_run(a, argv)
    except _Usage as exc:
        print(f"{exc}\n(see `rlk-repro --help`)", file=sys.stderr)
        return EXIT_USAGE
    except RlkConfigError as exc:
        if debug:
            raise
        print(f"{name}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RlkError as exc:
        if debug:
            raise
        print(f"{name}: failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt as exc:  # Ctrl-C, or SIGTERM (rlk_repro.lifecycle.Terminated)
        from rlk_repro import lifecycle

        print(f"{name}: {'terminated (SIGTERM)' if isinstance(exc, lifecycle.Terminated) else 'interrupted'}",
              file=sys.stderr)
        return lifecycle.interrupt_status(exc)
    except BrokenPipeError:
        raise
    except Exception as exc:  # a bug or an environment failure: one line here, --debug for the traceback
        if debug:
            raise
        print(f"{name}: failed: {type(exc).__name__}: {exc} (rerun with --debug for a traceback)", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
