"""Worker for test_op_count.py: one gloo rank, the tiny rlk GPTModel (all R), one forward + backward on a
packed THD batch under :class:`_opcount.OpCounter`, keeping the torch ops that launch
work (views, metadata and allocations left out) issued by the provider (``rlk_megatron_provider``) or
Megatron (``megatron``). rlk ops count as one op each; their insides are not seen.

``python _op_count_worker.py PORT``: prints one JSON line: ``{"fast": counts, "control": counts}``, the
control with ``RlkSelfAttention.get_query_key_value_tensors`` put back to Megatron's (the regrouped
columns, Megatron's query copy) — the extra copies this test guards against, so the counter must see them.
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model
from _opcount import OpCounter, kind


def step(model, cfg) -> dict:
    from megatron.core.packed_seq_params import PackedSeqParams

    seqs = _model.sequences([8, 12, 4], cfg.vocab_size)
    ids = torch.tensor([t for s in seqs for t in s[:-1]])
    lens = [len(s) - 1 for s in seqs]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lens),
                          max_seqlen_kv=max(lens))

    def run():
        model.zero_grad(set_to_none=True)
        out = model(ids[None], torch.zeros_like(ids)[None], None, packed_seq_params=psp)
        out.float().square().mean().backward()

    run()  # caches (the [q; k; v] weight, the batch index) as from a training loop's second step on
    with OpCounter() as c:
        run()
    return {f"{owner} {op.partition('::')[2]}": n for (owner, op), n in c.counts.items()
            if owner in ("provider", "megatron") and kind(op) == "kernel"}


def main() -> None:
    with _model.single_rank(int(sys.argv[1])):
        from rlk_megatron_provider.attention import RlkSelfAttention

        cfg = _model.config(False)
        model, _ = _model.build_megatron(cfg, 1, 1)
        _model.load(model, cfg, _model.weights(cfg), 1, 0)
        out = {"layers": cfg.num_hidden_layers, "fast": step(model, cfg)}
        RlkSelfAttention.get_query_key_value_tensors = RlkSelfAttention.__mro__[1].get_query_key_value_tensors
        out["control"] = step(model, cfg)
        print(json.dumps(out))

if __name__ == "__main__":
    main()
