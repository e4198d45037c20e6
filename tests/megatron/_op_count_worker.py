"""Worker for test_op_count.py: one gloo rank, the tiny rlk GPTModel (all R), one forward + backward on a
packed THD batch under a ``TorchDispatchMode`` that counts the torch ops launching work (views, metadata
and allocations left out) by the code that issued them: the provider (``rlk_megatron_provider``) or
Megatron (``megatron``). rlk ops count as one op each; their insides are not seen.

``python _op_count_worker.py PORT``: prints one JSON line: ``{"fast": counts, "control": counts}``, the
control with ``RlkSelfAttention.get_query_key_value_tensors`` put back to Megatron's (the regrouped
columns, Megatron's query copy) — the extra copies this test guards against, so the counter must see them.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model

NO_WORK = frozenset("view _unsafe_view alias t transpose permute slice select split split_with_sizes unsqueeze "
                    "squeeze expand as_strided detach narrow unbind view_as _reshape_alias lift_fresh empty "
                    "new_empty empty_strided empty_like".split())


class Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if func.namespace == "aten" and name not in NO_WORK:
            f = sys._getframe(1)
            while f is not None and f.f_code.co_name != "_engine_run_backward":
                path = f.f_code.co_filename.replace("\\", "/")
                if "/rlk_megatron_provider/" in path or "/megatron/core/" in path:
                    who = "provider" if "/rlk_megatron_provider/" in path else "megatron"
                    self.ops[f"{who} {name}"] += 1
                    break
                if "/torch/" not in path:
                    break
                f = f.f_back
        return func(*args, **(kwargs or {}))


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
    with Count() as c:
        run()
    return dict(c.ops)


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
