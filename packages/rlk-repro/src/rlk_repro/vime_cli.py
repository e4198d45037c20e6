"""The command line of ``rlk-repro plan --engine vime``: options, named profiles, required paths.

Nothing has a placeholder default that would only fail on the cluster: ``--model-path`` (the Hugging Face
checkpoint whose ``config.json`` gives the model arguments), ``--ref-load`` (its Megatron ``torch_dist``
conversion), ``--prompt-data`` and ``--vime-root`` are required — a missing one exits 2 naming every
missing one — and every path is resolved to an absolute one when planned (the launch record holds no
``$PWD``). ``--profile NAME`` (:data:`rlk_repro.vime_args.PROFILES`) sets defaults that options given on
the command line override.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from rlk_core import envs
from rlk_core.errors import RlkConfigError
from rlk_repro import vime, vime_args
from rlk_repro._args import positive_int

REQUIRED = (("model_path", "--model-path DIR (the Hugging Face checkpoint: config.json, tokenizer, weights)"),
            ("ref_load", "--ref-load DIR (its Megatron torch_dist conversion)"),
            ("prompt_data", "--prompt-data FILE (prompt/label JSONL)"),
            ("vime_root", "--vime-root DIR (the VIME checkout holding train.py)"))
PATHS = ("model_path", "ref_load", "prompt_data", "vime_root", "run_dir", "save_dir")


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of ``rlk-repro plan --engine vime`` (besides --mode and the per-module cases)."""
    d = vime.VimeConfig
    p.add_argument("--json", action="store_true", help="print the launch as JSON instead of a shell script")
    p.add_argument("--profile", choices=sorted(vime_args.PROFILES), default=None,
                   help="named defaults; options given here override them: "
                   + "; ".join(f"{k}: {v}" for k, v in vime_args.PROFILE_DOC.items()))
    p.add_argument("--run-id", default=None, help="run id (default: a new UTC time + 6 hex)")
    p.add_argument("--run-dir", default=None, help="artifact directory on the head node (default ./rlk-runs/<id>)")
    p.add_argument("--model-path", "--hf-checkpoint", dest="model_path", default=None,
                   help="REQUIRED: the Hugging Face checkpoint directory; its config.json gives the model arguments")
    p.add_argument("--ref-load", default=None, help="REQUIRED: the Megatron torch_dist checkpoint directory")
    p.add_argument("--prompt-data", default=None, help="REQUIRED: prompt/label JSONL")
    p.add_argument("--vime-root", default=None, help="REQUIRED: the VIME checkout (holds train.py)")
    p.add_argument("--ray-address", default=d.ray_address, help=f"Ray dashboard address ({d.ray_address})")
    p.add_argument("--rounds", type=positive_int, default=d.rounds, help=f"rollouts (--num-rollout) ({d.rounds})")
    p.add_argument("--prompts-per-round", type=positive_int, default=d.prompts_per_round,
                   help=f"--rollout-batch-size ({d.prompts_per_round})")
    p.add_argument("--samples-per-prompt", type=positive_int, default=d.samples_per_prompt,
                   help=f"--n-samples-per-prompt, the GRPO group size ({d.samples_per_prompt})")
    p.add_argument("--global-batch-size", type=positive_int, default=None, help="default: all samples of a round")
    p.add_argument("--max-new-tokens", type=positive_int, default=d.max_new_tokens,
                   help=f"--rollout-max-response-len ({d.max_new_tokens})")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=d.max_prompt_tokens,
                   help=f"--rollout-max-prompt-len: longer prompts are dropped ({d.max_prompt_tokens})")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling and trainer temperature (1.0)")
    p.add_argument("--top-p", type=float, default=d.top_p,
                   help="top-p (1.0; < 1 with logp P/R needs --unfiltered-logprobs; R/R computes processed log-probs)")
    p.add_argument("--top-k", type=int, default=d.top_k,
                   help="top-k, 0 = off (0; > 0 with logp P/R needs --unfiltered-logprobs)")
    p.add_argument("--unfiltered-logprobs", action="store_true",
                   help="logp R: accept top-p/top-k and return the unfiltered log softmax(logits / T)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"training seed ({d.seed})")
    p.add_argument("--rollout-seed", type=int, default=d.rollout_seed, help=f"rollout seed ({d.rollout_seed})")
    p.add_argument("--tensor-parallel", type=positive_int, default=d.tensor_parallel,
                   help="training TP (--tensor-model-parallel-size) (1)")
    p.add_argument("--context-parallel", type=positive_int, default=d.context_parallel,
                   help="training CP (--context-parallel-size) (1)")
    p.add_argument("--rollout-tensor-parallel", type=positive_int, default=d.rollout_tensor_parallel,
                   help="vLLM TP per engine (--rollout-num-gpus-per-engine) (1)")
    from rlk_repro.tp_options import VAR, _leaves

    p.add_argument("--tp-invariant", type=_leaves, default=None, metavar="G",
                   help=f"TP-invariant mode for both sides: on (G = 8), off, or G; exported as {VAR} (default: "
                   f"{VAR} from the environment, else off); needed where --tensor-parallel != "
                   "--rollout-tensor-parallel")
    p.add_argument("--nodes", type=positive_int, default=d.nodes, help="training nodes (--actor-num-nodes) (1)")
    p.add_argument("--gpus-per-node", type=positive_int, default=d.gpus_per_node,
                   help=f"--actor-num-gpus-per-node ({d.gpus_per_node})")
    p.add_argument("--rollout-gpus", type=positive_int, default=None, help="--rollout-num-gpus (default: colocated)")
    p.add_argument("--colocate", action=argparse.BooleanOptionalAction, default=d.colocate,
                   help="rollout engines share the training GPUs (default yes)")
    p.add_argument("--keep-actor-resident", action=argparse.BooleanOptionalAction, default=d.keep_actor_resident,
                   help="colocated: keep the Megatron actor on the GPUs and offload the rollout engines while training")
    p.add_argument("--recompute", action=argparse.BooleanOptionalAction, default=d.recompute,
                   help="full uniform activation recomputation, 1 layer per checkpoint")
    p.add_argument("--cuda-graph-decode", action=argparse.BooleanOptionalAction, default=d.cuda_graph_decode,
                   help="vLLM CUDA graphs FULL_DECODE_ONLY, captured for every batch size of a round")
    g = p.add_argument_group("optimizer and batching (Adam, constant learning rate)")
    g.add_argument("--lr", type=float, default=d.lr, help=f"learning rate ({d.lr})")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay, help=f"({d.weight_decay})")
    g.add_argument("--adam-beta1", type=float, default=d.adam_beta1, help=f"({d.adam_beta1})")
    g.add_argument("--adam-beta2", type=float, default=d.adam_beta2, help=f"({d.adam_beta2})")
    g.add_argument("--clip-grad", type=float, default=d.clip_grad, help=f"gradient-norm clip ({d.clip_grad})")
    g.add_argument("--max-tokens-per-gpu", type=positive_int, default=None,
                   help="dynamic micro-batching token budget (default: (max prompt + response tokens) / CP)")
    g = p.add_argument_group("checkpoints (a relaunch of the same script continues from the last one)")
    g.add_argument("--save-dir", default=None, help="--save and --load (default RUN_DIR/checkpoints)")
    g.add_argument("--save-interval", type=positive_int, default=None,
                   help="rounds between checkpoints (default: the rounds, at most 50)")
    g = p.add_argument_group("rlk hooks")
    g.add_argument("--tis-function", default=None, metavar="MODULE.FN",
                   help="your own TIS/MIS function (what you would pass to --custom-tis-function-path): rlk's "
                   "log-prob recorder takes that flag and calls yours after recording (also taken from --extra)")
    g.add_argument("--linear-logp-abi", action="store_true",
                   help="your VIME has the linear-logp provider ABI (--linear-logp-provider; the RL-Align/vime "
                   "fork): required for logp R on the train side")
    p.add_argument("--audit", action="store_true", help="RL_KERNEL_MODE=audit (default strict)")
    p.add_argument("--extra", action="append", default=[], metavar="ARGS",
                   help="more train.py arguments, passed as given (repeatable; split like a shell); a flag VIME "
                   "does not accept is named on stderr")


