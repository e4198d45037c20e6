"""The parallel layout of a frameworks run: train TP and rollout TP, Megatron's sequence and context parallelism, and
TP-invariant mode (``RL_KERNEL_TP_INVARIANT``, contract ``rlk.gemm.tp.v1``; docs/ops/linear_tp.md).

``rlk-repro plan --engine frameworks --train-tp 4 --rollout-tp 1 --tp-invariant 8`` resolves and checks the layout
and prints it (the ``parallel`` section, the variable in ``env``), so that the multi-GPU runs of issue 39 can be
dry-run. The rule of the run (:func:`rlk_core.tp.check_tp_layout`): train TP != rollout TP without invariant mode is
refused in strict mode with the message that says what to set (audit mode plans it and records the problem); with
it, both TPs must be powers of two dividing G, and the model's row-parallel K and column components divisible by G.
The frameworks engine itself runs one TP for both sides, without SP or CP: a layout beyond that is planned here and
refused by ``run`` (:func:`engine_problem`) until the engine runs it (issue 39) — except **emulated** train TP
(``--train-tp 4 --emulate-train-tp``, rollout TP 1, invariant mode; ``--sequence-parallel`` allowed): one process,
Megatron built at TP 1 running the arithmetic of every rank of TP 4 (``RL_KERNEL_TP_EMULATE``,
``rlk_megatron_provider.tp_emulate``), recorded as such (``parallel.train_tp_emulated``) so that no reader takes it
for a real TP 4 run. ``--emulate-train-tp bi-control``: the negative control (the row-parallel linears split as
``rlk.gemm.bi.v1``, whose bits differ). Kept apart from ``cli.py``'s own options.
"""

from __future__ import annotations

import argparse
from typing import Any

from rlk_core import envs
from rlk_core.errors import RlkConfigError, RlkPolicyError
from rlk_core.tp import check_tp_layout
from rlk_repro._args import positive_int

VAR = "RL_KERNEL_TP_INVARIANT"
EMULATE_VAR = "RL_KERNEL_TP_EMULATE"
CONTRACT = "rlk.gemm.tp.v1"
NAMES = ("train_tp", "rollout_tp", "sequence_parallel", "context_parallel", "tp_invariant", "train_tp_emulated")
EMULATIONS = ("on", "bi-control")


def _leaves(value: str) -> int:
    """``--tp-invariant``: the variable's own spelling (``on`` = 8, ``off`` / ``0``, or G, a power of two >= 2)."""
    try:
        return envs.get(VAR, {VAR: value})
    except RlkConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_options(g: argparse._ArgumentGroup) -> None:
    """The layout options, in the ``--engine frameworks`` group."""
    g.add_argument("--train-tp", type=positive_int, default=None, metavar="N",
                   help="Megatron's tensor-parallel size where it differs from the rollout's (default: --tp)")
    g.add_argument("--rollout-tp", type=positive_int, default=None, metavar="M",
                   help="vLLM's tensor-parallel size where it differs from training's (default: --tp); a TP other "
                   f"than --train-tp needs TP-invariant mode ({VAR} / --tp-invariant)")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's --sequence-parallel (train TP > 1, TP-invariant mode: the same bits as without)")
    g.add_argument("--context-parallel", type=positive_int, default=1, metavar="C",
                   help="Megatron's context-parallel size (1); training takes train TP x C GPUs")
    g.add_argument("--emulate-train-tp", dest="train_tp_emulated", nargs="?", const="on", default=None,
                   choices=EMULATIONS,
                   help=f"run --train-tp on one GPU, emulated ({EMULATE_VAR}): Megatron built at TP 1 runs every "
                   "rank's shard with the rank's own launches and merges the partials in process (TP-invariant mode, "
                   "--rollout-tp 1; the arithmetic of every rank, not the transport). bi-control: the negative "
                   "control, the row-parallel linears split as rlk.gemm.bi.v1")
    g.add_argument("--tp-invariant", type=_leaves, default=None, metavar="G",
                   help=f"TP-invariant mode for both sides: on (G = 8), off, or G (a power of two >= 2); sets {VAR} "
                   f"for the run (default: {VAR} from the environment, else off)")


