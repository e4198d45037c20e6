"""Issue 36: the provider's MoE layer spec in real megatron-core on CPU (gloo, ``_moe_worker.py``): a Qwen3-MoE
``GPTModel`` (8 experts, top-2) whose router and experts slots are rlk's — log-probs and gradients bitwise equal to
the local engine's trainer and across expert-parallel sizes 1 / 2 / 4 (each EP rank its own sequences of other
lengths); the aux / z losses attached without touching a log-prob; the stock MoE layer as the negative control."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core")

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _model  # noqa: E402
import _moe_worker  # noqa: E402

R_ALL = {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
         "RL_KERNEL_MODE": "strict"}
LENGTHS = {1: [[8, 12, 4, 10]], 2: [[8, 12], [4, 10]], 4: [[8], [12], [4], [10]]}  # one global batch, split
_RUNS: dict[str, list[dict]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, ep: int, env: dict | None = None, **spec) -> list[dict]:
    """Every EP rank's results of one worker run (cached per session)."""
    if name not in _RUNS:
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rlk-moe-{os.getpid()}-{name}.pt")
        full = dict(ep=ep, lengths=LENGTHS[ep], env=env or R_ALL, port=_free_port(), **spec)
        proc = subprocess.run([sys.executable, os.path.join(HERE, "_moe_worker.py"), json.dumps(full), out],
                              capture_output=True, text=True, timeout=240 + 60 * ep)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _RUNS[name] = torch.load(out, weights_only=False)
        os.unlink(out)
    return _RUNS[name]


def reference():
    """The local engine's trainer (all R) on the whole batch: its log-probs, its gradients of their sum and each
    layer's ``[T, k]`` expert ids."""
    cfg = _moe_worker.model_config({})
    from rlk_repro.model.weights import random_weights

    seqs = [s for r in run("ep1", 1, aux_too=True) for s in r["seqs"]]
    lp, tr = _model.local_logprobs(cfg, random_weights(cfg, 3), seqs)
    routing: list[torch.Tensor] = []
    tr.forward_logprobs(seqs, routing=routing).sum().backward()
    return cfg, lp, {k: v.grad for k, v in tr.master.items()}, routing


