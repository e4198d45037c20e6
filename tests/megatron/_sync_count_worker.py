"""Worker for test_host_syncs.py: one gloo rank, the GRPO training step of
``tests/frameworks/megatron_setup.py`` (the builders, batch, log-probs and loss: forward + backward, no
optimizer) on the tiny all-R GPTModel and on the stock local spec, under
:class:`_opcount.SyncCounter` — the host syncs the step makes on a CUDA device, each with
the frame that issued it.

``python _sync_count_worker.py PORT``: prints one JSON line ``{name: {"syncs": {site: count}, "calls": {...}}}``
for each measured step (see test_host_syncs.py for what each is).
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "frameworks"))  # megatron_setup
import _model
import megatron_setup as mg
from _opcount import SyncCounter

DEV, DTYPE = torch.device("cpu"), torch.float32
LENGTHS = [16] * 4


def measured(fn) -> dict:
    with SyncCounter() as c:
        fn()
    return {"syncs": c.by_site(), "by_owner": c.by_owner(), "mixed": {f"{k[0]} {k[1]}": v for k, v in c.mixed.items()}}


def rlk_runs(cfg, w, out: dict) -> None:
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import attention, layers

    model, _ = mg.build(cfg, DEV, DTYPE, rlk=True)
    mg.load(model, cfg, w)
    box = mg.hidden_head(model)
    cores = [m for m in model.modules() if isinstance(m, attention.RlkCoreAttention)]
    out["max_positions"] = sorted({m.max_positions for m in cores})
    reserve, reserved = attention.reserve_tables, []
    attention.reserve_tables = lambda *a: reserved.append([str(a[0]), *a[1:]])  # a no-op on the CPU anyway

    def step(b, psp=None):
        model.zero_grad(set_to_none=True)
        if psp is None:
            lp = mg.rlk_logp(model, box, b)
        else:  # the same step with other PackedSeqParams (the cu_seqlens_kv control)
            model(b.ids[None], b.pos[None], None, packed_seq_params=psp)
            h = box["hidden"].reshape(-1, box["hidden"].shape[-1])
            from rlk_megatron_provider import logp

            lp = logp.vocab_parallel_logprobs(h[b.rows], box["weight"], b.target[b.rows], mg.TEMPERATURE, None)
        mg.grpo_loss(lp, b.adv).backward()

    step(mg.Batch(cfg, LENGTHS, 1, DEV, seed=1))  # warm-up: the QKV weight caches, as from step 2 on
    step(mg.Batch(cfg, LENGTHS, 1, DEV, seed=4))
    attention.reserve_tables = reserve
    out["reserve_calls"] = reserved  # over two steps: once per layer, at the first forward
    for m in cores:  # a model of 32 positions: a 48-token sequence is refused before anything runs
        m.max_positions = 32
    try:
        step(mg.Batch(cfg, [48, 16], 1, DEV, seed=5))
        out["too_long"] = None
    except RlkPolicyError as exc:
        out["too_long"] = str(exc)
    for m in cores:  # a model prepare_model never saw: runs, rope unreserved (a warning, once)
        m.max_positions = None
    long = mg.Batch(cfg, [48, 16], 1, DEV, seed=5)
    out["unreserved"] = measured(lambda: step(long))
    for m in cores:
        m.max_positions = cfg.max_position_embeddings
    fresh = mg.Batch(cfg, LENGTHS, 1, DEV, seed=2)
    out["rlk_fresh_batch"] = measured(lambda: step(fresh))
    out["rlk_same_batch"] = measured(lambda: step(fresh))
    other = mg.Batch(cfg, LENGTHS, 1, DEV, seed=3)
    psp = other.psp()
    psp.cu_seqlens_kv = other.cu.clone()  # equal values, another tensor: read and compared on the host
    out["rlk_kv_other_tensor"] = measured(lambda: step(other, psp))

    # sbhd (the stock layout) through the rlk spec: Megatron's causal mask, checked once per mask object
    n, s = len(LENGTHS), LENGTHS[0]

    def sbhd(b):
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=DEV), diagonal=1)[None, None]
        model.zero_grad(set_to_none=True)
        model(b.ids.reshape(n, s), b.pos.reshape(n, s), mask.expand(n, 1, s, s))
        h = box["hidden"].transpose(0, 1).reshape(-1, box["hidden"].shape[-1])
        from rlk_megatron_provider import logp

        lp = logp.vocab_parallel_logprobs(h[b.rows], box["weight"], b.target[b.rows], mg.TEMPERATURE, None)
        mg.grpo_loss(lp, b.adv).backward()

    out["rlk_sbhd_new_mask"] = measured(lambda: sbhd(fresh))

    # controls: syncs injected into the provider's layers must be counted (forward: a device scalar read;
    # backward: a copy to the host), host-tensor reads and explicit uploads classified by the device model
    norm_forward, rows_backward = layers.RlkRMSNorm.forward, layers._CachedRows.backward
    calls = {"norm": 0, "rows_backward": 0}

    def norm_with_syncs(self, x):
        calls["norm"] += 1
        float(x.detach().abs().max())  # a device value read: counted
        torch.tensor([1, 2]).tolist()  # a host tensor: free
        torch.tensor([1, 2], device=x.device)  # a copy to the device: counted
        return norm_forward(self, x)

    def rows_backward_with_sync(ctx, grad):
        calls["rows_backward"] += 1
        grad.sum().cpu()  # counted (a Python backward: the counter keeps its function mode there)
        return rows_backward(ctx, grad)

    layers.RlkRMSNorm.forward = norm_with_syncs
    layers._CachedRows.backward = staticmethod(rows_backward_with_sync)
    try:
        out["control_injected"] = measured(lambda: step(fresh))
    finally:
        layers.RlkRMSNorm.forward, layers._CachedRows.backward = norm_forward, staticmethod(rows_backward)
    out["control_injected"]["calls"] = calls


def stock_runs(cfg, w, out: dict) -> None:
    stock, _ = mg.build(cfg, DEV, DTYPE, rlk=False)
    mg.load(stock, cfg, w)

    def stock_step(b):
        stock.zero_grad(set_to_none=True)
        mg.grpo_loss(mg.stock_logp(stock, b), b.adv).backward()

    stock_step(mg.Batch(cfg, LENGTHS, 1, DEV, seed=1))
    fresh = mg.Batch(cfg, LENGTHS, 1, DEV, seed=2)
    out["stock_fresh_batch"] = measured(lambda: stock_step(fresh))


def main() -> None:
    with _model.single_rank(int(sys.argv[1])):
        cfg = mg.qwen_cfg("tiny")
        w = mg.make_weights(cfg, DEV, seed=5)
        out = {"layers": cfg.num_hidden_layers}
        rlk_runs(cfg, w, out)
        stock_runs(cfg, w, out)
        print(json.dumps(out))


if __name__ == "__main__":
    main()