def config_kwargs(a: argparse.Namespace, frameworks: bool) -> dict[str, Any]:
    """The run configuration's layout fields; the local engine refuses the options, one line."""
    given = [n for n in NAMES if getattr(a, n, None) not in (None, False, 1)]
    if not frameworks:
        if given:
            raise RlkConfigError(f"--{given[0].replace('_', '-')} is an option of --engine frameworks")
        return {}
    if a.tp != 1 and (a.train_tp or a.rollout_tp):
        raise RlkConfigError(f"--tp {a.tp} sets both sides: give --train-tp and --rollout-tp instead")
    leaves = a.tp_invariant if a.tp_invariant is not None else envs.get(VAR)
    return {"train_tp": a.train_tp or a.tp, "rollout_tp": a.rollout_tp or a.tp,
            "sequence_parallel": a.sequence_parallel, "context_parallel": a.context_parallel, "tp_invariant": leaves,
            "train_tp_emulated": a.train_tp_emulated or "",
            "tp_invariant_source": ("flag --tp-invariant" if a.tp_invariant is not None
                                    else VAR if envs.get(VAR) else "default (off)")}


def model_problems(model_cfg, train_tp: int, rollout_tp: int, leaves: int) -> list[str]:
    """What the model's shape does not allow at these TPs and G (Megatron's and vLLM's divisibility rules; with G,
    the row-parallel K and every column component cut into G leaves)."""
    c = model_cfg
    out = []
    sizes = {"num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
             "intermediate_size": c.intermediate_size, "vocab_size": c.vocab_size}
    for side, tp in (("train", train_tp), ("rollout", rollout_tp)):
        bad = [f"{k}={v}" for k, v in sizes.items() if v % tp]
        if bad:
            out.append(f"{side} TP {tp} does not divide the model's {', '.join(bad)}")
    if leaves:
        comps = {"q (heads x head_dim)": c.num_attention_heads * c.head_dim,
                 "k / v (KV heads x head_dim)": c.num_key_value_heads * c.head_dim,
                 "intermediate_size": c.intermediate_size}
        bad = [f"{k}={v}" for k, v in comps.items() if v % leaves]
        if bad:
            out.append(f"{VAR}={leaves}: the model's {', '.join(bad)} not divisible by G (every row-parallel K and "
                       "column component is cut into G leaves)")
    return out


def model_config(cfg):
    """The run's model shape: its checkpoint's config.json, else the preset."""
    from rlk_repro.model.config import Qwen3Config, preset

    return Qwen3Config.from_dir(cfg.checkpoint) if cfg.checkpoint is not None else preset(cfg.model)


def apply_environment(cfg) -> None:
    """``run``: the run's G (and the emulation) in this process's environment (the plugin's and the provider's
    processes read it)."""
    import os

    os.environ.update(env(cfg))


def check(cfg, model_cfg=None) -> str | None:
    """The layout of a frameworks run, checked: raises :class:`RlkConfigError` for what cannot run in any mode and, in
    strict mode, for train TP != rollout TP without invariant mode (the rule's message says what to set); returns the
    layout problem audit mode records, or None."""
    leaves = cfg.tp_invariant
    for name in ("train_tp", "rollout_tp", "context_parallel"):
        if getattr(cfg, name) < 1:
            raise RlkConfigError(f"{name.replace('_', '-')} must be >= 1, got {getattr(cfg, name)}")
    if getattr(cfg, "train_tp_emulated", ""):
        _check_emulated(cfg)
    if cfg.sequence_parallel and cfg.train_tp == 1:
        raise RlkConfigError("--sequence-parallel shards the tokens over the training TP ranks: it needs "
                             "--train-tp > 1")
    if cfg.sequence_parallel and not leaves:
        raise RlkConfigError(f"--sequence-parallel is covered in TP-invariant mode only (the reduce-scatter of the "
                             f"rlk.gemm.tp.v1 tree): set {VAR}=8 on both sides (or --tp-invariant 8)")
    problems = model_problems(model_cfg or model_config(cfg), cfg.train_tp, cfg.rollout_tp, leaves)
    if problems:
        raise RlkConfigError("; ".join(problems))
    try:
        return check_tp_layout(cfg.train_tp, cfg.rollout_tp, env={VAR: str(leaves)}, mode=cfg.readback_mode)
    except RlkPolicyError as exc:
        raise RlkConfigError(str(exc)) from None


