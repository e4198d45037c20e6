"""Issue 36: the provider's MoE layer spec in real megatron-core on CPU (gloo, ``_moe_worker.py``): a Qwen3-MoE
``GPTModel`` (8 experts, top-2, and top-4 in the same processes) whose router and experts slots are rlk's — log-probs
and gradients bitwise equal to the local engine's trainer and across expert-parallel sizes 1 / 2 / 4 / 8 (each EP rank
its own sequences of other lengths); the aux / z losses attached without touching a log-prob; the stock MoE layer as
the negative controls: other bits than rlk's at EP 1, and at EP 2 other bits than at EP 1 with top-4 (with top-2 the
stock layer is exact across EP too: a token's combine adds two values, the same sum in any order); TP 2 (expert TP 1)
in the provider's TP-invariant mode equal to TP 1 in log-probs and every gradient, and without the mode not."""

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
LENGTHS = {1: [[8, 12, 4, 10]], 2: [[8, 12], [4, 10]], 4: [[8], [12], [4], [10]],  # one global batch, split
           8: [[8], [12], [4], [10], [6], [9], [5], [11]]}  # EP 8 (one expert a rank): a sequence a rank, 4 more
_RUNS: dict[str, list[dict]] = {}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, ep: int, env: dict | None = None, **spec) -> list[dict]:
    """Every EP rank's results of one worker run (cached per session)."""
    if name not in _RUNS:
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rlk-moe-{os.getpid()}-{name}.pt")
        full = {"ep": ep, "lengths": LENGTHS[ep], "env": env or R_ALL, "port": _free_port(), **spec}
        proc = subprocess.run([sys.executable, os.path.join(HERE, "_moe_worker.py"), json.dumps(full), out],
                              capture_output=True, text=True, timeout=240 + 60 * ep)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _RUNS[name] = torch.load(out, weights_only=False)
        os.unlink(out)
    return _RUNS[name]


TOP4 = {"model": {"num_experts_per_tok": 4}}  # a combine of 4 terms: its order matters (the stock layer's EP control)
_REFS: dict[tuple, tuple] = {}


def reference(variant: str | None = None, seqs: list | None = None):
    """The local engine's trainer (all R) on the whole batch (or on ``seqs``): its log-probs, its gradients of their
    sum and each layer's ``[T, k]`` expert ids (``variant``: of ``TOP4``'s model)."""
    if seqs is None:
        seqs = [s for r in run("ep1", 1, aux_too=True) for s in r["seqs"]]
    key = (variant, tuple(tuple(s) for s in seqs))
    if key not in _REFS:
        cfg = _moe_worker.model_config(TOP4 if variant == "top4" else {})
        from rlk_repro.model.weights import random_weights

        lp, tr = _model.local_logprobs(cfg, random_weights(cfg, 3), seqs)
        routing: list[torch.Tensor] = []
        tr.forward_logprobs(seqs, routing=routing).sum().backward()
        _REFS[key] = cfg, lp, {k: v.grad for k, v in tr.master.items()}, routing
    return _REFS[key]


