"""Train a small byte-level BPE tokenizer with ``tokenizers`` and write it as a Hugging Face model directory's
tokenizer files, with a ChatML chat template (issue 37): what the tests' model fixture and the synthetic learning
run (:mod:`rlk_repro.synthmodel`) read through :class:`~rlk_repro.model.tokenizer.HFTokenizer`.

Files: ``tokenizer.json``; ``tokenizer_config.json`` (:data:`CHAT_TEMPLATE`, ``eos_token`` ``<|im_end|>``,
``pad_token`` ``<|endoftext|>``, no BOS); ``generation_config.json`` (EOS ids: ``<|im_end|>`` and
``<|endoftext|>``). The special tokens (:data:`SPECIALS`) are single tokens, ``<think>`` / ``</think>`` among them.
``split_digits`` splits every digit into its own token before the byte-level step (as Qwen's tokenizers do), so
numbers are read digit by digit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from rlk_core.errors import RlkConfigError

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"


def train_bpe(corpus: Iterable[str], vocab_size: int, *, split_digits: bool = False):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``corpus`` (at most ``vocab_size`` tokens, the byte
    alphabet and :data:`SPECIALS` included)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise RlkConfigError("training a tokenizer needs the tokenizers package: pip install "
                             "'rlk-repro[tokenizer]'") from None
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if split_digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return tok


def write_tokenizer(path: Path, tok) -> dict[str, int]:
    """``tok``'s files into ``path`` (created); returns the ids of the EOS and pad tokens."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    eos, pad = tok.token_to_id(EOS), tok.token_to_id(PAD)
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHAT_TEMPLATE, "eos_token": EOS, "pad_token": PAD, "bos_token": None}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, pad]}))
    return {"eos": eos, "pad": pad}
