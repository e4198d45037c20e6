"""rlk-megatron-provider against real megatron-core (0.16.1 on CPU, gloo): bitwise checks and refusals.

Runs of the Qwen3-shaped GPTModel happen in spawned gloo process groups (``_worker.py``, one per
scenario, 120 s timeout); the checks compare with rlk-repro's local trainer on the same weights.
What the contracts make bitwise, and what they do not:

- TP 1 and CP 2 (all R): per-token log-probs == the local trainer's (every op is per token; the
  attention contract makes the zigzag CP shard + gathered K/V identical to CP 1);
- TP 2: the row-parallel linears (attention output projection, MLP down projection) reduce their K
  shards' partial sums over ranks (``rlk.collective.v1``), a different K order from TP 1's single GEMM,
  so TP 2 != TP 1 in general (it is what a TP-2 rollout computes); it equals, bitwise, the
  single-process TP-2 reference (``_model.tp_reference_logprobs``). What holds under TP 2: the logp
  module — vocab-parallel partials + merge == ``linear_logprobs`` on the gathered vocabulary == the
  logits path, bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model

HERE = os.path.dirname(os.path.abspath(__file__))
R_ALL = {"RL_KERNEL_ATTENTION_CASE": "R/R", "RL_KERNEL_FFN_CASE": "R/R", "RL_KERNEL_LOGP_CASE": "R/R",
         "RL_KERNEL_MODE": "strict"}
P_ALL = {"RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_FFN_CASE": "P/P", "RL_KERNEL_LOGP_CASE": "P/P",
         "RL_KERNEL_MODE": "strict"}
THD = [8, 12, 4]  # every length a multiple of 2 * cp for CP 2
SBHD = [8, 8, 8]
# megatron-core warns on import that TE / Apex are absent (0.19: also absl-py) and about its own deprecated
# torch.jit use; none is about rlk (the CPU tests use the local spec on purpose).
MEGATRON_WARNINGS = [
    pytest.mark.filterwarnings("ignore:Transformer Engine and Apex are not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:Apex is not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore:absl.logging is not installed:UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron"),
    pytest.mark.filterwarnings("ignore:.*torch.jit.script_method.*:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:.*full scope is deprecated.*:UserWarning"),
]
pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]

_RUNS: dict[str, dict] = {}


def _free_port() -> int:
    """A TCP port free now on 127.0.0.1 (modules importing this one keep no port counters that could meet)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(name: str, tp: int, cp: int, tied: bool, layout: str, env: dict, backward: bool = False,
        via: str = "block_spec", lengths: list[int] | None = None, model: dict | None = None,
        repeat: bool = False, all_readbacks: bool = False, sequence_parallel: bool = False) -> dict:
    """One worker run per scenario per session (cached). ``model``: config overrides (``_model.config``);
    ``repeat``: a first forward before the measured one (``logp_repeat``); ``all_readbacks``: every rank's
    readback (``readbacks``, by global rank); ``backward``: one backward, every TP rank's gradients (``tp_grads``)
    after megatron-core's TP finalize; ``sequence_parallel``: Megatron's ``--sequence-parallel`` (TP > 1)."""
    if name not in _RUNS:
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"rlk-megatron-{os.getpid()}-{name}.pt")
        if lengths is None:
            lengths = THD if layout == "thd" else SBHD
        spec = dict(tp=tp, cp=cp, tied=tied, lengths=lengths, layout=layout, backward=backward, env=env,
                    port=_free_port(), via=via, model=model or {}, repeat=repeat, all_readbacks=all_readbacks,
                    all_grads=backward, finalize=backward, sequence_parallel=sequence_parallel)
        proc = subprocess.run([sys.executable, os.path.join(HERE, "_worker.py"), json.dumps(spec), out],
                              capture_output=True, text=True, timeout=120 + 40 * tp * cp)
        assert proc.returncode == 0, proc.stderr[-4000:]
        _RUNS[name] = torch.load(out, weights_only=False)
        os.unlink(out)
    return _RUNS[name]


def local(tied: bool, lengths: list[int], **model):
    cfg = _model.config(tied, **model)
    return _model.local_logprobs(cfg, _model.weights(cfg), _model.sequences(lengths, cfg.vocab_size))


