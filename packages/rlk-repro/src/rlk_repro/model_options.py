"""The run options of issue 37 (a real model, prepared data, chat template, reward, stop tokens), shared by
``run``, ``plan`` and ``matrix``; kept apart from ``cli.py``'s own options."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from rlk_core.errors import RlkConfigError


def _json_object(value: str) -> dict[str, Any]:
    try:
        doc = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{value!r} is not JSON ({exc.msg})") from None
    if not isinstance(doc, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object")
    return doc


def add_options(r: argparse.ArgumentParser) -> None:
    g = r.add_argument_group("real model and data (local and frameworks engines)")
    g.add_argument("--workspace", metavar="W", default=None,
                   help="a workspace made by `rlk-repro prepare`: its prompt data (and converted checkpoint, unless "
                   "--model-path is given); run directories go to W/runs unless --output is given")
    g.add_argument("--model-path", metavar="DIR", default=None,
                   help="Hugging Face Qwen3 directory with config.json, *.safetensors and tokenizer files: its weights "
                   "and tokenizer (overrides --model; exclusive with --checkpoint)")
    g.add_argument("--prompt-data", metavar="JSONL", default=None,
                   help="VIME prompt/label JSONL (prepare's output, its sibling manifest checked); default: the "
                   "bundled toy prompts")
    g.add_argument("--input-key", default="prompt", help="JSONL key of the prompt (prompt)")
    g.add_argument("--label-key", default="label", help="JSONL key of the answer (label)")
    g.add_argument("--apply-chat-template", action="store_true",
                   help="render each prompt with the tokenizer's chat template (add_generation_prompt=True)")
    g.add_argument("--apply-chat-template-kwargs", type=_json_object, default=None, metavar="JSON",
                   help='extra chat-template variables, e.g. \'{"enable_thinking": false}\'')
    g.add_argument("--rm-type", choices=("deepscaler", "stand-in"), default=None,
                   help="reward: deepscaler (VIME's rule reward; default with --model-path) or stand-in (vocab_reward, "
                   "for random-weight models; the default without --model-path)")
    g.add_argument("--phase", choices=("short", "precision", "convergence"), default=None,
                   help="the seeds' phase: its rounds (8 / 30 / 200) and seed (--seed one of 1234 / 1234, 2345, 3456 "
                   "/ 1234; default its first)")
    g.add_argument("--phase-rounds", type=int, default=None, metavar="N",
                   help="with --phase: shorten the phase to N rounds, no fewer than its minimum (convergence: 100 of "
                   "200; short and precision are not shortened); the run records its rounds, report names the cut")
    g.add_argument("--pair", action="store_true",
                   help="with --phase (run only): every seed of the phase as a native (P/P) and a consistency (R/R) "
                   "run, seed by seed in the phase's order, into one phase root; `rlk-repro report ROOT` gives the "
                   "paired estimates (rlk_repro.phase_pairs)")
    g.add_argument("--rollout-stop-token-ids", type=int, nargs="+", default=None, metavar="ID",
                   help="stop tokens besides the config's, generation config's and tokenizer's EOS")


_NAMES = ("model_path", "prompt_data", "input_key", "label_key", "apply_chat_template", "apply_chat_template_kwargs",
          "rm_type", "rollout_stop_token_ids")


def config_kwargs(a: argparse.Namespace, argv: Sequence[str], frameworks: bool) -> dict[str, Any]:
    """The run configuration's fields from these options (``--workspace`` resolved, and ``--output`` defaulting to
    W/runs); the local and the frameworks engine take them alike (``frameworks`` is kept for the callers)."""
    if getattr(a, "workspace", None) is not None:
        from rlk_repro import workspace as ws

        if a.prompt_data is None:
            a.prompt_data = str(ws.data_path(a.workspace))
        if a.model_path is None and a.checkpoint is None:
            model = ws.model_path(a.workspace)
            a.model_path = str(model) if model is not None else None
        if hasattr(a, "output") and not any(x == "--output" or x.startswith("--output=") for x in argv):
            a.output = str(ws.paths(a.workspace)["runs"])
    if getattr(a, "pair", False):  # run takes it before here (rlk_repro.phase_pairs)
        raise RlkConfigError("--pair is an option of `rlk-repro run --phase P`")
    if getattr(a, "phase_rounds", None) is not None and getattr(a, "phase", None) is None:
        raise RlkConfigError("--phase-rounds shortens a phase: give --phase convergence")
    if getattr(a, "phase", None) is not None:
        from rlk_repro.phases import phase_settings

        rounds, seed = phase_settings(a.phase, a.seed if any(x == "--seed" or x.startswith("--seed=") for x in argv)
                                      else None, getattr(a, "phase_rounds", None))
        if any(x == "--rounds" or x.startswith("--rounds=") for x in argv) and a.rounds != rounds:
            raise RlkConfigError(f"--phase {a.phase} runs {rounds} rounds; --rounds {a.rounds} contradicts it")
        a.rounds, a.seed = rounds, seed
    return {"phase": a.phase, "model_path": a.model_path, "prompt_data": a.prompt_data, "input_key": a.input_key,
            "label_key": a.label_key, "apply_chat_template": a.apply_chat_template,
            "chat_template_kwargs": a.apply_chat_template_kwargs, "rm_type": a.rm_type,
            "stop_token_ids": a.rollout_stop_token_ids}
