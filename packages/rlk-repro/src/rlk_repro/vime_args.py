"""What ``plan --engine vime`` derives and checks: model arguments from a Hugging Face ``config.json``, the
named launch profiles, and the flags VIME's ``train.py`` accepts (recorded in ``data/vime-train-flags.txt``).

- :func:`model_args`: the Megatron model arguments of a dense Qwen3 (or Qwen2 / Llama) checkpoint, the
  arguments slime's ``scripts/models/<model>.sh`` spell out by hand (``--num-layers``, ``--hidden-size``,
  ``--ffn-hidden-size``, heads and query groups, ``--kv-channels``, ``--norm-epsilon``, ``--rotary-base``,
  ``--vocab-size``, ``--qk-layernorm``, tied or untied LM head, ...). VIME checks several of them against the
  same ``config.json`` at start-up (``_hf_validate_args``), so a wrong one stops the job there; one it does not
  check (``--kv-channels``, ``--qk-layernorm``) would build another model. What is not a dense model with
  plain RoPE is refused (MoE, RoPE scaling, sliding windows), never guessed.
- :data:`PROFILES`: named sets of defaults; ``qwen3-8b-8gpu`` is the 8-GPU profile of the source documents
  (``shared/seeds/000_*``: one node of 8 GPUs, Megatron TP 4 / CP 2, two rollout engines of TP 4 colocated,
  the actor kept resident and the rollout offloaded, 7168 response tokens, one prompt of 8 GRPO samples per
  step, full uniform recomputation of 1 layer, vLLM CUDA graphs FULL_DECODE_ONLY with capture sizes 1..8).
- :func:`accepted_flags` / :func:`unknown_flags`: VIME parses Megatron's arguments with
  ``ignore_unknown_args=True`` (and vLLM's with ``parse_known_args``), so a flag it does not know is dropped
  without a word. The recorded list (our extraction, sources and commits in its header) is what every printed
  flag is checked against.

Imports neither torch nor anything of VIME.
"""

from __future__ import annotations

import json
import math
import os
from functools import cache
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError

FLAGS_FILE = Path(__file__).resolve().parent / "data" / "vime-train-flags.txt"
#: VIME commit of the recorded list's main section (``vime/utils/arguments.py``)
VIME_COMMIT = "035f98340b316763416621a0ff5d903d0f37c9d7"
#: the flags of VIME's linear-logp provider ABI, which the recorded VIME does not have (RL-Align/vime does)
LINEAR_LOGP_ABI_FLAGS = ("--linear-logp-provider", "--linear-logp-provider-mode")

DENSE_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}


@cache
def recorded_flags() -> dict[str, frozenset[str]]:
    """The recorded flag list, per section (``vime``, ``vime-vllm``, ``vllm``, ``megatron``)."""
    sections: dict[str, set[str]] = {}
    current = None
    for line in FLAGS_FILE.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], set())
        elif current is None or not line.startswith("--"):
            raise RlkConfigError(f"{FLAGS_FILE}: unexpected line {line!r}")
        else:
            current.add(line)
    return {k: frozenset(v) for k, v in sections.items()}


def accepted_flags(linear_logp_abi: bool = False) -> frozenset[str]:
    out = frozenset().union(*recorded_flags().values())
    return out | frozenset(LINEAR_LOGP_ABI_FLAGS) if linear_logp_abi else out


def flags_of(argv: list[str]) -> list[str]:
    """The option names in ``argv`` (``--name`` or ``--name=value``), in order, once each."""
    seen: dict[str, None] = {}
    for a in argv:
        if a.startswith("--") and len(a) > 2:
            seen.setdefault(a.split("=", 1)[0], None)
    return list(seen)


def unknown_flags(argv: list[str], linear_logp_abi: bool = False) -> list[str]:
    ok = accepted_flags(linear_logp_abi)
    return [f for f in flags_of(argv) if f not in ok]


# -- model arguments from config.json ------------------------------------------------------------------
def read_config(model_dir: str) -> dict[str, Any]:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except FileNotFoundError:
        raise RlkConfigError(f"--model-path {model_dir}: no config.json there (a Hugging Face model directory)") \
            from None
    except (OSError, ValueError) as exc:
        raise RlkConfigError(f"--model-path {model_dir}: config.json cannot be read ({exc})") from None
    if not isinstance(data, dict):
        raise RlkConfigError(f"--model-path {model_dir}: config.json is not a JSON object")
    return data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data


def _int(data: dict[str, Any], key: str, default: Any = None) -> int:
    value = data.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RlkConfigError(f"config.json {key} must be a positive integer, got {value!r}")
    return value


