"""The synthetic learning run's model directory (issue 37): a BPE tokenizer trained on the synthetic math set and a
randomly initialised Qwen3-shaped checkpoint over its vocabulary, in the Hugging Face layout ``--model-path`` reads
(``config.json``, ``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json`` with the chat template,
``generation_config.json``) plus ``rlk-checkpoint.json`` (the record ``doctor --workspace`` re-hashes).

Shapes (:data:`SHAPES`): ``synth-190m`` has the layer shape of Qwen3-0.6B (hidden 1024, FFN 3072, GQA 16 / 8, head
dim 128, tied LM head) with 12 of its 28 layers and the small vocabulary (~190M parameters): the GPU run;
``synth-tiny`` (hidden 64, 2 layers) is for CPU tests. The initialisation is for training from scratch, not the
random-weight presets' peaked logits: projections ~ N(0, 0.02^2), the output projections (attention ``o`` and FFN
``down``) scaled by 1 / sqrt(2 * layers), every norm gain 1.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError

SHAPES: dict[str, dict[str, Any]] = {
    "synth-190m": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128),
    "synth-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16),
}
#: the model's vocabulary is the tokenizer's rounded up to a multiple of this
VOCAB_MULTIPLE = 64
CHECKPOINT_RECORD = "rlk-checkpoint.json"


def corpus(rows: list[dict]) -> list[str]:
    """The tokenizer's training text: every row's question and worked solution."""
    return [m["content"] for r in rows for m in r["prompt"]] + [r["metadata"]["solution"] for r in rows]


def init_weights(cfg, seed: int):
    """fp32 weights for training from scratch (the module docstring's initialisation)."""
    import torch

    from rlk_repro.model.weights import expected_shapes

    g = torch.Generator().manual_seed(int(seed))
    out = {}
    out_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            out[name] = torch.ones(shape)
            continue
        std = 0.02 * (out_scale if name.endswith((".o", ".down")) else 1.0)
        out[name] = torch.randn(shape, generator=g) * std
    return out


def checkpoint_record(dest: Path, cfg, weights, **extra: Any) -> dict[str, Any]:
    """Write and return ``dest/rlk-checkpoint.json`` (rlk.checkpoint.v1, as prepare writes it)."""
    from rlk_repro import runs
    from rlk_repro.model.weights import weights_sha256
    from rlk_repro.prepare import CHECKPOINT_SCHEMA, TOKENIZER_FILES

    record = {"schema": CHECKPOINT_SCHEMA, "source": None, "path": None, "tensors": len(weights),
              "round_trip": "not applicable (written here)", "weights_sha256": weights_sha256(weights),
              "model_safetensors_sha256": runs.file_sha256(dest / "model.safetensors"),
              "tokenizer_files": [n for n in TOKENIZER_FILES if (dest / n).is_file()],
              "parameters": sum(int(t.numel()) for t in weights.values()), "model_config": cfg.as_dict(), **extra}
    runs.write_json_atomic(dest / CHECKPOINT_RECORD, record)
    return record


def write_model(dest: Path, rows: list[dict], shape: str, seed: int, vocab_size: int) -> dict[str, Any]:
    """Tokenizer (trained on ``rows``, at most ``vocab_size`` tokens) and random checkpoint into ``dest``."""
    import shutil

    from rlk_repro.model.config import Qwen3Config
    from rlk_repro.model.tokenizer_build import train_bpe, write_tokenizer
    from rlk_repro.model.weights import save_checkpoint

    if shape not in SHAPES:
        raise RlkConfigError(f"--shape {shape!r} is not one of {', '.join(SHAPES)}")
    if dest.exists():
        shutil.rmtree(dest)
    tok = train_bpe(corpus(rows), vocab_size, split_digits=True)
    ids = write_tokenizer(dest, tok)
    vocab = -(-tok.get_vocab_size() // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    cfg = Qwen3Config(vocab_size=vocab, **SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=ids["eos"])
    weights = init_weights(cfg, seed)
    save_checkpoint(dest, cfg, weights)
    return checkpoint_record(dest, cfg, weights, kind="synthetic random init", shape=shape, seed=seed,
                             tokenizer_vocab=tok.get_vocab_size())
