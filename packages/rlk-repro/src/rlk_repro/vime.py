"""``rlk-repro plan --engine vime``: the launch of a VIME/slime cluster run with rlk's routes.

VIME (Ray + vLLM + Megatron) runs on the user's cluster, not here: this module only *prints* the launch
— a shell script a user can paste, or (``--json``) the same as a document — and records the
environment of the head node when that script runs (``python -m rlk_repro.vime record ...``). It never
imports torch, Ray, vLLM or Megatron.

What the launch carries, per route plan (facts from ``shared/reference/slime-vime.md``):

- the train side: ``--custom-megatron-init-path`` (plan, readback, slime binding; always, so that P
  modules are recorded too), the layer spec and ``--transformer-impl local`` where a train letter is R,
  the strict linear-logp provider where logp's train letter is R, and the log-prob record hook
  (``--get-mismatch-metrics --custom-tis-function-path``) that writes ``logprob-records/``;
- the rollout side: ``--vllm-attention-backend CUSTOM`` where attention's rollout letter is R,
  ``--vllm-enable-deterministic-inference`` wherever a plan routes anything to rlk (the native control
  stays what users run today); temperature / top-p / top-k that keep vLLM's processed log-probs equal
  to the trainer's where logp's rollout letter is R (top-p 1, top-k off) unless the user opts in to
  unfiltered log-probs;
- the environment (``RL_KERNEL_*``) both exported and forwarded through Ray's runtime env
  (``ray job submit --runtime-env-json '{"env_vars": {...}}'``): Ray workers do not inherit the
  launcher's environment, and without it every R side silently runs production code;
- for an all-R/R plan, slime's exact-equality gate ``--ci-test
  --ci-train-rollout-logprob-abs-diff-threshold 0``.

The other packages' entry points are named once, in :data:`ENTRY_POINTS`.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro._args import positive_int
from rlk_validate.evidence import VIME_ENVIRONMENT_SCHEMA, VIME_LAUNCH_SCHEMA

#: Every name this launch uses from rlk-megatron-provider and rlk-vllm-plugin (align here, nowhere else).
ENTRY_POINTS: dict[str, Any] = {
    # --custom-megatron-init-path: fn(args) at the end of Megatron init, in every training process
    "megatron_init": "rlk_megatron_provider.install",
    # --spec MODULE FN: slime calls FN(args, config, vp_stage) and takes the layer spec it returns
    "megatron_spec": ("rlk_megatron_provider", "slime_spec"),
    # --linear-logp-provider: VIME's training log-prob provider ABI
    "linear_logp_provider": "rlk_megatron_provider.linear_logp",
    # --custom-tis-function-path (with --get-mismatch-metrics): writes logprob-records/, returns pg_loss as is
    "logprob_recorder": "rlk_megatron_provider.record_logprobs",
    # vllm.general_plugins entry point name (a deployment that sets VLLM_PLUGINS must list it)
    "vllm_plugin": "rlk",
    # the vLLM attention backend the plugin registers
    "vllm_attention_backend": "CUSTOM",
    # the plugin's opt-in variable for unfiltered log-probs (top-p < 1 / top-k > 0 with R logp)
    "vllm_unfiltered_logprobs_var": "RL_KERNEL_VLLM_UNFILTERED_LOGPROBS",
    # the variable the record hook writes into
    "logprob_records_var": "RL_KERNEL_LOGPROB_RECORDS_DIR",
}
LAUNCH_SCHEMA = VIME_LAUNCH_SCHEMA
LAUNCH_FILE = "rlk-launch.json"
ENVIRONMENT_FILE = "environment.json"
RECORDS_DIR = "logprob-records"
#: the variables forwarded into every Ray worker (besides the plan's cases)
_FORWARDED = ("RL_KERNEL_MODE", "RL_KERNEL_READBACK_DIR", "RL_KERNEL_RUN_ID")


@dataclass(frozen=True)
class VimeConfig:
    """Options of one VIME run (what ``plan --engine vime`` accepts), validated by :func:`check`."""

    plan: dict[str, str]
    plan_sources: dict[str, str]
    readback_mode: str = "strict"
    run_id: str = "rlk-vime-run"
    run_dir: str = "$PWD/rlk-runs/rlk-vime-run"
    hf_checkpoint: str = "/models/Qwen3-8B"
    ref_load: str = "/models/Qwen3-8B_torch_dist"
    prompt_data: str = "/data/dapo-math-17k.jsonl"
    vime_root: str = "/opt/vime"
    ray_address: str = "http://127.0.0.1:8265"
    rounds: int = 5
    prompts_per_round: int = 1
    samples_per_prompt: int = 8
    global_batch_size: int | None = None
    max_new_tokens: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    unfiltered_logprobs: bool = False
    seed: int = 1234
    rollout_seed: int = 42
    tensor_parallel: int = 1
    context_parallel: int = 1
    rollout_tensor_parallel: int = 1
    nodes: int = 1
    gpus_per_node: int = 8
    rollout_gpus: int | None = None
    colocate: bool = True
    extra_args: tuple[str, ...] = field(default_factory=tuple)

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


def check(cfg: VimeConfig) -> None:
    """Raise :class:`RlkConfigError` (one line) for a combination VIME would run but that cannot hold."""
    if not 0 < cfg.top_p <= 1:
        raise RlkConfigError(f"--top-p {cfg.top_p} must be in (0, 1]")
    if cfg.top_k < 0:
        raise RlkConfigError(f"--top-k {cfg.top_k} must be >= 0 (0 = off)")
    if not cfg.temperature > 0:
        raise RlkConfigError(f"--temperature {cfg.temperature} must be > 0: the trainer's log-prob divides by it")
    filtered = cfg.top_p < 1 or cfg.top_k > 0
    if filtered and cfg.letter("logp", "rollout") == "R" and not cfg.unfiltered_logprobs:
        raise RlkConfigError(
            f"logp {cfg.plan['logp']} with --top-p {cfg.top_p} / --top-k {cfg.top_k}: vLLM's processed log-probs "
            "are renormalised over the kept tokens and differ from the trainer's by construction; use --top-p 1 "
            "--top-k 0, or --unfiltered-logprobs to accept the unfiltered log softmax(logits / T)")
    if cfg.unfiltered_logprobs and cfg.letter("logp", "rollout") != "R":
        raise RlkConfigError("--unfiltered-logprobs needs logp R on the rollout side (it is rlk's log-prob hook)")
    tp, cp = cfg.tensor_parallel, cfg.context_parallel
    if cfg.train_gpus % (tp * cp):
        raise RlkConfigError(f"training TP {tp} x CP {cp} does not divide {cfg.nodes} node(s) x "
                             f"{cfg.gpus_per_node} GPU(s)")
    rollout_gpus = cfg.rollout_gpus if cfg.rollout_gpus is not None else cfg.train_gpus
    if rollout_gpus % cfg.rollout_tensor_parallel:
        raise RlkConfigError(f"rollout TP {cfg.rollout_tensor_parallel} does not divide {rollout_gpus} rollout GPU(s)")
    if cfg.colocate and rollout_gpus != cfg.train_gpus:
        raise RlkConfigError(f"--colocate shares the {cfg.train_gpus} training GPUs; --rollout-gpus {rollout_gpus} "
                             "differs (use --no-colocate)")
    samples = cfg.prompts_per_round * cfg.samples_per_prompt
    gbs = cfg.global_batch_size or samples
    if samples % gbs:
        raise RlkConfigError(f"--global-batch-size {gbs} does not divide the {samples} samples of a round")
    for name in ("run_id",):
        value = getattr(cfg, name)
        if not value or "/" in value or not value.isprintable() or any(c.isspace() for c in value):
            raise RlkConfigError(f"--run-id {value!r}: no spaces or path separators")


def environment(cfg: VimeConfig) -> dict[str, str]:
    """Every ``RL_KERNEL_*`` variable the run's processes need (exported and forwarded to Ray)."""
    env = {f"RL_KERNEL_{m.upper()}_CASE": cfg.plan[m] for m in ("attention", "ffn", "logp")}
    env["RL_KERNEL_MODE"] = cfg.readback_mode
    env["RL_KERNEL_READBACK_DIR"] = f"{cfg.run_dir}/readbacks"
    env["RL_KERNEL_RUN_ID"] = cfg.run_id
    env[ENTRY_POINTS["logprob_records_var"]] = f"{cfg.run_dir}/{RECORDS_DIR}"
    if cfg.unfiltered_logprobs:
        env[ENTRY_POINTS["vllm_unfiltered_logprobs_var"]] = "1"
    return env


