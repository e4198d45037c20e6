"""The public functional API of rlk's operators.

Each op is also registered as ``torch.ops.rlk.<op>`` (with a fake implementation for tracing and,
where training needs it, autograd). Backend choice happens inside each op; see
:mod:`rlk_core.backends`. Every docstring states the op's contract id and what a result depends on.
"""

from rlk_core.ops._dispatch import treat_as_plain
from rlk_core.ops.attention import (
    attention_decode,
    attention_paged_prefill,
    attention_varlen,
    kv_cache_write,
)
from rlk_core.ops.entropy import entropy
from rlk_core.ops.kept_set import KeptSet, apply_kept, kept_set
from rlk_core.ops.linear import linear
from rlk_core.ops.linear_logprobs import linear_logp_partials, linear_logprobs
from rlk_core.ops.linear_tp import linear_tp, linear_tp_finish, linear_tp_partials
from rlk_core.ops.moe import moe_combine, moe_grouped_linear, moe_topk
from rlk_core.ops.rms_norm import rms_norm
from rlk_core.ops.rope import rope, rope_cos_sin
from rlk_core.ops.swiglu import swiglu
from rlk_core.ops.token_logprobs import logp_partials, merge_logp_partials, token_logprobs

__all__ = [
    "KeptSet",
    "apply_kept",
    "attention_decode",
    "attention_paged_prefill",
    "attention_varlen",
    "entropy",
    "kept_set",
    "kv_cache_write",
    "linear",
    "linear_logp_partials",
    "linear_logprobs",
    "linear_tp",
    "linear_tp_finish",
    "linear_tp_partials",
    "logp_partials",
    "merge_logp_partials",
    "moe_combine",
    "moe_grouped_linear",
    "moe_topk",
    "rms_norm",
    "rope",
    "rope_cos_sin",
    "swiglu",
    "token_logprobs",
    "treat_as_plain",
]
