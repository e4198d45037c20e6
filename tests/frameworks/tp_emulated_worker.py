#!/usr/bin/env python3
"""Emulated TP on one GPU (``RL_KERNEL_TP_EMULATE``), zero tolerance, launched by
``tests/frameworks/test_megatron_tp_emulated_exact.py``.

A Qwen3-shaped ``GPTModel`` on the provider's spec, every module R, strict, TP-invariant mode (G = 8), one process at
real TP 1: built once per layout — TP 1, then emulated TP 2, 4, 8 with sequence parallelism off and on (each rank's
shard of every TP-split op with that rank's own kernel launches and shapes, the partials merged in process by
``rlk_collectives.merge_partials``) — on the same weights and packed THD batch. Every emulated layout's per-token
log-probs and every gradient (one GRPO backward) must be ``torch.equal`` to TP 1's; the negative control (``4,bi``:
the row-parallel linears split as ``rlk.gemm.bi.v1``, each rank's GEMM on its K slice and the rank sum) must differ.
On the H200 at the Qwen3-0.6B shape in bf16 (the kernels of ``rlk.triton`` at every rank's shapes); ``--device cpu
--tiny``: a 2-layer model with 8 KV heads in fp32.

Writes ``tp_emulated_exact.json`` / ``.md`` to ``--out``; exit 1 if a bitwise check failed or a stage did not finish.
"""

from __future__ import annotations

import argparse
import os
import sys

import megatron_setup as S

LAYOUTS = ("2", "4", "8", "2,sp", "4,sp", "8,sp")
CONTROL = "4,bi"
G = 8


def run_layout(cfg, w, dev, dtype, b, value: str | None) -> tuple:
    """Build at real TP 1 with ``RL_KERNEL_TP_EMULATE=value`` (None: off), load, one forward + GRPO backward: the
    response rows' log-probs, the gradients, the readback's merge count."""
    from rlk_megatron_provider import _state

    if value is None:
        os.environ.pop("RL_KERNEL_TP_EMULATE", None)
    else:
        os.environ["RL_KERNEL_TP_EMULATE"] = value
    model, _ = S.build(cfg, dev, dtype, rlk=True)
    S.load(model, cfg, w)
    box = S.hidden_head(model)
    before = _merges(_state.get().recorder.to_dict())
    lp = S.rlk_logp(model, box, b)
    S.grpo_loss(lp, b.adv).backward()
    merges = _merges(_state.get().recorder.to_dict()) - before
    out = lp.detach().clone(), S.grads_of(model), merges
    del model, box
    return out


def _merges(readback: dict) -> int:
    return sum(m.get("ops", {}).get("merge_partials", {}).get("call_count", 0)
               for m in readback.get("modules", {}).values())


def stage_emulated(rep: S.Report, rec: dict, cfg, dev, dtype, lengths: list[int], prompt: int) -> None:
    import torch

    w = S.make_weights(cfg, dev)
    b = S.Batch(cfg, lengths, prompt, dev, seed=7)
    rec.update(tokens=b.T, sequences=len(lengths), response_tokens=int(b.rows.numel()), leaves_total=G)
    lp1, g1, m1 = run_layout(cfg, w, dev, dtype, b, None)
    rep.check("tp1.no_emulated_merge", m1 == 0, merges=m1)
    rep.check("tp1.gradients_nonzero", all(bool(g.abs().sum() > 0) for g in g1.values()), tensors=len(g1))
    for value in LAYOUTS:
        lp, g, merges = run_layout(cfg, w, dev, dtype, b, value)
        tag = f"emulated_tp{value.replace(',', '_')}"
        rep.check(f"{tag}.logp_equal_tp1", torch.equal(lp, lp1), tokens=int(lp.numel()),
                  differing_tokens=int((lp != lp1).sum()), max_abs=S.max_abs(lp, lp1))
        bad = S.diff_names(g, g1)
        rep.check(f"{tag}.every_gradient_equal_tp1", bad == [] and sorted(g) == sorted(g1), tensors=len(g),
                  differing=bad[:8])
        rep.check(f"{tag}.merged_in_process", merges > 0, merges=merges)
        del lp, g
    lp, g, _ = run_layout(cfg, w, dev, dtype, b, CONTROL)
    n = int((lp != lp1).sum())
    rep.check("negative_control.bi_split_differs_from_tp1", n > 0, differing_tokens=n, max_abs=S.max_abs(lp, lp1),
              differing_gradients=len(S.diff_names(g, g1)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="2-layer model with 8 KV heads, small batch (CPU)")
    ap.add_argument("--hybrid", action="store_true", help=argparse.SUPPRESS)  # S.meta reads it
    args = ap.parse_args()
    S.NAME = "tp_emulated_worker"
    dev, dtype = S.setup_process(args)
    os.environ["RL_KERNEL_TP_INVARIANT"] = str(G)
    rep = S.Report(args.out, S.meta(args), "tp_emulated_exact")
    with rep.stage("init") as rec:
        S.init_world(args.device)
        import rlk_megatron_provider as prov

        rec["plan"] = prov.initialize_from_environment().plan.name
    if rep.data["stages"]["init"]["status"] != "ok":
        return rep.finish()
    if args.tiny:
        from rlk_repro.model.config import Qwen3Config

        shape = {**S.SHAPES["tiny"], "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8}
        cfg = Qwen3Config(**shape, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
                          tie_word_embeddings=True, bos_token_id=None, eos_token_id=1)
        lengths, prompt = [8, 16, 24, 16], 3  # 64 tokens: divisible by 8 (SP at emulated TP 8)
    else:
        cfg = S.qwen_cfg("qwen3-0.6b")
        lengths, prompt = [max(8, n // 8 * 8) for n in S.varlen_lengths(16, 4096, seed=1)], 32
    with rep.stage("emulated_tp") as rec:
        stage_emulated(rep, rec, cfg, dev, dtype, lengths, prompt)
    return rep.finish()


if __name__ == "__main__":
    sys.exit(main())
