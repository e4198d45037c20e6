"""``rlk-repro plan --engine vime``: the launch of a VIME cluster run with rlk's routes.

VIME (github.com/vllm-project/vime: slime with vLLM as the rollout engine; Ray + vLLM + Megatron) runs on the
user's cluster, not here: this module only *prints* the launch — a shell script a user can paste on the Ray
head node, or (``--json``) the same as a document — and records the environment of the head node when that
script runs (``python -m rlk_repro.vime record ...``, :mod:`rlk_repro.vime_record`). It never imports torch,
Ray, vLLM or Megatron. Its command line is :mod:`rlk_repro.vime_cli`.

What the launch carries (facts from ``shared/reference/slime-vime.md`` and VIME's own argument parser, whose
flags are recorded in ``data/vime-train-flags.txt``: every printed flag is one of them, see
:mod:`rlk_repro.vime_args`):

- the model: ``--hf-checkpoint`` and the Megatron model arguments derived from its ``config.json``, the
  Megatron checkpoint (``--ref-load``), optimizer, dynamic micro-batching (``--max-tokens-per-gpu``) and
  checkpoints (``--save`` / ``--load`` in the run directory, every ``--save-interval`` rounds: a relaunch
  continues from the last one);
- the train side: ``--custom-megatron-init-path`` (plan, readback, slime binding; always, so that P
  modules are recorded too), the layer spec and ``--transformer-impl local`` where a train letter is R,
  the strict linear-logp provider where logp's train letter is R (only for a VIME that has that ABI:
  ``--linear-logp-abi``; the recorded VIME does not, and would drop the flag silently), and the log-prob
  record hook (``--get-mismatch-metrics --custom-tis-function-path``) that writes ``logprob-records/`` —
  composed with the user's own TIS/MIS function (``--tis-function``, or a ``--custom-tis-function-path``
  among ``--extra``), which it calls after recording (``RL_KERNEL_TIS_FUNCTION``);
- the rollout side: ``--vllm-attention-backend CUSTOM`` where attention's rollout letter is R,
  ``--vllm-enable-deterministic-inference`` wherever a plan routes anything to rlk (the native control
  stays what users run today); temperature / top-p / top-k: with logp R/R both sides compute the processed
  log-prob over the same kept sets (contract rlk.logp.processed.v1; the trainer learns the filters from
  ``RL_KERNEL_LOGP_SAMPLING``), with a P trainer filters need the user's opt-in to unfiltered log-probs;
- the environment (``RL_KERNEL_*``) both exported and forwarded through Ray's runtime env
  (``ray job submit --runtime-env-json '{"env_vars": {...}}'``): Ray workers do not inherit the
  launcher's environment, and without it every R side silently runs production code.

The exact-equality claim is checked after the run by ``rlk-validate --require-bitwise`` on the imported
run directory (the script's last step); slime's in-run gate ``--ci-train-rollout-logprob-abs-diff-threshold``
is not a flag of the recorded VIME. Every path in the launch record is absolute (resolved when planned).
The other packages' entry points are named once, in :data:`ENTRY_POINTS`.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlk_core.errors import RlkConfigError, RlkPolicyError
from rlk_core.tp import check_tp_layout
from rlk_repro import vime_args
from rlk_validate.evidence import VIME_LAUNCH_SCHEMA

#: Every name this launch uses from rlk-megatron-provider and rlk-vllm-plugin (align here, nowhere else).
ENTRY_POINTS: dict[str, Any] = {
    # --custom-megatron-init-path: fn(args) at the end of Megatron init, in every training process
    "megatron_init": "rlk_megatron_provider.install",
    # --spec MODULE FN: slime calls FN(args, config, vp_stage) and takes the layer spec it returns
    "megatron_spec": ("rlk_megatron_provider", "slime_spec"),
    # --linear-logp-provider: VIME's training log-prob provider ABI
    "linear_logp_provider": "rlk_megatron_provider.linear_logp",
    # --custom-tis-function-path (with --get-mismatch-metrics): writes logprob-records/, then calls the user's
    # own TIS/MIS function (RL_KERNEL_TIS_FUNCTION) or returns pg_loss as is
    "logprob_recorder": "rlk_megatron_provider.record_logprobs",
    # vllm.general_plugins entry point name (a deployment that sets VLLM_PLUGINS must list it)
    "vllm_plugin": "rlk",
    # the vLLM attention backend the plugin registers
    "vllm_attention_backend": "CUSTOM",
    # the plugin's opt-in variable for unfiltered log-probs (top-p < 1 / top-k > 0 with R logp)
    "vllm_unfiltered_logprobs_var": "RL_KERNEL_VLLM_UNFILTERED_LOGPROBS",
    # the rollout's filters for the train side's processed log-probs (logp R/R with top-p < 1 / top-k > 0)
    "logp_sampling_var": "RL_KERNEL_LOGP_SAMPLING",
    # the variable the record hook writes into
    "logprob_records_var": "RL_KERNEL_LOGPROB_RECORDS_DIR",
    # the variable naming the user's own TIS/MIS function the record hook calls after recording
    "user_tis_var": "RL_KERNEL_TIS_FUNCTION",
}
LAUNCH_SCHEMA = VIME_LAUNCH_SCHEMA
LAUNCH_FILE = "rlk-launch.json"
RECORDS_DIR = "logprob-records"
CHECKPOINTS_DIR = "checkpoints"
#: prompt tokens budgeted per sample (``--rollout-max-prompt-len``; longer prompts are dropped by VIME)
PROMPT_TOKENS = 2048


@dataclass(frozen=True)
class VimeConfig:
    """Options of one VIME run (what ``plan --engine vime`` accepts), validated by :func:`check`. Paths are
    absolute (:func:`rlk_repro.vime_cli.config_from_args` resolves them)."""

    plan: dict[str, str]
    plan_sources: dict[str, str]
    run_dir: str
    model_path: str
    ref_load: str
    prompt_data: str
    vime_root: str
    model_args: tuple[str, ...] = ()
    model_info: dict[str, Any] = field(default_factory=dict)
    readback_mode: str = "strict"
    run_id: str = "rlk-vime-run"
    profile: str | None = None
    ray_address: str = "http://127.0.0.1:8265"
    rounds: int = 5
    prompts_per_round: int = 1
    samples_per_prompt: int = 8
    global_batch_size: int | None = None
    max_new_tokens: int = 1024
    max_prompt_tokens: int = PROMPT_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    unfiltered_logprobs: bool = False
    seed: int = 1234
    rollout_seed: int = 42
    tensor_parallel: int = 1
    context_parallel: int = 1
    rollout_tensor_parallel: int = 1
    tp_invariant: int = 0  # G of RL_KERNEL_TP_INVARIANT for both sides (0: off; rlk_repro.tp_options)
    nodes: int = 1
    gpus_per_node: int = 8
    rollout_gpus: int | None = None
    colocate: bool = True
    keep_actor_resident: bool = False
    recompute: bool = False
    cuda_graph_decode: bool = False
    lr: float = 1e-6
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    clip_grad: float = 1.0
    max_tokens_per_gpu: int | None = None
    save_dir: str | None = None
    save_interval: int | None = None
    tis_function: str | None = None
    linear_logp_abi: bool = False
    extra_args: tuple[str, ...] = ()

    @property
    def train_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def all_rr(self) -> bool:
        return all(c == "R/R" for c in self.plan.values())

    @property
    def mode(self) -> str:
        if self.all_rr:
            return "consistency"
        return "native" if all(c == "P/P" for c in self.plan.values()) else "matrix"

    def letter(self, module: str, side: str) -> str:
        return self.plan[module].split("/")[0 if side == "train" else 1]

    def any_r(self, side: str | None = None) -> bool:
        sides = ("train", "rollout") if side is None else (side,)
        return any(self.letter(m, s) == "R" for m in self.plan for s in sides)

    @property
    def samples(self) -> int:
        return self.prompts_per_round * self.samples_per_prompt

    @property
    def tokens_per_gpu(self) -> int:
        """``--max-tokens-per-gpu``: given, or one whole sample (prompt budget + response) per CP rank."""
        if self.max_tokens_per_gpu is not None:
            return self.max_tokens_per_gpu
        return -(-(self.max_prompt_tokens + self.max_new_tokens) // self.context_parallel)

    @property
    def checkpoint_dir(self) -> str:
        return self.save_dir or f"{self.run_dir}/{CHECKPOINTS_DIR}"

    @property
    def checkpoint_interval(self) -> int:
        return self.save_interval or min(self.rounds, 50)


def check(cfg: VimeConfig) -> None:
    """Raise :class:`RlkConfigError` (one line) for a combination VIME would run but that cannot hold."""
    if not 0 < cfg.top_p <= 1:
        raise RlkConfigError(f"--top-p {cfg.top_p} must be in (0, 1]")
    if cfg.top_k < 0:
        raise RlkConfigError(f"--top-k {cfg.top_k} must be >= 0 (0 = off)")
    if not cfg.temperature > 0:
        raise RlkConfigError(f"--temperature {cfg.temperature} must be > 0: the trainer's log-prob divides by it")
    filtered = cfg.top_p < 1 or cfg.top_k > 0
    if (filtered and cfg.letter("logp", "rollout") == "R" and cfg.letter("logp", "train") != "R"
            and not cfg.unfiltered_logprobs):
        raise RlkConfigError(
            f"logp {cfg.plan['logp']} with --top-p {cfg.top_p} / --top-k {cfg.top_k}: rlk's rollout returns the "
            "processed log-probs over the kept set, and the trainer's logp P computes the full softmax; plan logp "
            "R/R (the trainer then finds the same kept sets: RL_KERNEL_LOGP_SAMPLING), or --unfiltered-logprobs to "
            "return the unfiltered log softmax(logits / T)")
    if cfg.unfiltered_logprobs and cfg.letter("logp", "rollout") != "R":
        raise RlkConfigError("--unfiltered-logprobs needs logp R on the rollout side (it is rlk's log-prob hook)")
    if cfg.letter("logp", "train") == "R" and not cfg.linear_logp_abi:
        raise RlkConfigError(
            f"logp {cfg.plan['logp']}: the train side's R log-prob is installed through VIME's linear-logp provider "
            f"ABI (--linear-logp-provider), which vllm-project/vime at {vime_args.VIME_COMMIT[:9]} does not have (it "
            "would drop the flag silently and compute its own log-softmax); pass --linear-logp-abi if your VIME has "
            "it (the RL-Align/vime fork), or plan logp P on the train side (--logp-case P/R or P/P)")
    tp, cp = cfg.tensor_parallel, cfg.context_parallel
    if cfg.train_gpus % (tp * cp):
        raise RlkConfigError(f"training TP {tp} x CP {cp} does not divide {cfg.nodes} node(s) x "
                             f"{cfg.gpus_per_node} GPU(s)")
    rollout_gpus = cfg.rollout_gpus if cfg.rollout_gpus is not None else cfg.train_gpus
    if rollout_gpus % cfg.rollout_tensor_parallel:
        raise RlkConfigError(f"rollout TP {cfg.rollout_tensor_parallel} does not divide {rollout_gpus} rollout GPU(s)")
    try:  # train TP != rollout TP needs TP-invariant mode (strict: refused, saying what to set)
        check_tp_layout(tp, cfg.rollout_tensor_parallel, env={"RL_KERNEL_TP_INVARIANT": str(cfg.tp_invariant)},
                        mode=cfg.readback_mode)
    except RlkPolicyError as exc:
        raise RlkConfigError(f"{exc} (--tp-invariant G sets it for the launch)") from None
    if cfg.colocate and rollout_gpus != cfg.train_gpus:
        raise RlkConfigError(f"--colocate shares the {cfg.train_gpus} training GPUs; --rollout-gpus {rollout_gpus} "
                             "differs (use --no-colocate)")
    gbs = cfg.global_batch_size or cfg.samples
    if cfg.samples % gbs:
        raise RlkConfigError(f"--global-batch-size {gbs} does not divide the {cfg.samples} samples of a round")
    if not cfg.run_id or "/" in cfg.run_id or not cfg.run_id.isprintable() or any(c.isspace() for c in cfg.run_id):
        raise RlkConfigError(f"--run-id {cfg.run_id!r}: no spaces or path separators")
    if cfg.tis_function is not None and (cfg.tis_function == ENTRY_POINTS["logprob_recorder"]
                                         or "." not in cfg.tis_function.strip(".")):
        raise RlkConfigError(f"--tis-function {cfg.tis_function!r}: your own TIS/MIS function as module.function "
                             "(rlk's recorder calls it after recording)")


def environment(cfg: VimeConfig) -> dict[str, str]:
    """Every ``RL_KERNEL_*`` variable the run's processes need (exported and forwarded to Ray)."""
    env = {f"RL_KERNEL_{m.upper()}_CASE": cfg.plan[m] for m in ("attention", "ffn", "logp")}
    env["RL_KERNEL_MODE"] = cfg.readback_mode
    env["RL_KERNEL_READBACK_DIR"] = f"{cfg.run_dir}/readbacks"
    env["RL_KERNEL_RUN_ID"] = cfg.run_id
    if cfg.tp_invariant:
        env["RL_KERNEL_TP_INVARIANT"] = str(cfg.tp_invariant)
    env[ENTRY_POINTS["logprob_records_var"]] = f"{cfg.run_dir}/{RECORDS_DIR}"
    if cfg.unfiltered_logprobs:
        env[ENTRY_POINTS["vllm_unfiltered_logprobs_var"]] = "1"
    elif (cfg.top_p < 1 or cfg.top_k > 0) and cfg.letter("logp", "train") == "R":
        # the train side's kept sets: the processed log-prob over the rollout's filters, no keep-mask replay
        env[ENTRY_POINTS["logp_sampling_var"]] = f"top_k={cfg.top_k},top_p={cfg.top_p}"
    if cfg.tis_function:
        env[ENTRY_POINTS["user_tis_var"]] = cfg.tis_function
    return env