def runtime_env(cfg: VimeConfig) -> dict[str, Any]:
    """Ray's runtime env (``ray job submit --runtime-env-json``): the environment every worker gets."""
    return {"env_vars": environment(cfg)}


def _group(name: str, args: list[str]) -> tuple[str, list[str]]:
    return name, args


def flag_groups(cfg: VimeConfig) -> list[tuple[str, list[str]]]:
    """The arguments of VIME's ``train.py``, in named groups (each a flat argv list)."""
    samples = cfg.prompts_per_round * cfg.samples_per_prompt
    rollout_gpus = cfg.rollout_gpus if cfg.rollout_gpus is not None else cfg.train_gpus
    groups = [
        _group("cluster", ["--actor-num-nodes", str(cfg.nodes), "--actor-num-gpus-per-node", str(cfg.gpus_per_node),
                           "--rollout-num-gpus", str(rollout_gpus),
                           "--rollout-num-gpus-per-engine", str(cfg.rollout_tensor_parallel),
                           *(["--colocate"] if cfg.colocate else [])]),
        _group("model", ["--hf-checkpoint", cfg.hf_checkpoint, "--ref-load", cfg.ref_load]),
        _group("parallelism", ["--tensor-model-parallel-size", str(cfg.tensor_parallel),
                               "--context-parallel-size", str(cfg.context_parallel),
                               "--pipeline-model-parallel-size", "1"]),
        _group("rollout", ["--prompt-data", cfg.prompt_data, "--input-key", "prompt", "--label-key", "label",
                           "--apply-chat-template", "--rm-type", "deepscaler", "--advantage-estimator", "grpo",
                           "--num-rollout", str(cfg.rounds), "--rollout-batch-size", str(cfg.prompts_per_round),
                           "--n-samples-per-prompt", str(cfg.samples_per_prompt),
                           "--global-batch-size", str(cfg.global_batch_size or samples),
                           "--rollout-max-response-len", str(cfg.max_new_tokens)]),
        # the trainer divides by --rollout-temperature only: the sampling temperature is that same value
        _group("sampling", ["--rollout-temperature", repr(float(cfg.temperature)), "--rollout-top-p",
                            repr(float(cfg.top_p)), "--rollout-top-k", str(cfg.top_k if cfg.top_k > 0 else -1),
                            "--seed", str(cfg.seed), "--rollout-seed", str(cfg.rollout_seed),
                            "--attention-dropout", "0.0", "--hidden-dropout", "0.0"]),
    ]
    train = ["--custom-megatron-init-path", ENTRY_POINTS["megatron_init"]]
    if cfg.any_r("train"):
        module, fn = ENTRY_POINTS["megatron_spec"]
        train += ["--spec", module, fn, "--transformer-impl", "local"]
    if cfg.letter("logp", "train") == "R":
        train += ["--linear-logp-provider", ENTRY_POINTS["linear_logp_provider"],
                  "--linear-logp-provider-mode", "strict" if cfg.readback_mode == "strict" else "auto"]
    train += ["--get-mismatch-metrics", "--custom-tis-function-path", ENTRY_POINTS["logprob_recorder"]]
    groups.append(_group("rlk train side", train))
    rollout: list[str] = []
    if cfg.letter("attention", "rollout") == "R":
        rollout += ["--vllm-attention-backend", ENTRY_POINTS["vllm_attention_backend"]]
    if cfg.any_r():
        rollout += ["--vllm-enable-deterministic-inference"]
    groups.append(_group("rlk rollout side", rollout))
    if cfg.all_rr:
        groups.append(_group("exact gate", ["--ci-test", "--ci-train-rollout-logprob-abs-diff-threshold", "0"]))
    if cfg.extra_args:
        groups.append(_group("extra", list(cfg.extra_args)))
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
    samples = cfg.prompts_per_round * cfg.samples_per_prompt
    gbs = cfg.global_batch_size or samples
    return {
        "schema": LAUNCH_SCHEMA, "engine": "vime", "run_id": cfg.run_id, "run_dir": cfg.run_dir,
        "mode": cfg.mode, "plan": dict(cfg.plan), "plan_sources": dict(cfg.plan_sources),
        "readback_mode": cfg.readback_mode, "exact_required": cfg.all_rr, "command": list(command),
        "rounds": cfg.rounds, "steps_per_round": samples // gbs,
        "seeds": {"train": cfg.seed, "rollout": cfg.rollout_seed},
        "topology": {"nodes": cfg.nodes, "gpus_per_node": cfg.gpus_per_node, "tensor_parallel": cfg.tensor_parallel,
                     "context_parallel": cfg.context_parallel,
                     "data_parallel": cfg.train_gpus // (cfg.tensor_parallel * cfg.context_parallel),
                     "rollout_gpus": cfg.rollout_gpus if cfg.rollout_gpus is not None else cfg.train_gpus,
                     "rollout_tensor_parallel": cfg.rollout_tensor_parallel, "colocate": cfg.colocate},
        "sampling": {"temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": cfg.top_k,
                     "unfiltered_logprobs": cfg.unfiltered_logprobs},
        "env": environment(cfg), "runtime_env": runtime_env(cfg),
        "flags": {name: args for name, args in flag_groups(cfg)},
        "submit": submit_argv(cfg), "entry_points": {k: (list(v) if isinstance(v, tuple) else v)
                                                     for k, v in ENTRY_POINTS.items()},
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("plan", "plan_sources", "extra_args")}
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
    """Shell-quote, leaving ``$VAR`` / ``$PWD`` expandable in paths the user may point at variables."""
    if s.startswith("$") and all(c.isalnum() or c in "$_/.-{}" for c in s):
        return f'"{s}"'
    return shlex.quote(s)


