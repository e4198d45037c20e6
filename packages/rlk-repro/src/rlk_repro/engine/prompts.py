"""The prompts, tokenizer, stop tokens and reward of a local run (issue 37).

Two kinds of run:

- **stand-in** (the default: a random-weight preset, or ``--checkpoint`` without tokenizer): the bundled toy
  prompts, byte tokens and the stand-in reward :func:`~rlk_repro.engine.data.stand_in_reward` (graded: it does not
  saturate while the policy has entropy);
- **real** (``--model-path DIR``: config, safetensors and tokenizer files): the model's tokenizer, prompts from
  ``--prompt-data FILE.jsonl`` (VIME's JSONL, ``--input-key`` / ``--label-key``; the bundled prompts without it),
  ``--apply-chat-template``, the stop tokens of :meth:`~rlk_repro.model.tokenizer.HFTokenizer.stop_token_ids` and
  the deepscaler rule reward (:mod:`rlk_repro.deepscaler`) on the decoded response (``--rm-type`` chooses).

:func:`claims` says whether a run may back an experiment or reward claim: only with real weights, the deepscaler
reward and prepared data whose manifest says ``experiment``; every other run records why not, and every report
repeats it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro.engine.data import STAND_IN_REWARD, Prompt, encode, load_prompts, prompts_bytes, stand_in_reward

RM_TYPES = ("deepscaler", "stand-in")


@dataclass
class PromptSet:
    prompts: list[Prompt]
    encoded: list[list[int]]
    sha256: str
    reward: Callable[[list[int], str], float]
    stop_token_ids: list[int]
    rm_type: str
    data: dict[str, Any] | None = None  # the prepared data's manifest facts (None: the bundled prompts)
    tokenizer: str = "bytes"
    notes: list[str] = field(default_factory=list)


def _rows(path: Path, input_key: str, label_key: str) -> list[tuple[str, Any, str]]:
    out = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise RlkConfigError(f"--prompt-data {path}: {exc.strerror or exc}") from None
    for n, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RlkConfigError(f"{path} line {n + 1} is not JSON: {exc}") from None
        if input_key not in row or label_key not in row:
            raise RlkConfigError(f"{path} line {n + 1} has no {input_key!r} / {label_key!r} "
                                 f"(keys: {', '.join(row)}); set --input-key / --label-key")
        meta = row.get("metadata") if isinstance(row.get("metadata"), dict) else {}
        out.append((str(meta.get("index", n)), row[input_key], str(row[label_key])))
    if not out:
        raise RlkConfigError(f"--prompt-data {path} holds no rows")
    return out


def _text(prompt: Any, tok, apply_chat_template: bool, kwargs: dict[str, Any], where: str) -> str:
    if apply_chat_template:
        if tok is None:
            raise RlkConfigError("--apply-chat-template needs a tokenizer: --model-path DIR with tokenizer files")
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    if not isinstance(prompt, str):
        raise RlkConfigError(f"{where}: the prompt is a chat list; pass --apply-chat-template")
    return prompt


def load_prompt_set(cfg, model_cfg) -> PromptSet:
    """What ``cfg`` (a :class:`~rlk_repro.engine.local.LocalRunConfig`) asks for; one-line errors before any work."""
    from rlk_repro.deepscaler import reward as deepscaler_reward
    from rlk_repro.model.tokenizer import HFTokenizer
    from rlk_repro.workspace import read_data_manifest

    tok = HFTokenizer(cfg.model_path) if cfg.model_path else None
    rm_type = cfg.rm_type or ("deepscaler" if tok is not None else "stand-in")
    if rm_type not in RM_TYPES:
        raise RlkConfigError(f"--rm-type {rm_type!r} is not one of {', '.join(RM_TYPES)}")
    if tok is not None and tok.vocab_size > model_cfg.vocab_size:
        raise RlkConfigError(f"{cfg.model_path}: the tokenizer has {tok.vocab_size} tokens, the model's vocabulary "
                             f"{model_cfg.vocab_size}")
    data = None
    if cfg.prompt_data:
        path = Path(cfg.prompt_data)
        data = read_data_manifest(path)
        raw = path.read_bytes()
        rows = _rows(path, cfg.input_key, cfg.label_key)
    else:
        raw = prompts_bytes()
        rows = [(p.id, p.text, p.answer) for p in load_prompts()]
    kwargs = dict(cfg.chat_template_kwargs or {})
    prompts, encoded = [], []
    for pid, prompt, label in rows:
        text = _text(prompt, tok, cfg.apply_chat_template, kwargs, f"prompt {pid}")
        prompts.append(Prompt(pid, text, label))
        encoded.append(tok.encode(text) if tok is not None else encode(text, model_cfg.bos_token_id))
    sha = "sha256:" + hashlib.sha256(raw).hexdigest()
    if cfg.apply_chat_template or tok is not None:  # what the model sees depends on the template and tokenizer too
        sha = "sha256:" + hashlib.sha256(json.dumps(encoded).encode()).hexdigest()
    if tok is not None:
        stop = tok.stop_token_ids(model_cfg.eos_token_id, cfg.stop_token_ids or ())
        decode = tok.decode
    else:
        stop = sorted({model_cfg.eos_token_id, *(cfg.stop_token_ids or ())})
        from rlk_repro.engine.data import decode
    if rm_type == "deepscaler":
        def reward(ids: list[int], answer: str) -> float:
            return float(deepscaler_reward(decode(ids), answer))
    else:
        reward = stand_in_reward
    facts = None
    if data is not None:
        facts = {"path": str(Path(cfg.prompt_data).resolve()), "sha256": data["output"]["sha256"],
                 "rows": data["output"]["rows"], "purpose": data["purpose"], "purpose_reason": data["purpose_reason"],
                 "source_sha256": data["source"]["sha256"]}
    elif cfg.prompt_data:
        facts = {"path": str(Path(cfg.prompt_data).resolve()), "sha256": "sha256:" + hashlib.sha256(raw).hexdigest(),
                 "rows": len(rows), "purpose": None, "purpose_reason": "no prepare manifest beside the file"}
    return PromptSet(prompts, encoded, sha, reward, stop, rm_type, facts,
                     tokenizer=str(Path(cfg.model_path).resolve() / "tokenizer.json") if tok is not None else "bytes")


def claims(cfg, ps: PromptSet) -> dict[str, Any]:
    """Whether the run may back an experiment / reward claim, and every reason it may not."""
    reasons = []
    if not cfg.model_path and not cfg.checkpoint:
        reasons.append(f"random-weight model (preset {cfg.model})")
    if ps.rm_type != "deepscaler":
        reasons.append(f"stand-in reward ({STAND_IN_REWARD}), not the deepscaler rule")
    if ps.data is None:
        reasons.append("the bundled toy prompts (a developer fixture)")
    elif ps.data["purpose"] != "experiment":
        reasons.append(f"prompt data is not an experiment set: {ps.data['purpose'] or 'unprepared'} "
                       f"({ps.data['purpose_reason']})")
    return {"experiment": not reasons, "reasons": reasons}


def reward_name(rm_type: str) -> str:
    """The reward function a run used, by name (the manifest's ``reward.name``; a run without it used
    ``vocab_reward`` as its stand-in)."""
    return STAND_IN_REWARD if rm_type == "stand-in" else "deepscaler"


def manifest_facts(cfg, ps: PromptSet) -> dict[str, Any]:
    """The manifest's ``claims``, ``model``, ``data`` and ``reward`` blocks of a run (local or frameworks engine)."""
    real = cfg.model_path or cfg.checkpoint
    return {"claims": claims(cfg, ps),
            "model": {"kind": "checkpoint" if real else "random-weight preset", "path": real,
                      "preset": None if real else cfg.model, "tokenizer": ps.tokenizer},
            "data": ps.data,
            "reward": {"rm_type": ps.rm_type, "name": reward_name(ps.rm_type), "stop_token_ids": ps.stop_token_ids,
                       "apply_chat_template": cfg.apply_chat_template}}