def runtime_env(cfg: VimeConfig) -> dict[str, Any]:
    """Ray's runtime env (``ray job submit --runtime-env-json``): the environment every worker gets."""
    return {"env_vars": environment(cfg)}


def _number(x: float) -> str:
    return repr(float(x))


def flag_groups(cfg: VimeConfig) -> list[tuple[str, list[str]]]:
    """The arguments of VIME's ``train.py``, in named groups (each a flat argv list)."""
    rollout_gpus = cfg.rollout_gpus if cfg.rollout_gpus is not None else cfg.train_gpus
    cluster = ["--actor-num-nodes", str(cfg.nodes), "--actor-num-gpus-per-node", str(cfg.gpus_per_node),
               "--rollout-num-gpus", str(rollout_gpus),
               "--rollout-num-gpus-per-engine", str(cfg.rollout_tensor_parallel)]
    if cfg.colocate:
        cluster += ["--colocate"] + (["--no-offload-train", "--offload-rollout"] if cfg.keep_actor_resident else [])
    parallel = ["--tensor-model-parallel-size", str(cfg.tensor_parallel), "--context-parallel-size",
                str(cfg.context_parallel), "--pipeline-model-parallel-size", "1"]
    if cfg.recompute:
        parallel += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    groups = [
        ("cluster", cluster),
        ("model", ["--hf-checkpoint", cfg.model_path, "--ref-load", cfg.ref_load, *cfg.model_args]),
        ("parallelism", parallel),
        # micro-batches packed up to a token budget per GPU (one whole sample per CP rank by default)
        ("batching", ["--use-dynamic-batch-size", "--max-tokens-per-gpu", str(cfg.tokens_per_gpu)]),
        ("optimizer", ["--optimizer", "adam", "--lr", _number(cfg.lr), "--lr-decay-style", "constant",
                       "--weight-decay", _number(cfg.weight_decay), "--adam-beta1", _number(cfg.adam_beta1),
                       "--adam-beta2", _number(cfg.adam_beta2), "--clip-grad", _number(cfg.clip_grad)]),
        # --load names the same folder: VIME starts from --ref-load until a checkpoint is there, then resumes
        ("checkpoints", ["--save", cfg.checkpoint_dir, "--load", cfg.checkpoint_dir,
                         "--save-interval", str(cfg.checkpoint_interval)]),
        ("rollout", ["--prompt-data", cfg.prompt_data, "--input-key", "prompt", "--label-key", "label",
                     "--apply-chat-template", "--rm-type", "deepscaler", "--advantage-estimator", "grpo",
                     "--num-rollout", str(cfg.rounds), "--rollout-batch-size", str(cfg.prompts_per_round),
                     "--n-samples-per-prompt", str(cfg.samples_per_prompt),
                     "--global-batch-size", str(cfg.global_batch_size or cfg.samples),
                     "--rollout-max-prompt-len", str(cfg.max_prompt_tokens),
                     "--rollout-max-response-len", str(cfg.max_new_tokens)]),
        # the trainer divides by --rollout-temperature only: the sampling temperature is that same value
        ("sampling", ["--rollout-temperature", _number(cfg.temperature), "--rollout-top-p", _number(cfg.top_p),
                      "--rollout-top-k", str(cfg.top_k if cfg.top_k > 0 else -1), "--seed", str(cfg.seed),
                      "--rollout-seed", str(cfg.rollout_seed), "--attention-dropout", "0.0", "--hidden-dropout",
                      "0.0"]),
    ]
    train = ["--custom-megatron-init-path", ENTRY_POINTS["megatron_init"]]
    if cfg.any_r("train"):
        module, fn = ENTRY_POINTS["megatron_spec"]
        train += ["--spec", module, fn, "--transformer-impl", "local"]
    if cfg.letter("logp", "train") == "R" and cfg.linear_logp_abi:
        train += ["--linear-logp-provider", ENTRY_POINTS["linear_logp_provider"],
                  "--linear-logp-provider-mode", "strict" if cfg.readback_mode == "strict" else "auto"]
    train += ["--get-mismatch-metrics", "--custom-tis-function-path", ENTRY_POINTS["logprob_recorder"]]
    groups.append(("rlk train side", train))
    rollout: list[str] = []
    if cfg.letter("attention", "rollout") == "R":
        rollout += ["--vllm-attention-backend", ENTRY_POINTS["vllm_attention_backend"]]
    if cfg.any_r():
        rollout += ["--vllm-enable-deterministic-inference"]
    compilation: dict = {}
    if cfg.cuda_graph_decode:  # CUDA graphs for decode only, one per batch size a round can have
        compilation.update(cudagraph_mode="FULL_DECODE_ONLY", cudagraph_capture_sizes=list(range(1, cfg.samples + 1)))
    if cfg.rollout_tensor_parallel > 1 and "R" in (cfg.letter("attention", "rollout"), cfg.letter("ffn", "rollout")):
        # vLLM's fused all-reduce + RMSNorm and its sequence-parallel / async-TP passes bypass rlk's TP all-reduce
        # (and rlk.gemm.tp.v1's merge): the plugin refuses them in strict mode (docs/vllm.md)
        compilation["pass_config"] = {"fuse_allreduce_rms": False, "enable_sp": False, "fuse_gemm_comms": False}
    if compilation:
        rollout += ["--vllm-compilation-config", json.dumps(compilation, separators=(",", ":"))]
    groups.append(("rlk rollout side", rollout))
    if cfg.extra_args:
        groups.append(("extra", list(cfg.extra_args)))
    return [(n, a) for n, a in groups if a]