def _dense(cfg, every: list[dict], rank: int) -> dict:
    """EP rank ``rank``'s gradients of everything but the experts (and the embedding), in the local layout."""
    from rlk_megatron_provider.weights import from_megatron

    shards = [dict(r["grads"]) for r in [every[rank]] + every[:rank] + every[rank + 1:]]  # its dense ones first
    for sh in shards:
        sh["embedding.word_embeddings.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    got = from_megatron(cfg, shards, ep=len(every), experts="grouped")
    return {k: v for k, v in got.items() if k != "embed" and not k.endswith((".w13", ".w2"))}


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


@pytest.mark.parametrize("ep", [2, 4, 8])
@pytest.mark.parametrize("variant", [None, "top4"])
def test_expert_parallel_changes_no_bit(ep, variant):
    """EP ranks holding other sequences (other token counts): their log-probs, concatenated, are the local engine's
    on the whole batch and (EP 2, 4) EP 1's; the experts' gradients (each over every rank's tokens) are too; every
    token goes to the same experts. Top-2 and top-4 (run in the same processes). EP 8 (one expert a rank, a sequence
    a rank) runs a batch of 8 sequences, EP 1's 4 and 4 more: it is held to the local engine on that batch (which EP 1
    equals bitwise on its own: test_ep1_moe_model_equals_the_local_engine_bitwise)."""
    every = run(f"ep{ep}", ep, variants={"top4": TOP4})
    seqs = [s for r in every for s in r["seqs"]]
    cfg, lp, ref, routing = reference(variant, seqs)
    (one,) = run("ep1", 1, aux_too=True)
    assert [r["local_experts"] for r in every] == [list(range(q * 8 // ep, (q + 1) * 8 // ep)) for q in range(ep)]
    assert len({r["logp"].numel() for r in every}) > 1  # the ranks' token counts differ
    if ep < 8:
        assert seqs == one["seqs"]  # the same global batch, split
    else:
        assert len(seqs) == 8 and seqs[:4] == one["seqs"]
    if variant:
        every = [r["variants"][variant] for r in every]
    assert every[0]["ids"][0].shape[1] == cfg.num_experts_per_tok
    assert torch.equal(torch.cat([r["logp"] for r in every]), lp)
    for layer in range(cfg.num_hidden_layers):
        w13, w2 = _experts(every, cfg, layer)
        assert torch.equal(w13, ref[f"layers.{layer}.w13"]) and torch.equal(w2, ref[f"layers.{layer}.w2"])
        assert torch.equal(torch.cat([r["ids"][layer] for r in every]), routing[layer])
    if variant is None and ep < 8:
        for layer in range(cfg.num_hidden_layers):
            assert torch.equal(torch.cat([r["ids"][layer] for r in every]), one["ids"][layer])
    # every other gradient (attention, norms, routers, output layer) on an EP rank is over its own tokens (their sum
    # over the ranks is data parallelism's reduction, Megatron's): the local engine's on that rank's sequences alone
    for rank, r in enumerate(every):
        want = reference(variant, r["seqs"])[2]
        got = _dense(cfg, every, rank)
        assert {"layers.0.router", "layers.1.qkv", "norm"} <= set(got), sorted(got)
        assert [k for k in got if not torch.equal(got[k], want[k])] == [], rank


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


STOCK = {**R_ALL, "RL_KERNEL_FFN_CASE": "P/P"}
EVEN = {1: [[8, 12, 12, 8]], 2: [[8, 12], [12, 8]]}  # the stock all-gather dispatcher needs equal counts per rank


def stock_run(ep: int) -> list[dict]:
    """ffn P (megatron-core's own MoELayer: TopKRouter, SequentialMLP, the all-gather dispatcher's scatter-add
    combine; reduce-scatter of the ranks' partial outputs at EP > 1), the rest R: at EP 1 the local engine's batch,
    then at EP 1 and 2 a batch of equal per-rank counts, top-2 and top-4."""
    if ep == 1:
        even = {"lengths": EVEN[1]}
        return run("ep1-stock", 1, env=STOCK, stock_router_without_te=True,
                   variants={"even": even, "even-top4": {**even, **TOP4}})
    return run("ep2-stock", 2, env=STOCK, stock_router_without_te=True, lengths=EVEN[2], variants={"top4": TOP4})


def test_the_stock_moe_layer_is_the_negative_control():
    """The stock layer's log-probs differ from the local engine's rlk ones on this CPU."""
    (res,) = stock_run(1)
    _, lp, _, _ = reference()
    assert res["classes"][0] == "MoELayer" and res["classes"][2] == "SequentialMLP"
    assert res["logp"].shape == lp.shape and not torch.equal(res["logp"], lp)
    torch.testing.assert_close(res["logp"], lp, rtol=1e-4, atol=1e-4)  # the same model: only the arithmetic differs


def test_the_stock_moe_layer_at_ep_2_differs_from_ep_1_with_top_4():
    """The EP negative control: the stock layer at EP 2 (each expert's weighted rows scatter-added on its rank, the
    ranks' partial outputs summed by a reduce-scatter) against EP 1 on the same batch. With top-4 a token's four
    contributions are added in another grouping: other bits. With top-2 the stock layer is exact across EP as well
    (two terms: ``a + b`` in either order and grouping), so top-2 alone would not tell an exact layer from it."""
    (one,) = stock_run(1)
    two = stock_run(2)
    assert [r["classes"][0] for r in two] == ["MoELayer"] * 2
    assert [s for r in two for s in r["seqs"]] == one["variants"]["even"]["seqs"]
    assert torch.equal(torch.cat([r["logp"] for r in two]), one["variants"]["even"]["logp"])  # top-2: exact
    got = torch.cat([r["variants"]["top4"]["logp"] for r in two])
    want = one["variants"]["even-top4"]["logp"]
    assert got.shape == want.shape and not torch.equal(got, want)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


INVARIANT = {**R_ALL, "RL_KERNEL_TP_INVARIANT": "4"}  # the provider's TP-invariant mode, G = 4 leaves


def _full(cfg, every: list[dict]) -> dict:
    """Every TP rank's gradients gathered to the local layout (EP 1: the experts are whole on every TP rank)."""
    from rlk_megatron_provider.weights import from_megatron

    return from_megatron(cfg, [r["grads"] for r in every])


def test_tp_2_changes_no_bit_in_invariant_mode():
    """TP 2 (expert TP 1: every TP rank routes the same tokens through the whole experts; the attention's linears
    split as Megatron splits them, in the provider's TP-invariant mode): the log-probs on both TP ranks and every
    gradient — experts, routers, attention, norms, embedding, output layer — gathered to the full shapes are TP 1's
    in the same mode, bitwise."""
    cfg = _moe_worker.model_config({})
    (one,) = run("tp1-inv", 1, env=INVARIANT)
    two = run("tp2-inv", 1, env=INVARIANT, tp=2)
    assert [r["classes"] for r in two] == [["RlkMoELayer", "RlkTopKRouter", "RlkGroupedExperts"]] * 2
    assert torch.equal(two[0]["logp"], one["logp"]) and torch.equal(two[1]["logp"], one["logp"])
    want, got = _full(cfg, [one]), _full(cfg, two)
    assert {"layers.1.w13", "layers.1.w2", "layers.1.router", "layers.1.qkv", "embed", "lm_head"} <= set(want)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    assert all(bool(g.abs().sum() > 0) for g in want.values())  # no gradient is trivially zero


def test_tp_2_without_invariant_mode_differs_the_negative_control():
    """The same TP 2 model without the mode: its log-probs and the gradients below the TP-split reductions differ from
    TP 1's (the row-parallel output projection's all-reduce, the column-parallel input gradients' sum over ranks)."""
    cfg = _moe_worker.model_config({})
    (one,) = run("ep1", 1, aux_too=True)
    two = run("tp2-off", 1, tp=2)
    assert not torch.equal(two[0]["logp"], one["logp"])
    got, want = _full(cfg, two), _full(cfg, [one])
    assert {"layers.0.qkv", "layers.0.q_norm", "layers.0.router", "layers.0.w13", "embed"} <= {
        k for k in want if not torch.equal(got[k], want[k])}


@pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning")
@pytest.mark.filterwarnings("ignore:Apex is not installed:UserWarning")
@pytest.mark.filterwarnings("ignore:absl.logging is not installed:UserWarning")
@pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron")
@pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning")
@pytest.mark.filterwarnings("ignore:.*full scope is deprecated.*:UserWarning")
def test_tp_with_ep_and_sequence_parallelism_are_refused():
    """TP > 1 with EP > 1 (the TP ranks hold the same tokens: each would reach the experts TP times) and sequence
    parallelism in an MoE model are refused by name."""
    import types

    from rlk_megatron_provider.moe import moe_problems

    def cfg(**kw):
        return types.SimpleNamespace(**{"tensor_model_parallel_size": 1, "expert_model_parallel_size": 1, **kw})

    assert moe_problems(cfg(tensor_model_parallel_size=2)) == []
    assert moe_problems(cfg(expert_model_parallel_size=2)) == []
    assert any("TP 2 with EP 2" in p for p in moe_problems(cfg(tensor_model_parallel_size=2,
                                                               expert_model_parallel_size=2)))
    assert any("sequence parallelism" in p for p in moe_problems(cfg(tensor_model_parallel_size=2,
                                                                     sequence_parallel=True)))


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