def parse(p: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``argv``; a ``--profile``'s values are the defaults the other options override."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--profile", default=None)
    known, _ = pre.parse_known_args(list(argv))
    if known.profile in vime_args.PROFILES:
        p.set_defaults(**vime_args.PROFILES[known.profile])
    return p.parse_args(list(argv))


def _absolute(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _extra(a: argparse.Namespace) -> tuple[list[str], str | None]:
    """The ``--extra`` arguments, and the user's TIS function lifted out of them (rlk's recorder calls it)."""
    tokens = [x for e in a.extra for x in shlex.split(e)]
    tis = a.tis_function
    out, i = [], 0
    while i < len(tokens):
        tok = tokens[i]
        name, eq, value = tok.partition("=")
        if name == "--custom-tis-function-path":
            if not eq:
                if i + 1 >= len(tokens):
                    raise RlkConfigError("--extra: --custom-tis-function-path needs a value")
                value, i = tokens[i + 1], i + 1
            if tis is not None and tis != value:
                raise RlkConfigError(f"--tis-function {tis} and --extra --custom-tis-function-path {value} differ")
            tis = value
        else:
            out.append(tok)
        i += 1
    return out, tis


def config_from_args(a: argparse.Namespace, resolved: Any, readback_mode: str) -> vime.VimeConfig:
    missing = [text for name, text in REQUIRED if not getattr(a, name)]
    if missing:
        raise RlkConfigError("plan --engine vime needs " + "; ".join(missing) + " (no defaults: a placeholder "
                             "path would only fail on the cluster)")
    from rlk_repro.runs import new_run_id

    run_id = a.run_id or new_run_id()
    paths = {name: _absolute(getattr(a, name)) for name in PATHS if getattr(a, name, None)}
    paths.setdefault("run_dir", _absolute(os.path.join("rlk-runs", run_id)))
    model, info = vime_args.model_args(paths["model_path"])
    extra, tis = _extra(a)
    cfg = vime.VimeConfig(
        plan=resolved.plan.as_dict(), plan_sources=dict(resolved.sources), readback_mode=readback_mode,
        run_id=run_id, profile=a.profile, model_args=tuple(model), model_info=info,
        ray_address=a.ray_address, rounds=a.rounds, prompts_per_round=a.prompts_per_round,
        samples_per_prompt=a.samples_per_prompt, global_batch_size=a.global_batch_size,
        max_new_tokens=a.max_new_tokens, max_prompt_tokens=a.max_prompt_tokens, temperature=a.temperature,
        top_p=a.top_p, top_k=a.top_k, unfiltered_logprobs=a.unfiltered_logprobs, seed=a.seed,
        rollout_seed=a.rollout_seed, tensor_parallel=a.tensor_parallel, context_parallel=a.context_parallel,
        rollout_tensor_parallel=a.rollout_tensor_parallel,
        tp_invariant=a.tp_invariant if a.tp_invariant is not None else envs.get("RL_KERNEL_TP_INVARIANT"),
        nodes=a.nodes, gpus_per_node=a.gpus_per_node,
        rollout_gpus=a.rollout_gpus, colocate=a.colocate, keep_actor_resident=a.keep_actor_resident,
        recompute=a.recompute, cuda_graph_decode=a.cuda_graph_decode, lr=a.lr, weight_decay=a.weight_decay,
        adam_beta1=a.adam_beta1, adam_beta2=a.adam_beta2, clip_grad=a.clip_grad,
        max_tokens_per_gpu=a.max_tokens_per_gpu, save_interval=a.save_interval, tis_function=tis,
        linear_logp_abi=a.linear_logp_abi, extra_args=tuple(extra), **paths,
    )
    own = set(vime_args.flags_of([x for n, g in vime.flag_groups(cfg) if n != "extra" for x in g]))
    repeated = [f for f in vime_args.flags_of(extra) if f in own]
    if repeated:
        raise RlkConfigError(f"--extra repeats {', '.join(repeated)}, which the plan sets itself (use its option: "
                             "VIME would take the last one and the launch record would say another)")
    unknown = vime_args.unknown_flags(extra, cfg.linear_logp_abi)
    if unknown:
        print(f"rlk-repro plan: warning: --extra {' '.join(unknown)}: not among the flags VIME "
              f"{vime_args.VIME_COMMIT[:9]} accepts (data/vime-train-flags.txt); VIME drops unknown flags "
              "without a word", file=sys.stderr)
    return cfg


def plan_main(a: argparse.Namespace, argv: Sequence[str], resolved: Any, readback_mode: str) -> int:
    """``rlk-repro plan --engine vime``: print the launch (script, or JSON with ``--json``); 0."""
    cfg = config_from_args(a, resolved, readback_mode)
    doc = vime.launch(cfg, ["rlk-repro", *argv])
    absent = [f"--{n.replace('_', '-')} {getattr(cfg, n)}" for n in ("ref_load", "prompt_data", "vime_root")
              if not os.path.exists(getattr(cfg, n))]
    if absent:
        print(f"rlk-repro plan: note: not on this machine (the cluster's nodes must see them): {', '.join(absent)}",
              file=sys.stderr)
    print(json.dumps(doc, indent=2) if a.json else vime.script(doc), end="" if not a.json else "\n")
    return 0