def _plain_rope(data: dict[str, Any]) -> float:
    theta = data.get("rope_theta")
    for key in ("rope_scaling", "rope_parameters"):
        params = data.get(key)
        if params is None:
            continue
        if not isinstance(params, dict):
            raise RlkConfigError(f"config.json {key} must be a mapping or null")
        kind = params.get("rope_type", params.get("type"))
        extra = sorted(k for k, v in params.items() if k not in ("rope_type", "type", "rope_theta") and v is not None)
        if kind not in (None, "default") or extra:
            raise RlkConfigError(f"config.json {key} asks for RoPE scaling ({kind or extra[0]}): not derived (rlk's "
                                 "RoPE is plain); pass the model arguments yourself with --extra")
        theta = params.get("rope_theta", theta)
    theta = 10000.0 if theta is None else theta
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
        raise RlkConfigError(f"config.json rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


def model_args(model_dir: str) -> tuple[list[str], dict[str, Any]]:
    """Megatron's model arguments for the dense checkpoint at ``model_dir``, and what they came from."""
    data = read_config(model_dir)
    archs = data.get("architectures") or []
    arch = next((a for a in archs if a in DENSE_ARCHITECTURES), None)
    if arch is None:
        raise RlkConfigError(f"--model-path {model_dir}: architectures {archs} is not a dense decoder the plan "
                             f"derives ({', '.join(DENSE_ARCHITECTURES)}); MoE and other models: pass the model "
                             "arguments yourself with --extra")
    if data.get("num_experts") or data.get("num_local_experts") or data.get("n_routed_experts"):
        raise RlkConfigError(f"--model-path {model_dir}: a mixture-of-experts config; not derived")
    if data.get("use_sliding_window") or (data.get("sliding_window") and arch == "LlamaForCausalLM"):
        raise RlkConfigError(f"--model-path {model_dir}: sliding-window attention is not derived")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise RlkConfigError(f"--model-path {model_dir}: hidden_act {act!r}; only SwiGLU (silu) models are derived")
    heads = _int(data, "num_attention_heads")
    groups = _int(data, "num_key_value_heads", heads)
    hidden = _int(data, "hidden_size")
    head_dim = data.get("head_dim") or hidden // heads
    args = ["--swiglu", "--num-layers", str(_int(data, "num_hidden_layers")), "--hidden-size", str(hidden),
            "--ffn-hidden-size", str(_int(data, "intermediate_size")), "--num-attention-heads", str(heads)]
    if groups != heads:
        args += ["--group-query-attention", "--num-query-groups", str(groups)]
    args += ["--use-rotary-position-embeddings", "--disable-bias-linear", "--normalization", "RMSNorm",
             "--norm-epsilon", _number(float(data.get("rms_norm_eps", 1e-6))), "--rotary-base",
             _number(_plain_rope(data)), "--vocab-size", str(_int(data, "vocab_size")), "--kv-channels",
             str(int(head_dim))]
    if arch == "Qwen2ForCausalLM" or data.get("attention_bias"):
        args += ["--add-qkv-bias"]
    if arch == "Qwen3ForCausalLM":
        args += ["--qk-layernorm"]
    if not data.get("tie_word_embeddings", False):
        args += ["--untie-embeddings-and-output-weights"]
    return args, {"architecture": arch, "config": os.path.join(model_dir, "config.json"),
                  "max_position_embeddings": data.get("max_position_embeddings")}


# -- named profiles --------------------------------------------------------------------------------------
#: option defaults per profile (option dest -> value); options given on the command line win
PROFILES: dict[str, dict[str, Any]] = {
    "qwen3-8b-8gpu": {
        "nodes": 1, "gpus_per_node": 8, "tensor_parallel": 4, "context_parallel": 2, "rollout_tensor_parallel": 4,
        "colocate": True, "rounds": 200, "prompts_per_round": 1, "samples_per_prompt": 8, "max_new_tokens": 7168,
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": 1234, "recompute": True, "keep_actor_resident": True,
        "cuda_graph_decode": True,
    },
}
PROFILE_DOC = {
    "qwen3-8b-8gpu": "the source documents' 8-GPU Qwen3-8B run: 1 node x 8 GPUs, TP 4 / CP 2, two TP-4 rollout "
                     "engines colocated (actor resident, rollout offloaded), 200 rounds of 1 prompt x 8 samples, "
                     "7168 response tokens, full uniform recompute, vLLM FULL_DECODE_ONLY CUDA graphs 1..8",
}