def script(doc: Mapping[str, Any]) -> str:
    """The launch as a bash script a user can paste on the Ray head node."""
    env, run_dir = doc["env"], doc["run_dir"]
    lines = [
        "#!/usr/bin/env bash",
        f"# rlk VIME launch: plan {', '.join(f'{m} {c}' for m, c in doc['plan'].items())} ({doc['mode']}), "
        f"run {doc['run_id']}",
        "# Run on the Ray head node, in the Python environment of the Ray workers "
        "(rlk-vllm-plugin and rlk-megatron-provider installed).",
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
        f"--input prompts={_q(doc['config']['prompt_data'])} --input checkpoint={_q(doc['config']['hf_checkpoint'])}",
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
        'rlk-validate "$RUN_DIR.rlk" --seal' + (" --require-bitwise" if doc["exact_required"] else ""),
    ]
    return "\n".join(lines) + "\n"


def _args_line(args: Sequence[str]) -> str:
    """One group of arguments on one line, each option with its values."""
    return " ".join(_q(a) for a in args)


# -- the command line of `plan --engine vime` -----------------------------------------------------
def add_options(p: argparse.ArgumentParser) -> None:
    """The options of ``rlk-repro plan --engine vime`` (besides --mode and the per-module cases)."""
    p.add_argument("--json", action="store_true", help="print the launch as JSON instead of a shell script")
    p.add_argument("--run-id", default=None, help="run id (default: a new UTC time + 6 hex)")
    p.add_argument("--run-dir", default=None, help="artifact directory on the head node (default $PWD/rlk-runs/<id>)")
    p.add_argument("--hf-checkpoint", default=VimeConfig.hf_checkpoint, help="Hugging Face checkpoint directory")
    p.add_argument("--ref-load", default=VimeConfig.ref_load, help="Megatron torch_dist checkpoint directory")
    p.add_argument("--prompt-data", default=VimeConfig.prompt_data, help="prompt/label JSONL")
    p.add_argument("--vime-root", default=VimeConfig.vime_root, help="the VIME checkout (Ray working dir)")
    p.add_argument("--ray-address", default=VimeConfig.ray_address, help="Ray dashboard address")
    p.add_argument("--rounds", type=positive_int, default=VimeConfig.rounds, help="rollouts (--num-rollout)")
    p.add_argument("--prompts-per-round", type=positive_int, default=VimeConfig.prompts_per_round,
                   help="--rollout-batch-size")
    p.add_argument("--samples-per-prompt", type=positive_int, default=VimeConfig.samples_per_prompt,
                   help="--n-samples-per-prompt (GRPO group size)")
    p.add_argument("--global-batch-size", type=positive_int, default=None, help="default: all samples of a round")
    p.add_argument("--max-new-tokens", type=positive_int, default=VimeConfig.max_new_tokens,
                   help="--rollout-max-response-len")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling and trainer temperature (1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="top-p (1.0; < 1 with logp R needs --unfiltered-logprobs)")
    p.add_argument("--top-k", type=int, default=0,
                   help="top-k, 0 = off (0; > 0 with logp R needs --unfiltered-logprobs)")
    p.add_argument("--unfiltered-logprobs", action="store_true",
                   help="logp R: accept top-p/top-k and return the unfiltered log softmax(logits / T)")
    p.add_argument("--seed", type=int, default=1234, help="training seed (1234)")
    p.add_argument("--rollout-seed", type=int, default=42, help="rollout seed (42)")
    p.add_argument("--tensor-parallel", type=positive_int, default=1, help="training TP (--tensor-model-parallel-size)")
    p.add_argument("--context-parallel", type=positive_int, default=1, help="training CP (--context-parallel-size)")
    p.add_argument("--rollout-tensor-parallel", type=positive_int, default=1,
                   help="vLLM TP per engine (--rollout-num-gpus-per-engine)")
    p.add_argument("--nodes", type=positive_int, default=1, help="training nodes (--actor-num-nodes)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="--actor-num-gpus-per-node (8)")
    p.add_argument("--rollout-gpus", type=positive_int, default=None, help="--rollout-num-gpus (default: colocated)")
    p.add_argument("--no-colocate", dest="colocate", action="store_false", help="separate rollout GPUs")
    p.add_argument("--audit", action="store_true", help="RL_KERNEL_MODE=audit (default strict)")
    p.add_argument("--extra", action="append", default=[], metavar="ARGS",
                   help="more train.py arguments, passed as given (repeatable; split like a shell)")


def config_from_args(a: argparse.Namespace, resolved: Any, readback_mode: str) -> VimeConfig:
    from rlk_repro.runs import new_run_id

    run_id = a.run_id or new_run_id()
    return VimeConfig(
        plan=resolved.plan.as_dict(), plan_sources={m: s for m, s in resolved.sources.items()},
        readback_mode=readback_mode, run_id=run_id, run_dir=a.run_dir or f"$PWD/rlk-runs/{run_id}",
        hf_checkpoint=a.hf_checkpoint, ref_load=a.ref_load, prompt_data=a.prompt_data, vime_root=a.vime_root,
        ray_address=a.ray_address, rounds=a.rounds, prompts_per_round=a.prompts_per_round,
        samples_per_prompt=a.samples_per_prompt, global_batch_size=a.global_batch_size,
        max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        unfiltered_logprobs=a.unfiltered_logprobs, seed=a.seed, rollout_seed=a.rollout_seed,
        tensor_parallel=a.tensor_parallel, context_parallel=a.context_parallel,
        rollout_tensor_parallel=a.rollout_tensor_parallel, nodes=a.nodes, gpus_per_node=a.gpus_per_node,
        rollout_gpus=a.rollout_gpus, colocate=a.colocate,
        extra_args=tuple(x for e in a.extra for x in shlex.split(e)),
    )


def plan_main(a: argparse.Namespace, argv: Sequence[str], resolved: Any, readback_mode: str) -> int:
    """``rlk-repro plan --engine vime``: print the launch (script, or JSON with ``--json``); 0."""
    doc = launch(config_from_args(a, resolved, readback_mode), ["rlk-repro", *argv])
    print(json.dumps(doc, indent=2) if a.json else script(doc), end="" if not a.json else "\n")
    return 0


# -- `python -m rlk_repro.vime record RUN_DIR`: the head node's environment, at launch ---------------
def record_environment(run_dir: str, repos: Mapping[str, str], inputs: Mapping[str, str]) -> dict[str, Any]:
    """Repository SHAs and dirty state, package versions, GPUs and input hashes, for the manifest."""
    import hashlib
    import os
    import subprocess
    from importlib import metadata

    def git(path: str, *args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, check=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    def digest(path: str) -> str | None:
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
        if not files:
            return None
        outer = hashlib.sha256()
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
            outer.update(f"{os.path.relpath(f, path) if f != path else ''}\0{h.hexdigest()}\n".encode())
        return "sha256:" + outer.hexdigest()

    out_repos = []
    for name, path in repos.items():
        sha, status = git(path, "rev-parse", "HEAD"), git(path, "status", "--porcelain")
        out_repos.append({"name": name, "path": path, "sha": sha.strip() if sha else None,
                          "dirty": bool(status.strip()) if status is not None else None,
                          **({} if sha else {"error": "not a git checkout"})})
    packages = {}
    for dist in ("rlk-core", "rlk-collectives", "rlk-vllm-plugin", "rlk-megatron-provider", "rlk-validate",
                 "rlk-repro", "torch", "vllm", "megatron-core", "transformer-engine", "ray"):
        try:
            packages[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        smi = []
    hardware = {"device": "cuda" if smi else "unknown", "name": smi[0].split(",")[0].strip() if smi else None,
                "driver": smi[0].split(",")[1].strip() if smi and "," in smi[0] else None, "count": len(smi)}
    return {"schema": VIME_ENVIRONMENT_SCHEMA, "repos": out_repos, "packages": packages, "hardware": hardware,
            "inputs": {k: digest(v) for k, v in inputs.items()}}


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or not v:
            raise SystemExit(f"rlk_repro.vime record: --{what} {item!r} is not NAME=PATH")
        out[k] = v
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import os
    import sys

    p = argparse.ArgumentParser(prog="python -m rlk_repro.vime",
                                description="record RUN_DIR: write RUN_DIR/environment.json (run by the launch script)")
    p.add_argument("action", choices=("record",))
    p.add_argument("run_dir")
    p.add_argument("--repo", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--input", action="append", default=[], metavar="NAME=PATH")
    a = p.parse_args(argv)
    from rlk_validate.evidence import write_json_atomic

    repos = {"rlk": os.path.dirname(os.path.abspath(__file__)), **_pairs(a.repo, "repo")}
    doc = record_environment(a.run_dir, repos, _pairs(a.input, "input"))
    write_json_atomic(os.path.join(a.run_dir, ENVIRONMENT_FILE), doc, indent=1)
    print(f"wrote {os.path.join(a.run_dir, ENVIRONMENT_FILE)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