# -- the weight converter (exact, both ways) ----------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_weight_converter_round_trip(tp, tied):
    from rlk_megatron_provider.weights import from_megatron, qkv_to_megatron, to_megatron

    cfg = _model.config(tied)
    w = _model.weights(cfg)
    shards = [to_megatron(cfg, w, tp, r) for r in range(tp)]
    back = from_megatron(cfg, shards)
    assert sorted(back) == sorted(w)
    assert all(torch.equal(back[k], w[k]) for k in w)
    assert ("output_layer.weight" in shards[0]) is (not tied)
    # the layouts really differ (so the round trip is not the identity twice): Megatron groups q/k/v per KV head
    assert not torch.equal(qkv_to_megatron(w["layers.0.qkv"], cfg), w["layers.0.qkv"])
    fc1 = shards[-1]["decoder.layers.0.mlp.linear_fc1.weight"]
    i = cfg.intermediate_size // tp
    assert torch.equal(fc1[:i], w["layers.0.gate_up"][(tp - 1) * i:tp * i])  # rank r holds [gate_r; up_r]


# -- bitwise against the local trainer ----------------------------------------------------------------
def test_tp1_thd_all_r_equals_local_trainer_bitwise():
    res = run("tp1-thd", 1, 1, False, "thd", R_ALL, backward=True)
    ref, _ = local(False, THD)
    assert torch.equal(res["logp"], ref)
    assert torch.equal(res["logp_logits"], ref)  # rlk LM head -> logits -> rlk log-probs: same bits as fused
    assert res["counts"] == {"attention": 12, "ffn": 8, "logp": 2}
    mods = res["readback"]["modules"]
    assert {m: mods[m]["implementation"] for m in mods} == {"attention": "rlk", "ffn": "rlk", "logp": "rlk"}
    assert all(mods[m]["contract_id"] and not mods[m]["fallback"] for m in mods)
    assert {"attention_varlen", "rope", "rms_norm", "linear"} <= set(mods["attention"]["ops"])
    assert {"linear_logprobs", "rms_norm"} <= set(mods["logp"]["ops"])


