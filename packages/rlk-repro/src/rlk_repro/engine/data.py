"""The bundled prompt set, a byte-level tokenizer and the rule reward.

Prompts are short arithmetic questions of mixed lengths (``rlk_repro/data/prompts.jsonl``). Tokens
``0..255`` are bytes; the model config supplies BOS (optional) and EOS. The reward is
``1.0 * (answer appears in the response) + 0.5 * digit_fraction + 0.5 * printable_fraction``.

The stand-in reward of a random-weight run, :func:`stand_in_reward` (:data:`STAND_IN_REWARD`), adds a term graded on
a continuous quantity: the mean over the response of a fixed pseudo-random score in ``[0, 1)`` of each token id
(:func:`token_score`). Its ceiling is reached only when every sample is the single best-scoring token over and over,
a collapsed policy; short of that, two samples of a group with different tokens differ in reward, so the
group-normalised advantages stay non-zero round after round. The earlier :func:`vocab_reward` (a 0/1 term: a token
id in the lower half of the vocabulary) reached its ceiling 0.5 with the policy still spread over half the
vocabulary: by round 2 of a 10-round 0.6B-shape frameworks run every advantage was 0 (issue 41, item 13).
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


#: the name the manifest records for :func:`stand_in_reward` (``reward.name``); runs before it used ``vocab_reward``
STAND_IN_REWARD = "stand-in.token-score.v1"
_GOLDEN = 0x9E3779B1  # 2^32 / golden ratio, odd: a multiplicative hash that spreads consecutive ids over [0, 1)


def token_score(token_id: int) -> float:
    """A fixed score in ``[0, 1)`` of a token id: ``((id * 0x9E3779B1) mod 2^32) / 2^32`` (the same on every
    machine; consecutive ids land far apart, so the high scorers are spread over the whole vocabulary)."""
    return ((token_id * _GOLDEN) & 0xFFFFFFFF) / 2.0**32


def stand_in_reward(response: list[int], answer: str) -> float:
    """:func:`reward` plus ``0.5 * mean(token_score)`` over the response: graded, it has no ceiling short of a
    collapsed policy (the module docstring). The stand-in reward of random-weight runs, both engines."""
    if not response:
        return 0.0
    return reward(response, answer) + 0.5 * sum(token_score(i) for i in response) / len(response)


def vocab_reward(response: list[int], answer: str, vocab_size: int) -> float:
    """:func:`reward` plus ``0.5 * (fraction of response tokens with an id below vocab_size / 2)``: a term
    that varies between samples of one group for any vocabulary (a random-weight model with a large
    vocabulary almost never samples byte tokens, so :func:`reward` alone would be constant and every
    advantage zero). The stand-in reward before :func:`stand_in_reward`: kept to describe and test the runs made with
    it (it saturates, module docstring)."""
    if not response:
        return 0.0
    low = sum(1 for i in response if i < vocab_size // 2) / len(response)
    return reward(response, answer) + 0.5 * low
