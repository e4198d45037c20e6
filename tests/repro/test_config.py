"""Qwen3Config.from_hf / from_dir: RoPE read from the transformers 4.x layout (top-level ``rope_theta``,
``rope_scaling``) and the 5.x layout (``rope_parameters``); scaling the model does not implement is
refused with an error naming the field, in either layout."""

from __future__ import annotations

import json

import pytest

from rlk_core.errors import RlkConfigError
from rlk_repro.model.config import PRESETS, Qwen3Config

# a Qwen3-0.6B-like config.json, written by hand without any RoPE field
SHAPE = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "vocab_size": 320, "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False,
         "bos_token_id": 256, "eos_token_id": 257, "hidden_act": "silu", "attention_bias": False}
V4 = {**SHAPE, "rope_theta": 150000.0, "rope_scaling": None, "transformers_version": "4.51.0"}
V5 = {**SHAPE, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}, "transformers_version": "5.0.0"}


def _from_dir(tmp_path, data):
    (tmp_path / "config.json").write_text(json.dumps(data))
    return Qwen3Config.from_dir(tmp_path)


@pytest.mark.parametrize("layout", [V4, V5], ids=["transformers-4", "transformers-5"])
def test_both_layouts_read_the_same_theta(layout, tmp_path):
    cfg = _from_dir(tmp_path, layout)
    assert cfg.rope_theta == 150000.0  # not the 1e6 default
    assert cfg == PRESETS["tiny"].with_overrides(rope_theta=150000.0)


@pytest.mark.parametrize("extra", [
    {"rope_theta": 150000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
    {"rope_parameters": {"rope_theta": 150000.0}},  # rope_type left out means plain RoPE
    {"rope_parameters": {"rope_type": "default", "rope_theta": 150000}},  # an int theta
    {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0, "partial_rotary_factor": 1.0}},
    {"rope_theta": 150000.0, "rope_scaling": {"rope_type": "default"}},
    {"rope_theta": 150000.0, "rope_scaling": {}},
    {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 150000.0}}},  # per layer type
], ids=["both-agree", "no-type", "int", "partial-1", "scaling-default", "scaling-empty", "per-layer-type"])
def test_plain_rope_variants_are_accepted(extra):
    assert Qwen3Config.from_hf({**SHAPE, **extra}).rope_theta == 150000.0


def test_no_theta_anywhere_is_the_qwen3_default():
    assert Qwen3Config.from_hf(SHAPE).rope_theta == 1_000_000.0
    assert Qwen3Config.from_hf({**SHAPE, "rope_parameters": {"rope_type": "default"}}).rope_theta == 1_000_000.0


SCALED = {
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192},
}


@pytest.mark.parametrize("kind", sorted(SCALED))
@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
def test_rope_scaling_is_refused_in_either_layout(kind, field, tmp_path):
    params = dict(SCALED[kind])
    data = {**SHAPE, field: params}
    if field == "rope_parameters":
        params["rope_theta"] = 1_000_000.0
    else:
        data["rope_theta"] = 1_000_000.0
    with pytest.raises(RlkConfigError, match=rf"{field}\.rope_type='{kind}'"):
        _from_dir(tmp_path, data)


@pytest.mark.parametrize(("extra", "named"), [
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"rope_scaling\.type='yarn'"),  # the 4.x alias
    ({"rope_parameters": {"rope_theta": 1e6, "factor": 4.0}}, r"rope_parameters\.factor"),  # no type given
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}},
     r"rope_parameters\.full_attention\.rope_type='yarn'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}},
     r"rope_parameters\.partial_rotary_factor"),
    ({"rope_theta": 1e6, "partial_rotary_factor": 0.5}, r"sets partial_rotary_factor"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "different RoPE thetas"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": "1e6"}}, r"rope_parameters\.rope_theta must be"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": True}}, r"rope_parameters\.rope_theta must be"),
    ({"rope_theta": -1.0}, "rope_theta must be a positive"),
    ({"rope_theta": float("nan")}, "rope_theta must be a positive"),
    ({"rope_parameters": "default"}, "rope_parameters must be a mapping"),
    ({"rope_parameters": {"rope_type": "default", "full_attention": {"rope_theta": 1e6}}}, "mixes"),
], ids=["alias-type", "factor-without-type", "per-layer-yarn", "partial-5", "partial-top", "thetas-disagree",
        "theta-string", "theta-bool", "theta-negative", "theta-nan", "not-a-mapping", "mixed-nesting"])
def test_what_the_model_cannot_run_is_refused_by_name(extra, named):
    with pytest.raises(RlkConfigError, match=named):
        Qwen3Config.from_hf({**SHAPE, **extra})


def test_to_hf_round_trips_through_from_hf():
    cfg = PRESETS["tiny"].with_overrides(rope_theta=5e5)
    assert Qwen3Config.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


def test_a_config_written_by_transformers_if_installed():
    transformers = pytest.importorskip("transformers")
    rope = ({"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}
            if int(transformers.__version__.split(".")[0]) >= 5 else {"rope_theta": 150000.0})
    hf = transformers.Qwen3Config(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  bos_token_id=256, eos_token_id=257, **rope)
    assert Qwen3Config.from_hf(hf.to_dict()).rope_theta == 150000.0
