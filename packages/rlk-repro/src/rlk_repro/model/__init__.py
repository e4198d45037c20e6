"""A Qwen3 dense decoder whose every floating-point op is routed through the plan (P or R per side)."""

from rlk_repro.model.config import PRESETS, Qwen3Config
from rlk_repro.model.ops import Ops
from rlk_repro.model.weights import load_checkpoint, random_weights, save_checkpoint, weights_sha256

__all__ = ["PRESETS", "Ops", "Qwen3Config", "load_checkpoint", "random_weights", "save_checkpoint",
           "weights_sha256"]