def train_args(cfg: VimeConfig) -> list[str]:
    return [a for _, args in flag_groups(cfg) for a in args]


def submit_argv(cfg: VimeConfig) -> list[str]:
    """``ray job submit`` with the runtime env, then VIME's ``train.py`` and its arguments."""
    return ["ray", "job", "submit", "--address", cfg.ray_address,
            "--runtime-env-json", json.dumps(runtime_env(cfg), sort_keys=True, separators=(",", ":")),
            "--", "python3", f"{cfg.vime_root}/train.py", *train_args(cfg)]


def launch(cfg: VimeConfig, command: Sequence[str] = ()) -> dict[str, Any]:
    """The launch as a document (``--json``; the script writes it to ``$RUN_DIR/rlk-launch.json``)."""
    check(cfg)
    gbs = cfg.global_batch_size or cfg.samples
    argv = train_args(cfg)
    return {
        "schema": LAUNCH_SCHEMA, "engine": "vime", "run_id": cfg.run_id, "run_dir": cfg.run_dir,
        "mode": cfg.mode, "plan": dict(cfg.plan), "plan_sources": dict(cfg.plan_sources),
        "readback_mode": cfg.readback_mode, "require_exact": cfg.all_rr, "command": list(command),
        "profile": cfg.profile, "rounds": cfg.rounds, "steps_per_round": cfg.samples // gbs,
        "seeds": {"train": cfg.seed, "rollout": cfg.rollout_seed},
        "model": {"path": cfg.model_path, **cfg.model_info, "args": list(cfg.model_args)},
        "topology": {"nodes": cfg.nodes, "gpus_per_node": cfg.gpus_per_node, "tensor_parallel": cfg.tensor_parallel,
                     "context_parallel": cfg.context_parallel,
                     "data_parallel": cfg.train_gpus // (cfg.tensor_parallel * cfg.context_parallel),
                     "rollout_gpus": cfg.rollout_gpus if cfg.rollout_gpus is not None else cfg.train_gpus,
                     "rollout_tensor_parallel": cfg.rollout_tensor_parallel, "colocate": cfg.colocate,
                     "tp_invariant": cfg.tp_invariant},
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                     "unfiltered_logprobs": cfg.unfiltered_logprobs},
        "checkpoints": {"dir": cfg.checkpoint_dir, "interval": cfg.checkpoint_interval},
        "env": environment(cfg), "runtime_env": runtime_env(cfg),
        "flags": {name: args for name, args in flag_groups(cfg)},
        "vime_flags": {"recorded_at": vime_args.VIME_COMMIT, "linear_logp_abi": cfg.linear_logp_abi,
                       "not_recorded": vime_args.unknown_flags(argv, cfg.linear_logp_abi)},
        "submit": submit_argv(cfg), "entry_points": {k: (list(v) if isinstance(v, tuple) else v)
                                                     for k, v in ENTRY_POINTS.items()},
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("plan", "plan_sources", "extra_args",
                                                                     "model_args", "model_info")}
        | {"extra_args": list(cfg.extra_args)},
    }


