"""The bundled prompt set, a byte-level tokenizer and the rule reward.

Prompts are short arithmetic questions of mixed lengths (``rlk_repro/data/prompts.jsonl``). Tokens
``0..255`` are bytes; the model config supplies BOS (optional) and EOS. The reward is
``1.0 * (answer appears in the response) + 0.5 * digit_fraction + 0.5 * printable_fraction``: the
shaping terms vary between samples of one group even for a random-weight model, so group-normalised
advantages are non-zero and every round changes the weights.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib import resources


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    answer: str


def prompts_bytes() -> bytes:
    return resources.files("rlk_repro").joinpath("data/prompts.jsonl").read_bytes()


def load_prompts() -> list[Prompt]:
    out = []
    for line in prompts_bytes().decode("utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            out.append(Prompt(row["id"], row["prompt"], row["answer"]))
    return out


def prompts_sha256() -> str:
    return "sha256:" + hashlib.sha256(prompts_bytes()).hexdigest()


def encode(text: str, bos_token_id: int | None) -> list[int]:
    ids = list(text.encode("utf-8"))
    return ([bos_token_id] if bos_token_id is not None else []) + ids


def decode(ids: list[int]) -> str:
    return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


def reward(response: list[int], answer: str) -> float:
    if not response:
        return 0.0
    text = decode(response)
    digits = sum(1 for i in response if 48 <= i <= 57) / len(response)
    printable = sum(1 for i in response if 32 <= i <= 126) / len(response)
    return (1.0 if answer in text else 0.0) + 0.5 * digits + 0.5 * printable


def vocab_reward(response: list[int], answer: str, vocab_size: int) -> float:
    """:func:`reward` plus ``0.5 * (fraction of response tokens with an id below vocab_size / 2)``: a term
    that varies between samples of one group for any vocabulary (a random-weight model with a large
    vocabulary almost never samples byte tokens, so :func:`reward` alone would be constant and every
    advantage zero). Used by ``--engine frameworks``."""
    if not response:
        return 0.0
    low = sum(1 for i in response if i < vocab_size // 2) / len(response)
    return reward(response, answer) + 0.5 * low
