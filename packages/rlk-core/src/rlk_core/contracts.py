"""Contract ids: versioned names for the arithmetic of each operator.

A contract id fixes what a result may depend on and the structure of its arithmetic (block sizes,
reduction trees, conversion points: ``docs/ops/<op>.md``); changing that means a new id. The exact bits
are those of one backend's kernels under the contract: two runs of the same (contract id, backend id)
on the same hardware give identical bits, while ``rlk.reference`` and ``rlk.triton`` under one id agree
within ``dtype_tols`` (their MMA / summation order inside a block differs). That is why readbacks record
both ids and ``rlk-validate`` requires an R/R module to run the same backends on both sides.
"""

from __future__ import annotations

# op name (as in rlk_core.ops and torch.ops.rlk, and the registry's ops) -> contract id
OP_CONTRACTS: dict[str, str] = {
    "linear": "rlk.gemm.bi.v1",
    "linear_tp_partials": "rlk.gemm.tp.v1",
    "linear_tp": "rlk.gemm.tp.v1",
    "rms_norm": "rlk.rms_norm.v1",
    "rms_norm_backward": "rlk.rms_norm.v1",
    "swiglu": "rlk.swiglu.v1",
    "swiglu_backward": "rlk.swiglu.v1",
    "rope": "rlk.rope.v1",
    "rope_backward": "rlk.rope.v1",
    "attention_varlen": "rlk.attention.v1",
    "attention_varlen_backward": "rlk.attention.v1",
    "attention_paged_prefill": "rlk.attention.v1",
    "attention_decode": "rlk.attention.v1",
    "kv_cache_write": "rlk.attention.v1",
    "token_logprobs": "rlk.logp.v1",
    "token_logprobs_backward": "rlk.logp.v1",
    "logp_partials": "rlk.logp.v1",
    "merge_logp_partials": "rlk.logp.v1",
    "linear_logprobs": "rlk.logp.v1",
    "linear_logprobs_backward": "rlk.logp.v1",
    "linear_logp_partials": "rlk.logp.v1",
    "kept_set": "rlk.logp.processed.v1",
    "apply_kept": "rlk.logp.processed.v1",
    "processed_token_logprobs": "rlk.logp.processed.v1",
    "processed_token_logprobs_backward": "rlk.logp.processed.v1",
    "processed_logp_partials": "rlk.logp.processed.v1",
    "processed_linear_logprobs": "rlk.logp.processed.v1",
    "processed_linear_logprobs_backward": "rlk.logp.processed.v1",
    "processed_linear_logp_partials": "rlk.logp.processed.v1",
    "entropy": "rlk.entropy.v1",
    "entropy_backward": "rlk.entropy.v1",
    "moe_topk": "rlk.moe.v1",
    "moe_topk_backward": "rlk.moe.v1",
    "moe_grouped_linear": "rlk.moe.v1",
    "moe_grouped_linear_backward": "rlk.moe.v1",
    "moe_combine": "rlk.moe.v1",
    "moe_combine_backward": "rlk.moe.v1",
}

# ops that belong to another op's arithmetic (its backward, its vocab-parallel halves): a backend forced
# for the main op with RLK_BACKENDS runs them too, so the pieces of one computation never mix backends
COMPANION_OF: dict[str, str] = {
    "linear_tp": "linear_tp_partials",
    "rms_norm_backward": "rms_norm",
    "swiglu_backward": "swiglu",
    "rope_backward": "rope",
    "attention_varlen_backward": "attention_varlen",
    "token_logprobs_backward": "token_logprobs",
    "logp_partials": "token_logprobs",
    "merge_logp_partials": "token_logprobs",
    "linear_logprobs_backward": "linear_logprobs",
    "linear_logp_partials": "linear_logprobs",
    "apply_kept": "kept_set",
    "processed_token_logprobs_backward": "processed_token_logprobs",
    "processed_logp_partials": "processed_token_logprobs",
    "processed_linear_logprobs_backward": "processed_linear_logprobs",
    "processed_linear_logp_partials": "processed_linear_logprobs",
    "entropy_backward": "entropy",
    "moe_topk_backward": "moe_topk",
    "moe_grouped_linear_backward": "moe_grouped_linear",
    "moe_combine_backward": "moe_combine",
}

# collectives (rlk_collectives) report under this contract id; they are not registry ops
COLLECTIVE_CONTRACT = "rlk.collective.v1"
COLLECTIVE_OPS = ("all_reduce", "reduce_scatter", "all_gather", "cp_all_gather", "cp_reduce_scatter")