def _tp1_grads():
    from rlk_megatron_provider.weights import from_megatron

    res = run("tp1-thd", 1, 1, False, "thd", R_ALL, backward=True)
    cfg = _model.config(False)
    _, tr = local(False, THD)
    tr.forward_logprobs(_model.sequences(THD, cfg.vocab_size)).sum().backward()
    ref = {k: v.grad for k, v in tr.master.items()}
    grads = dict(res["grads"])
    grads["embedding.word_embeddings.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    return from_megatron(cfg, [grads]), ref


def test_tp1_gradients_of_head_and_last_layer_equal_local_trainer_bitwise():
    """Backward through Megatron (the rlk ops' backward) == the local trainer's for the LM head, the final
    norm and every weight of the last layer's attention and MLP."""
    got, ref = _tp1_grads()
    keys = ["lm_head", "norm"] + [f"layers.1.{n}" for n in ("qkv", "q_norm", "k_norm", "o", "post_norm",
                                                             "gate_up", "down")]
    assert [k for k in keys if not torch.equal(got[k], ref[k])] == []


def test_tp1_all_layer_gradients_equal_local_trainer_bitwise():
    """Every layer's gradients == the local trainer's: the QKV projection computes with its rows in the
    local [q; k; v] order (RlkQKVLinear), so dX = dY W reduces over the rows in the same order."""
    got, ref = _tp1_grads()
    assert [k for k in ref if k != "embed" and not torch.equal(got[k], ref[k])] == []


def test_qkv_linear_is_megatron_layout_outside_and_qkv_order_inside():
    """RlkQKVLinear's output is, column for column, the GEMM of Megatron's weight (exact data movement
    around the [q; k; v] GEMM): its forward equals the plain rlk linear on Megatron's rows bitwise here."""
    from rlk_core.ops import linear
    from rlk_megatron_provider.weights import qkv_from_megatron, qkv_to_megatron

    cfg = _model.config(False)
    w = _model.weights(cfg)["layers.0.qkv"]
    meg = qkv_to_megatron(w, cfg)
    order = torch.arange(meg.shape[0]).reshape(cfg.num_key_value_heads, -1, cfg.head_dim)
    r = cfg.num_attention_heads // cfg.num_key_value_heads
    rows = torch.cat([order[:, :r].reshape(-1), order[:, r].reshape(-1), order[:, r + 1].reshape(-1)])
    assert torch.equal(meg[rows], qkv_from_megatron(meg, cfg))  # the layer's row order is the local layout
    x = torch.randn(7, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    assert torch.equal(linear(x, meg[rows]).index_select(-1, torch.argsort(rows)), linear(x, meg))


def test_sbhd_tied_head_all_r_equals_local_trainer_bitwise():
    res = run("tp1-sbhd-tied", 1, 1, True, "sbhd", R_ALL)
    ref, _ = local(True, SBHD)
    assert torch.equal(res["logp"], ref)


def test_cp2_equals_cp1_and_local_trainer_bitwise():
    cp2 = run("cp2-thd", 1, 2, False, "thd", R_ALL)
    cp1 = run("tp1-thd", 1, 1, False, "thd", R_ALL, backward=True)
    assert torch.equal(cp2["logp"], cp1["logp"])
    assert torch.equal(cp2["logp_logits"], cp1["logp"])
    assert "cp_all_gather" in cp2["readback"]["modules"]["attention"]["ops"]


def test_tp2_logp_provider_equals_linear_logprobs_on_gathered_vocab():
    res = run("tp2-thd-tied", 2, 1, True, "thd", R_ALL)
    assert torch.equal(res["logp_nograd"], res["logp_gathered_vocab"])  # partials + gather + merge
    assert torch.equal(res["logp"], res["logp_gathered_vocab"])  # differentiable path (gathered shards)
    assert torch.equal(res["logp_logits"], res["logp_gathered_vocab"])  # slime's logits path
    assert torch.equal(res["logp_vime"], res["logp_gathered_vocab"])  # VIME's provider ABI
    ops = res["readback"]["modules"]["logp"]["ops"]
    assert {"linear_logp_partials", "merge_logp_partials", "all_gather"} <= set(ops)
    # TP 2 is not TP 1: the row-parallel reductions change the K order (module docstring); it stays close
    ref, _ = local(True, THD)
    assert torch.allclose(res["logp"], ref, rtol=0, atol=1e-5)
    # ... and it is the single-process reference of TP 2: per-rank K slices, rlk_collectives.reduce_reference
    cfg = _model.config(True)
    assert torch.equal(res["logp"], _model.tp_reference_logprobs(cfg, _model.weights(cfg),
                                                                 _model.sequences(THD, cfg.vocab_size), 2))


def test_native_plan_differs_from_rlk_negative_control():
    res = run("p-sbhd", 1, 1, False, "sbhd", P_ALL)
    ref, _ = local(False, SBHD)
    assert not torch.equal(res["logp"], ref)
    assert torch.allclose(res["logp"], ref, rtol=0, atol=1e-4)  # the same model, other arithmetic
    assert res["counts"] == {"attention": 0, "ffn": 0, "logp": 0}
    mods = res["readback"]["modules"]
    assert all(mods[m]["implementation"] == "production" and mods[m]["contract_id"] is None for m in mods)


# -- fail closed (in process: no process group needed to build specs) -----------------------------------
def _tcfg(**overrides):
    return _model.transformer_config(_model.config(False), 1, 1, **overrides)


def test_strict_refuses_unsupported_megatron_version(provider, monkeypatch):
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import _compat

    monkeypatch.setattr(_compat, "version", lambda: "0.15.3")
    with pytest.raises(RlkPolicyError, match=r"module 'attention'.*0\.15\.3 is outside the verified range"):
        provider()


@pytest.mark.parametrize(("overrides", "module", "reason"), [
    ({"add_bias_linear": True}, "attention", "add_bias_linear"),
    ({"fp8": "hybrid"}, "attention", "fp8='hybrid'.*TE feature"),
    ({"rotary_interleaved": True}, "attention", "rotary_interleaved"),
    ({"activation_func": torch.nn.functional.gelu}, "ffn", "not SwiGLU"),
])
def test_strict_refuses_uncovered_config(provider, overrides, module, reason):
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import spec

    cases = {m: ("R/R" if m == module else "P/P") for m in ("attention", "ffn", "logp")}
    provider(**cases)
    cfg = types.SimpleNamespace(**{**vars(_tcfg()), **overrides})  # TE-only values need no TE to be refused
    with pytest.raises(RlkPolicyError, match=rf"module '{module}'.*{reason}"):
        spec.rlk_layer_spec(cfg, rope_theta=1e4)


def test_strict_refuses_uncovered_layer_classes(provider):
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import _compat, spec

    provider(logp="P/P")
    with pytest.raises(RlkPolicyError, match="module 'attention'.*not a TransformerLayer spec"):
        spec.rlk_layer_spec(_tcfg(), rope_theta=1e4, base=_compat.ModuleSpec(module=torch.nn.Linear))
    base = _compat.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    moe = _compat.ModuleSpec(module=base.module, params=base.params,
                             submodules=__import__("dataclasses").replace(base.submodules, mlp=torch.nn.Linear))
    provider(attention="P/P", logp="P/P")
    with pytest.raises(RlkPolicyError, match="module 'ffn'.*not a dense Megatron MLP"):
        spec.rlk_layer_spec(_tcfg(), rope_theta=1e4, base=moe)


def test_strict_refuses_missing_patch_target(provider, monkeypatch):
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import patches

    monkeypatch.setitem(sys.modules, "fake_slime_loss", types.ModuleType("fake_slime_loss"))
    provider()
    with pytest.raises(RlkPolicyError, match="module 'logp'.*no attribute 'calculate_log_probs_and_entropy'"):
        patches.bind_slime_logprobs("fake_slime_loss")


def test_slime_binding_replaces_the_name_idempotently(provider, monkeypatch):
    from rlk_megatron_provider import logp, patches

    fake = types.ModuleType("fake_slime_loss2")
    original = fake.calculate_log_probs_and_entropy = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "fake_slime_loss2", fake)
    provider()
    assert patches.bind_slime_logprobs("fake_slime_loss2") and patches.bind_slime_logprobs("fake_slime_loss2")
    assert fake.calculate_log_probs_and_entropy is logp.slime_log_probs_and_entropy
    assert fake._rlk_original_calculate_log_probs_and_entropy is original


def test_audit_records_fallback_and_keeps_stock_slots(provider):
    from rlk_megatron_provider import _compat, spec

    st = provider("audit", attention="P/P", logp="P/P")
    base = _compat.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    cfg = types.SimpleNamespace(**{**vars(_tcfg()), "add_bias_linear": True})
    assert spec.rlk_layer_spec(cfg, rope_theta=1e4, base=base) is base  # Megatron's own layers stay
    rec = st.recorder.to_dict()["modules"]["ffn"]
    assert rec["fallback"] and "add_bias_linear" in rec["fallback_reason"]


def test_p_module_never_gets_rlk_layers(provider):
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import _compat, layers, spec

    provider(ffn="P/P")
    base = _compat.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    out = spec.rlk_layer_spec(_tcfg(), rope_theta=1e4, base=base)
    assert out.submodules.mlp is base.submodules.mlp  # the P module's slot is the stock object
    assert out.submodules.pre_mlp_layernorm is base.submodules.pre_mlp_layernorm
    assert out.submodules.self_attention is not base.submodules.self_attention
    with pytest.raises(RlkPolicyError, match="module 'ffn'"):
        layers.RlkRMSNorm(_tcfg(), 64, rlk_module="ffn")


def test_vime_provider_equals_linear_logprobs(provider):
    """VIME's ABI at TP 1 (no group): the result is linear_logprobs on hidden + projection, bitwise."""
    from rlk_core.ops import linear_logprobs
    from rlk_megatron_provider import linear_logp

    provider()
    g = torch.Generator().manual_seed(5)
    hidden, proj = torch.randn(9, 64, generator=g), torch.randn(128, 64, generator=g) * 0.1
    targets = torch.randint(0, 128, (9,), generator=g)
    req = types.SimpleNamespace(targets=targets, tp_group=None, token_layout="single", temperature=0.7,
                                context=types.SimpleNamespace(hidden=hidden, projection=proj,
                                                              vocab_partition=(0, 128), local_logits=None))
    res = linear_logp(req)
    assert torch.equal(res.logp, linear_logprobs(hidden, proj, targets, 0.7)[0])
    assert (res.backend_id, res.contract_id, res.entropy) == ("rlk.megatron.linear_logp", "rlk.logp.v1", None)


def test_vime_and_slime_entropy_is_of_the_distribution_their_logprobs_are_of(provider, monkeypatch):
    """An entropy request gets rlk.entropy.v1's entropy: unfiltered without a kept set, of the processed
    distribution with a keep mask (mask form) or rlk's kept sets (threshold form), bitwise equal; differentiable
    (the gradient reaches the hidden states); the applied threshold is in the provenance."""
    from rlk_core.ops import entropy, kept_set, linear
    from rlk_core.ops.kept_set import kept_mask
    from rlk_megatron_provider import linear_logp
    from rlk_megatron_provider.logp import slime_log_probs_and_entropy

    st = provider()
    g = torch.Generator().manual_seed(6)
    hidden, proj = torch.randn(9, 64, generator=g), torch.randn(128, 64, generator=g) * 0.3
    logits = linear(hidden, proj)
    ks = kept_set(logits, 0.7, 10, 0.9)
    unfiltered, processed = entropy(logits, 0.7)[0], entropy(logits, 0.7, kept=ks)[0]
    assert not torch.equal(unfiltered, processed)
    targets = logits.argmax(-1)
    ctx = types.SimpleNamespace(hidden=hidden.clone().requires_grad_(), projection=proj, vocab_partition=(0, 128))
    req = types.SimpleNamespace(targets=targets, tp_group=None, token_layout="single", temperature=0.7,
                                with_entropy=True, context=ctx)
    res = linear_logp(req)
    assert torch.equal(res.entropy, unfiltered) and res.provenance["entropy"]["distribution"] == "unfiltered"
    res.entropy.sum().backward()
    assert ctx.hidden.grad is not None and torch.isfinite(ctx.hidden.grad).all()
    req.log_prob_keep_mask = kept_mask(logits, 0.7, ks)
    res = linear_logp(req)
    assert torch.equal(res.entropy, processed) and res.provenance["entropy"]["distribution"] == "processed"
    req.log_prob_keep_mask, req.metadata = None, {"rlk_kept": (ks.value, ks.token_id)}
    res = linear_logp(req)
    assert torch.equal(res.entropy, processed) and res.provenance["rlk_kept"]["source"] == "rollout"
    # the trainer's own kept sets from the rollout's filters: the threshold it applied comes back to the caller
    monkeypatch.setenv("RL_KERNEL_LOGP_SAMPLING", "top_k=10,top_p=0.9")
    req.metadata = None
    res = linear_logp(req)
    kept = res.provenance["rlk_kept"]
    assert kept["source"] == "trainer" and torch.equal(res.entropy, processed)
    assert all(torch.equal(kept[k], getattr(ks, k)) for k in ("value", "token_id", "size"))
    # slime's binding, on the (already tempered) logits: the same bits with the mask or the rollout's filters
    z = logits / 0.7
    ks1 = kept_set(z, 1.0, 10, 0.9)
    _, h = slime_log_probs_and_entropy(z[None], targets[None], None, with_entropy=True)
    assert torch.equal(h[0], entropy(z, 1.0, kept=ks1)[0])
    monkeypatch.delenv("RL_KERNEL_LOGP_SAMPLING")
    _, h = slime_log_probs_and_entropy(z[None], targets[None], None, with_entropy=True,
                                       log_prob_keep_mask=kept_mask(z, 1.0, ks1)[None])
    assert torch.equal(h[0], entropy(z, 1.0, kept=ks1)[0])
    ops = st.recorder.to_dict()["modules"]["logp"]
    assert "entropy" in str(ops) and "rlk.entropy.v1" in str(ops)


def test_slime_top_p_replay_and_vime_kept_sets_are_processed_logprobs(provider, monkeypatch):
    """slime's ``log_prob_keep_mask`` (top-p replay) and VIME's request with a keep mask or rlk's kept sets give
    the processed log-prob of contract rlk.logp.processed.v1, bitwise (mask form == threshold form)."""
    from rlk_core.ops import kept_set, linear, linear_logprobs, token_logprobs
    from rlk_core.ops.kept_set import kept_mask
    from rlk_megatron_provider import linear_logp
    from rlk_megatron_provider.logp import slime_log_probs_and_entropy

    provider()
    g = torch.Generator().manual_seed(8)
    hidden, proj = torch.randn(9, 64, generator=g), torch.randn(128, 64, generator=g) * 0.3
    logits = linear(hidden, proj)
    ks = kept_set(logits, 1.0, 10, 0.9)
    mask = kept_mask(logits, 1.0, ks)
    targets = logits.argmax(-1)
    want = token_logprobs(logits, targets, 1.0, kept=ks)[0]
    assert torch.equal(want, linear_logprobs(hidden, proj, targets, 1.0, kept=ks)[0])
    got, _ = slime_log_probs_and_entropy(logits[None], targets[None], None, log_prob_keep_mask=mask[None])
    assert torch.equal(got[0], want)
    req = types.SimpleNamespace(targets=targets, tp_group=None, token_layout="single", temperature=1.0,
                                log_prob_keep_mask=mask, context=types.SimpleNamespace(
                                    hidden=hidden, projection=proj, vocab_partition=(0, 128), local_logits=None))
    assert torch.equal(linear_logp(req).logp, want)
    req.log_prob_keep_mask, req.metadata = None, {"rlk_kept": (ks.value, ks.token_id)}
    res = linear_logp(req)
    assert torch.equal(res.logp, want) and res.provenance["logprobs"] == "processed (rlk kept sets)"
    assert not torch.equal(want, token_logprobs(logits, targets, 1.0)[0])  # the unfiltered log-prob differs
    # no mask, no kept sets: the rollout's filters from RL_KERNEL_LOGP_SAMPLING, the trainer's own kept sets
    monkeypatch.setenv("RL_KERNEL_LOGP_SAMPLING", "top_k=10,top_p=0.9")
    req.metadata = None
    assert torch.equal(linear_logp(req).logp, want)
    assert torch.equal(slime_log_probs_and_entropy(logits[None], targets[None], None)[0][0], want)