def _check_emulated(cfg) -> None:
    """``--emulate-train-tp``: a train TP > 1 emulated on one process, rollout TP 1, CP 1, in invariant mode."""
    t = cfg.train_tp
    if t < 2 or t & (t - 1):
        raise RlkConfigError(f"--emulate-train-tp emulates --train-tp on one GPU: give a power of two >= 2, not {t}")
    if not cfg.tp_invariant:
        raise RlkConfigError(f"--emulate-train-tp runs in TP-invariant mode only (emulated TP {t} differs from TP 1 "
                             f"otherwise): set {VAR}=8 on both sides (or --tp-invariant 8)")
    if cfg.tp_invariant % t:
        raise RlkConfigError(f"--emulate-train-tp: --train-tp {t} must divide G={cfg.tp_invariant}")
    if cfg.rollout_tp != 1 or cfg.context_parallel != 1:
        raise RlkConfigError(f"--emulate-train-tp runs in one process: --rollout-tp 1 and --context-parallel 1, not "
                             f"{cfg.rollout_tp} and {cfg.context_parallel}")


def emulated(cfg) -> dict[str, Any] | None:
    """The manifest's / plan's ``parallel.train_tp_emulated``: what ran (None: no emulation)."""
    kind = getattr(cfg, "train_tp_emulated", "")
    if not kind:
        return None
    return {"tp": cfg.train_tp, "sequence_parallel": cfg.sequence_parallel, "processes": 1, "real_train_tp": 1,
            "negative_control": kind == "bi-control", EMULATE_VAR: env(cfg)[EMULATE_VAR],
            "proves": "the arithmetic of every rank: its shards, kernel launches and shapes, and the rank tree of "
                      "the merge (in process)",
            "does_not_prove": "the transport (NCCL moving the fp32 partials between GPUs) and the multi-process "
                              "layout (issue 39)"}


def token_multiple(cfg) -> int:
    """What the Megatron side pads a packed batch's tokens to: the train TP under emulated sequence parallelism (the
    ranks' token shards), else 1."""
    return cfg.train_tp if getattr(cfg, "train_tp_emulated", "") and cfg.sequence_parallel else 1


def engine_problem(cfg) -> str | None:
    """What the frameworks engine cannot run of this layout today (``plan`` prints it, ``run`` refuses it)."""
    if getattr(cfg, "train_tp_emulated", ""):
        return None  # one process at real TP 1 (check() holds the rest)
    out = []
    if cfg.train_tp != cfg.rollout_tp:
        out.append(f"train TP {cfg.train_tp} with rollout TP {cfg.rollout_tp} (one TP for both sides today)")
    if cfg.sequence_parallel:
        out.append("Megatron's sequence parallelism")
    if cfg.context_parallel > 1:
        out.append(f"context parallelism {cfg.context_parallel}")
    if not out:
        return None
    return ("the frameworks engine does not run " + ", ".join(out) + " yet: `rlk-repro plan` checks and prints such a "
            "layout, its multi-GPU run is issue 39")


def env(cfg) -> dict[str, str]:
    """The variables both sides' processes need (exported by the run; printed by ``plan``)."""
    out = {VAR: str(cfg.tp_invariant)} if cfg.tp_invariant else {}
    kind = getattr(cfg, "train_tp_emulated", "")
    if kind:
        flags = (",sp" if cfg.sequence_parallel else "") + (",bi" if kind == "bi-control" else "")
        out[EMULATE_VAR] = f"{cfg.train_tp}{flags}"
    return out


def section(cfg, problem: str | None) -> dict[str, Any]:
    """``plan``'s ``parallel`` section."""
    leaves = cfg.tp_invariant
    return {
        "train": {"tp": cfg.train_tp, "cp": cfg.context_parallel, "sequence_parallel": cfg.sequence_parallel,
                  "gpus": cfg.train_tp * cfg.context_parallel},
        "rollout": {"tp": cfg.rollout_tp},
        "world": max(cfg.train_tp * cfg.context_parallel, cfg.rollout_tp),  # processes (GPUs), colocated
        "tp_invariant": {"on": bool(leaves), "leaves_total": leaves or None, "contract": CONTRACT if leaves else None,
                         "source": cfg.tp_invariant_source,
                         "leaves_per_rank": {"train": leaves // cfg.train_tp, "rollout": leaves // cfg.rollout_tp}
                         if leaves else None},
        "train_tp_emulated": emulated(cfg),
        "layout_problem": problem,
        "engine_problem": engine_problem(cfg),
    }