# Step 4 of the script (commented out: the node list is the user's), one shell line each; NODES holds the
# other nodes' ssh names, $RUN_DIR is the same path on every node. tests/repro runs these lines.
COPY_FROM_NODES = (
    "for NODE in $NODES; do",
    '  H=$(ssh "$NODE" hostname)',
    '  scp -rp "$NODE:$RUN_DIR/readbacks/$H" "$RUN_DIR/readbacks/"',
    f'  mkdir -p "$RUN_DIR/{RECORDS_DIR}/$H" && scp -p "$NODE:$RUN_DIR/{RECORDS_DIR}/*" "$RUN_DIR/{RECORDS_DIR}/$H/"',
    "done",
)


def _q(s: str) -> str:
    return shlex.quote(s)


def script(doc: Mapping[str, Any]) -> str:
    """The launch as a bash script a user can paste on the Ray head node."""
    env, run_dir = doc["env"], doc["run_dir"]
    lines = [
        "#!/usr/bin/env bash",
        f"# rlk VIME launch: plan {', '.join(f'{m} {c}' for m, c in doc['plan'].items())} ({doc['mode']}), "
        f"run {doc['run_id']}" + (f", profile {doc['profile']}" if doc.get("profile") else ""),
        "# Run on the Ray head node, in the Python environment of the Ray workers "
        "(rlk-vllm-plugin and rlk-megatron-provider installed).",
        f"# Every train.py flag below is one VIME {vime_args.VIME_COMMIT[:9]} accepts "
        "(rlk_repro/data/vime-train-flags.txt)"
        + (", plus the linear-logp provider ABI (--linear-logp-abi: your VIME has it, that one does not)"
           if doc["vime_flags"]["linear_logp_abi"] else "")
        + (f"; NOT {' '.join(doc['vime_flags']['not_recorded'])} (VIME drops unknown flags silently)"
           if doc["vime_flags"]["not_recorded"] else "") + ".",
        "set -euo pipefail",
        f"RUN_DIR={_q(run_dir)}",
        'mkdir -p "$RUN_DIR/readbacks" "$RUN_DIR/' + RECORDS_DIR + '"',
        "",
        "# 1. the environment: exported here AND forwarded to every Ray worker (--runtime-env-json below)",
    ]
    lines += [f"export {k}={_q(v)}" for k, v in env.items()]
    lines += [
        "",
        "# 2. what launched and where: the launch document and the head node's environment",
        f"cat > \"$RUN_DIR/{LAUNCH_FILE}\" <<'RLK_LAUNCH_EOF'",
        json.dumps(doc, sort_keys=True),
        "RLK_LAUNCH_EOF",
        f"python3 -m rlk_repro.vime record \"$RUN_DIR\" --repo vime={_q(doc['config']['vime_root'])} "
        f"--input prompts={_q(doc['config']['prompt_data'])} --input checkpoint={_q(doc['config']['model_path'])}",
        "",
        "# 3. the job. Ray workers do not inherit this shell's environment: the runtime env carries it",
        "RUNTIME_ENV_JSON=$(python3 -c 'import json, os, sys; "
        "print(json.dumps({\"env_vars\": {k: os.environ[k] for k in sys.argv[1:]}}))' " + " ".join(env) + ")",
        "set +e",
        f"ray job submit --address {_q(doc['config']['ray_address'])} \\",
        '  --runtime-env-json "$RUNTIME_ENV_JSON" \\',
        f"  -- python3 {_q(doc['config']['vime_root'] + '/train.py')} \\",
    ]
    lines += [f"  {_args_line(args)} \\" for args in doc["flags"].values()]
    lines += [
        '  2>&1 | tee "$RUN_DIR/run.log"',
        'echo "${PIPESTATUS[0]}" > "$RUN_DIR/exit-code"',
        "set -e",
        "",
        "# 4. several nodes without a shared filesystem: every process already wrote its readback under its",
        "#    node's $RUN_DIR/readbacks/<hostname>/. Copy that folder as it is INTO $RUN_DIR/readbacks/ here",
        "#    (not into readbacks/<hostname>/: the validator reads one host level), and the node's",
        f"#    $RUN_DIR/{RECORDS_DIR}/ files into $RUN_DIR/{RECORDS_DIR}/<hostname>/ here; for example:",
        *("#      " + line for line in COPY_FROM_NODES),
        "#    then:",
        'rlk-validate import-vime "$RUN_DIR" "$RUN_DIR.rlk"',
        'rlk-validate "$RUN_DIR.rlk" --seal' + (" --require-bitwise" if doc["require_exact"] else ""),
    ]
    return "\n".join(lines) + "\n"


def _args_line(args: Sequence[str]) -> str:
    """One group of arguments on one line, each option with its values."""
    return " ".join(_q(a) for a in args)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m rlk_repro.vime record RUN_DIR``: see :mod:`rlk_repro.vime_record`."""
    from rlk_repro import vime_record

    return vime_record.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