def _experts(every: list[dict], cfg, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' gradients of every EP rank, stacked as the local ``w13 [E, 2I, H]`` / ``w2 [E, H, I]``."""
    n, h = cfg.num_experts // len(every), cfg.hidden_size
    m = f"decoder.layers.{layer}.mlp.experts."
    return (torch.cat([r["grads"][m + "weight1"].view(n, h, -1).transpose(1, 2) for r in every]),
            torch.cat([r["grads"][m + "weight2"].view(n, -1, h).transpose(1, 2) for r in every]))


def test_ep1_moe_model_equals_the_local_engine_bitwise():
    from rlk_megatron_provider.weights import from_megatron

    (res,) = run("ep1", 1, aux_too=True)
    cfg, lp, ref, routing = reference()
    assert res["classes"] == ["RlkMoELayer", "RlkTopKRouter", "RlkGroupedExperts"]
    assert torch.equal(res["logp"], lp)
    grads = dict(res["grads"])
    grads["embedding.word_embeddings.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    got = from_megatron(cfg, [grads], experts="grouped")
    assert [k for k in ref if k != "embed" and not torch.equal(got[k], ref[k])] == []
    assert {"layers.1.router", "layers.1.w13", "layers.1.w2"} <= set(ref)
    assert all(torch.equal(a, b) for a, b in zip(res["ids"], routing, strict=True))  # every token's experts, in order
    ops = res["readback"]["modules"]["ffn"]["ops"]
    for op in ("moe_topk", "moe_grouped_linear", "moe_combine"):
        assert ops[op]["contract_id"] == "rlk.moe.v1" and ops[op]["backend_id"].startswith("rlk.")
    assert res["readback"]["modules"]["ffn"]["implementation"] == "rlk"


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_changes_no_bit(ep):
    """EP ranks holding other sequences (other token counts): their log-probs, concatenated, are the local engine's
    on the whole batch and EP 1's; the experts' gradients (each over every rank's tokens) are too; every token goes
    to the same experts."""
    every = run(f"ep{ep}", ep)
    cfg, lp, ref, _ = reference()
    (one,) = run("ep1", 1, aux_too=True)
    assert [r["local_experts"] for r in every] == [list(range(q * 8 // ep, (q + 1) * 8 // ep)) for q in range(ep)]
    assert len({r["logp"].numel() for r in every}) > 1  # the ranks' token counts differ
    assert [s for r in every for s in r["seqs"]] == one["seqs"]  # the same global batch, split
    assert torch.equal(torch.cat([r["logp"] for r in every]), lp)
    for layer in range(cfg.num_hidden_layers):
        w13, w2 = _experts(every, cfg, layer)
        assert torch.equal(w13, ref[f"layers.{layer}.w13"]) and torch.equal(w2, ref[f"layers.{layer}.w2"])
        assert torch.equal(torch.cat([r["ids"][layer] for r in every]), one["ids"][layer])


def test_aux_and_z_losses_do_not_touch_the_log_probs():
    """With the load-balancing and z-loss coefficients set, the log-probs are the same bits; the losses are really
    attached: the routers' gradients change (and what lies below a router: the earlier layers'), the last layer's
    experts' do not (no loss term reaches them: the combine weights are the same values)."""
    (plain,) = run("ep1", 1, aux_too=True)
    aux = plain["aux"]
    assert torch.equal(aux["logp"], plain["logp"])
    for layer in (0, 1):
        r = f"decoder.layers.{layer}.mlp.router.weight"
        assert not torch.equal(aux["grads"][r], plain["grads"][r])
    for e in ("weight1", "weight2"):
        e = f"decoder.layers.1.mlp.experts.{e}"
        assert torch.equal(aux["grads"][e], plain["grads"][e])


def test_the_stock_moe_layer_is_the_negative_control():
    """ffn P (megatron-core's own MoELayer: TopKRouter, SequentialMLP, the all-gather dispatcher's scatter-add
    combine), the rest R: its log-probs differ from the local engine's rlk ones on this CPU."""
    env = {**R_ALL, "RL_KERNEL_FFN_CASE": "P/P"}
    (res,) = run("ep1-stock", 1, env=env, stock_router_without_te=True)
    _, lp, _, _ = reference()
    assert res["classes"][0] == "MoELayer" and res["classes"][2] == "SequentialMLP"
    assert res["logp"].shape == lp.shape and not torch.equal(res["logp"], lp)
    torch.testing.assert_close(res["logp"], lp, rtol=1e-4, atol=1e-4)  # the same model: only the arithmetic differs


@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")
@pytest.mark.filterwarnings("ignore:Apex is not installed:UserWarning")
@pytest.mark.filterwarnings("ignore:absl.logging is not installed:UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*full scope is deprecated.*:UserWarning")
def test_a_moe_slot_in_partial_form_takes_the_rlk_layer():
    """megatron-core 0.19's layer specs hold the MoE slot as ``functools.partial(MoELayer, submodules=...)`` (0.16.1's
    as a ModuleSpec): the provider read only partials of a classmethod (0.19's dense MLP), so an R ffn refused every
    MoE model on the H200 ("not a dense Megatron MLP"). Both forms give rlk's MoE layer, the slot's params kept."""
    import functools

    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules

    from rlk_megatron_provider import _compat
    from rlk_megatron_provider.moe import RlkMoELayer, moe_spec

    sub = MoESubmodules()
    partial = functools.partial(MoELayer, submodules=sub, layer_number=3)
    spec = _compat.ModuleSpec(module=MoELayer, params={"layer_number": 3}, submodules=sub)
    for slot in (partial, spec):
        cls, got = _compat.mlp_parts(slot)
        assert cls is MoELayer and got is sub
        out = moe_spec(slot)
        assert out.module is RlkMoELayer and out.params == {"layer_number": 3}
    assert _compat.mlp_parts(functools.partial(lambda **kw: kw)) == (None, None)  # neither class nor classmethod
