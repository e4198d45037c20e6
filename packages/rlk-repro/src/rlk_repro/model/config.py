"""Qwen3 decoder configuration (dense, or Qwen3-MoE: every layer's FFN a mixture of experts): the Hugging Face
``config.json`` fields the model uses, and presets.

Presets ``tiny`` and ``small`` are random-weight models for CPU runs and tests (byte-level vocabulary
plus a few specials); ``qwen3-0.6b`` has the shape of Qwen/Qwen3-0.6B (random weights unless a
checkpoint directory is given). Random weights get a realistic logit scale (:data:`RANDOM_LOGIT_STD`): the
next-token distributions are peaked, their entropy well below ``log V`` (tiny: ~1.8 of 5.8 nats; the
0.6B shape: ~5 of 11.9), as a trained model's are; with the plain initialisation they were nearly uniform
(11.7 of 11.9 nats), where a sampler or temperature error hardly shows (issue 41).

MoE presets (issue 36): ``qwen3-moe-tiny`` (8 experts, top-2) for CPU runs and tests, and
``qwen3-moe-30b-a3b-L<n>``: the layer shape of Qwen/Qwen3-30B-A3B (hidden 2048, 128 experts, top-8, expert FFN
768, GQA 32/4, head dim 128, ``norm_topk_prob``) with ``n`` layers (the real model has 48), random weights
(:func:`preset`).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from rlk_core.errors import RlkConfigError


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 256
    eos_token_id: int = 257
    # Qwen3-MoE (``model_type`` ``qwen3_moe``): every layer's FFN is a mixture of ``num_experts`` SwiGLU experts of
    # width ``moe_intermediate_size``, ``num_experts_per_tok`` selected per token (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if int(getattr(self, name)) <= 0:
                raise RlkConfigError(f"model config {name} must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise RlkConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                                 f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise RlkConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise RlkConfigError(f"eos_token_id={self.eos_token_id} is outside the vocabulary [0, {self.vocab_size})")
        if self.num_experts < 0:
            raise RlkConfigError(f"num_experts must be >= 0 (0: dense), got {self.num_experts}")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise RlkConfigError(f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts = "
                                 f"{self.num_experts}]")
        if self.num_experts and self.moe_intermediate_size <= 0:
            raise RlkConfigError(f"moe_intermediate_size must be > 0 for an MoE model, got "
                                 f"{self.moe_intermediate_size}")

    @property
    def is_moe(self) -> bool:
        """Every layer's FFN is a mixture of experts (Qwen3-MoE)."""
        return self.num_experts > 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def as_dict(self) -> dict[str, Any]:
        """The fields (a dense model's without the MoE ones, as before they existed)."""
        d = asdict(self)
        if not self.is_moe:
            for name in _MOE_FIELDS:
                d.pop(name)
        return d

    @classmethod
    def from_hf(cls, data: dict[str, Any]) -> Qwen3Config:
        """Build from a Hugging Face Qwen3 ``config.json`` mapping: dense (``qwen3``) or MoE (``qwen3_moe``, every
        layer sparse: :func:`moe_fields_of`).

        Both RoPE layouts are read: ``rope_theta`` at the top level (transformers 4.x) or inside
        ``rope_parameters`` (transformers 5.x); see :func:`rope_theta_of`.
        """
        arch = data.get("model_type")
        if arch not in (None, "qwen3", "qwen3_moe"):
            raise RlkConfigError(f"config.json model_type is {arch!r}; the local engine runs 'qwen3' (dense) and "
                                 "'qwen3_moe' models")
        moe = moe_fields_of(data) if arch == "qwen3_moe" else {}
        eos = data.get("eos_token_id", 257)
        if isinstance(eos, list):
            eos = eos[0]
        try:
            return cls(
                vocab_size=int(data["vocab_size"]),
                hidden_size=int(data["hidden_size"]),
                intermediate_size=int(data["intermediate_size"]),
                num_hidden_layers=int(data["num_hidden_layers"]),
                num_attention_heads=int(data["num_attention_heads"]),
                num_key_value_heads=int(data.get("num_key_value_heads", data["num_attention_heads"])),
                head_dim=int(data.get("head_dim") or data["hidden_size"] // data["num_attention_heads"]),
                rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta_of(data),
                max_position_embeddings=int(data.get("max_position_embeddings", 40960)),
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                bos_token_id=data.get("bos_token_id"),
                eos_token_id=int(eos),
                **moe,
            )
        except KeyError as exc:
            raise RlkConfigError(f"config.json lacks the field {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> Qwen3Config:
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise RlkConfigError(f"{cfg_path} does not exist (expected a Hugging Face model directory)")
        with open(cfg_path, encoding="utf-8") as fh:
            return cls.from_hf(json.load(fh))

    def to_hf(self) -> dict[str, Any]:
        d = self.as_dict()
        d.update({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "rope_scaling": None,
                  "hidden_act": "silu", "attention_bias": False})
        if self.is_moe:  # every layer sparse, no shared expert (Qwen3-MoE has none)
            d.update({"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "decoder_sparse_step": 1,
                      "mlp_only_layers": []})
        return d

    def with_overrides(self, **kw: Any) -> Qwen3Config:
        return replace(self, **kw)


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob")


def moe_fields_of(data: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a ``qwen3_moe`` ``config.json``, after refusing what the model does not implement: dense
    layers among the sparse ones (``mlp_only_layers``, ``decoder_sparse_step`` other than 1) and shared experts."""
    if data.get("mlp_only_layers"):
        raise RlkConfigError(f"config.json sets mlp_only_layers={data['mlp_only_layers']!r}: the local engine's "
                             "Qwen3-MoE has every layer sparse")
    if int(data.get("decoder_sparse_step", 1)) != 1:
        raise RlkConfigError(f"config.json sets decoder_sparse_step={data['decoder_sparse_step']!r}: the local "
                             "engine's Qwen3-MoE has every layer sparse (step 1)")
    for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if data.get(key):
            raise RlkConfigError(f"config.json sets {key}={data[key]!r}: shared experts are not implemented by the "
                                 "local engine (Qwen3-MoE has none)")
    try:
        return {"num_experts": int(data["num_experts"]), "num_experts_per_tok": int(data["num_experts_per_tok"]),
                "moe_intermediate_size": int(data["moe_intermediate_size"]),
                "norm_topk_prob": bool(data.get("norm_topk_prob", False))}
    except KeyError as exc:
        raise RlkConfigError(f"config.json (qwen3_moe) lacks the field {exc.args[0]!r}") from None


_PLAIN_ROPE_TYPES = (None, "default")
_ROPE_THETA_DEFAULT = 1_000_000.0
_PLAIN_ROPE_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def _rope_dicts(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The RoPE parameter mappings of a ``config.json``, each with the field it came from: ``rope_scaling``
    (transformers 4.x) and ``rope_parameters`` (5.x), the latter flat or keyed by layer type."""
    found = []
    for name in ("rope_scaling", "rope_parameters"):
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise RlkConfigError(f"config.json field {name} must be a mapping or null, got {value!r}")
        nested = [k for k, v in value.items() if isinstance(v, dict)]
        if nested and len(nested) == len(value):  # per layer type, e.g. {"full_attention": {...}}
            found += [(f"{name}.{k}", value[k]) for k in nested]
        elif nested:
            raise RlkConfigError(f"config.json field {name} mixes parameters and nested mappings ({nested})")
        else:
            found.append((name, value))
    return found


def _theta(field: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise RlkConfigError(f"config.json field {field} must be a positive number, got {value!r}")
    return float(value)


def rope_theta_of(data: dict[str, Any]) -> float:
    """``rope_theta`` of a Hugging Face ``config.json`` in either layout, after refusing what the model
    does not implement.

    transformers 4.x writes ``rope_theta`` at the top level and scaling in ``rope_scaling``; 5.x writes
    both inside ``rope_parameters`` (``{"rope_type": "default", "rope_theta": 1e6}``). The model runs
    plain RoPE over the whole head: any ``rope_type`` (or the 4.x alias ``type``) other than
    ``"default"`` (YaRN, linear, dynamic, llama3, ...), any other key in those mappings (``factor``,
    ``beta_fast``, ...) and any ``partial_rotary_factor`` other than 1 is an :class:`RlkConfigError`
    naming the field. Two thetas that disagree are refused too; none at all
    gives the Qwen3 default 1e6.
    """
    thetas: dict[str, float] = {}
    if data.get("rope_theta") is not None:
        thetas["rope_theta"] = _theta("rope_theta", data["rope_theta"])
    for field, params in [("", data), *_rope_dicts(data)]:
        prefix = f"{field}." if field else ""
        if field:
            for key in ("rope_type", "type"):
                kind = params.get(key)
                if kind not in _PLAIN_ROPE_TYPES:
                    raise RlkConfigError(f"config.json sets {prefix}{key}={kind!r}: RoPE scaling is not "
                                         "implemented by the local engine (plain RoPE only, rope_type 'default')")
            unknown = sorted(k for k, v in params.items() if k not in _PLAIN_ROPE_KEYS and v is not None)
            if unknown:  # a scaling parameter (factor, beta_fast, ...) without a scaling type: fail closed
                raise RlkConfigError(f"config.json sets {prefix}{unknown[0]}={params[unknown[0]]!r}: RoPE "
                                     "scaling parameters are not implemented by the local engine (plain RoPE only)")
            if params.get("rope_theta") is not None:
                thetas[f"{prefix}rope_theta"] = _theta(f"{prefix}rope_theta", params["rope_theta"])
        factor = params.get("partial_rotary_factor")
        if factor is not None and factor != 1:
            raise RlkConfigError(f"config.json sets {prefix}partial_rotary_factor={factor!r}: the local "
                                 "engine rotates the whole head (factor 1 only)")
    if len(set(thetas.values())) > 1:
        raise RlkConfigError(f"config.json gives different RoPE thetas: {thetas}")
    return next(iter(thetas.values()), _ROPE_THETA_DEFAULT)


#: the standard deviation of a random-weight model's logits (before the temperature): the final norm's gain is set
#: so that logits = gain * unit-RMS hidden @ LM head reach it (:func:`rlk_repro.model.weights.random_weights`)
RANDOM_LOGIT_STD = 4.0

PRESETS: dict[str, Qwen3Config] = {
    # 2 layers, GQA 4/2, head dim 16: a CPU run of a few rounds takes seconds.
    "tiny": Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "small": Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32),
    # the shape of Qwen/Qwen3-0.6B (its LM head is tied to the embedding)
    "qwen3-0.6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                              num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                              tie_word_embeddings=True, bos_token_id=None, eos_token_id=151645),
    # 2 layers as tiny, each FFN 8 experts of width 32, top-2 (issue 36)
    "qwen3-moe-tiny": Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                                  num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}

#: ``qwen3-moe-30b-a3b-L<n>``: the layer shape of Qwen/Qwen3-30B-A3B with ``n`` layers (its config.json's fields)
MOE_30B_A3B_PREFIX = "qwen3-moe-30b-a3b-L"
_MOE_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_attention_heads=32,
                    num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                    moe_intermediate_size=768, norm_topk_prob=True, bos_token_id=None, eos_token_id=151645)


def preset(name: str) -> Qwen3Config:
    """The preset ``name``: one of :data:`PRESETS`, or ``qwen3-moe-30b-a3b-L<n>`` (``n >= 1`` layers)."""
    if name in PRESETS:
        return PRESETS[name]
    if name.startswith(MOE_30B_A3B_PREFIX):
        n = name[len(MOE_30B_A3B_PREFIX):]
        if n.isdigit() and int(n) >= 1 and str(int(n)) == n:
            return Qwen3Config(num_hidden_layers=int(n), **_MOE_30B_A3B)
    raise RlkConfigError(f"model {name!r} is not one of {', '.join(PRESETS)} or {MOE_30B_A3B_PREFIX}<layers>")


def preset_name(name: str) -> str:
    """``name`` if it names a preset (an argparse type: the error is argparse's)."""
    import argparse

    try:
        preset(name)
    except RlkConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name
