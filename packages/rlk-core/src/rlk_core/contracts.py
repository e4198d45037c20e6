"""Contract ids: versioned names for the arithmetic of each operator.

A contract id fixes what a result may depend on and the structure of its arithmetic (block sizes,
reduction trees, conversion points: ``docs/ops/<op>.md``); changing that means a new id. The exact bits
are those of one backend's kernels under the contract: two runs of the same (contract id, backend id)
on the same hardware give identical bits, while ``rlk.reference`` and ``rlk.triton`` under one id agree
within ``dtype_tols`` (their MMA / summation order inside a block differs). That is why readbacks record
both ids and ``rlk-validate`` requires an R/R module to run the same backends on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Contract:
    id: str
    module: str  # attention | ffn | logp (the route module whose R side runs it)
    depends_on: str
    invariances: tuple[str, ...]


CONTRACTS: dict[str, Contract] = {
    c.id: c
    for c in (
        Contract("rlk.gemm.bi.v1", "ffn",
                 "that row of x and W (and bias): one K reduction order for every M, one rounding",
                 ("batch", "run_to_run")),
        Contract("rlk.rms_norm.v1", "ffn",
                 "that row and the weight: fixed-order fp32 sum of squares, one rounding",
                 ("batch", "run_to_run")),
        Contract("rlk.swiglu.v1", "ffn", "that element: silu(gate) * up in fp32, one rounding",
                 ("batch", "run_to_run")),
        Contract("rlk.rope.v1", "attention",
                 "that element and its absolute position: fp32 cos/sin tables built from rope_theta",
                 ("batch", "offset", "run_to_run")),
        Contract("rlk.attention.v1", "attention",
                 "q of that token and K/V of positions 0..t of its own sequence: KV in fixed blocks "
                 "anchored at position 0, increasing order, online softmax in fp32",
                 ("batch", "prefill_chunked_decode", "page_size", "run_to_run")),
        Contract("rlk.logp.v1", "logp",
                 "that token's logits (or hidden state and LM-head weight), the temperature and the "
                 "target id: fp32 log-sum-exp over fixed vocab blocks merged in a fixed tree",
                 ("batch", "vocab_shards", "fused_equals_unfused", "run_to_run")),
    )
}

# op name (as in rlk_core.ops and torch.ops.rlk) -> contract id
OP_CONTRACTS: dict[str, str] = {
    "linear": "rlk.gemm.bi.v1",
    "rms_norm": "rlk.rms_norm.v1",
    "swiglu": "rlk.swiglu.v1",
    "rope": "rlk.rope.v1",
    "attention_varlen": "rlk.attention.v1",
    "attention_varlen_backward": "rlk.attention.v1",
    "attention_paged_prefill": "rlk.attention.v1",
    "attention_decode": "rlk.attention.v1",
    "kv_cache_write": "rlk.attention.v1",
    "token_logprobs": "rlk.logp.v1",
    "linear_logprobs": "rlk.logp.v1",
}


def contract_of(op: str) -> Contract:
    try:
        return CONTRACTS[OP_CONTRACTS[op]]
    except KeyError:
        raise KeyError(f"op {op!r} has no contract; known ops: {', '.join(OP_CONTRACTS)}") from None
