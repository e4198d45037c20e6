"""megatron-core 0.19's HybridModel (GPTModel is deprecated there in its favour) with the provider.

A dense Qwen3 block is two hybrid layers, pattern ``"*-"``: the attention half in the stack's
``attention_layer`` slot, the MLP half in ``mlp_layer`` (``MLPLayer``). The model is built with
``rlk_megatron_provider.hybrid_stack_spec`` and the GPT weights moved to hybrid keys (GPT layer i ->
hybrid layers 2i, 2i+1; ``final_layernorm`` -> ``final_norm``). The same bitwise contracts as the
GPTModel tests: all R == the local trainer (TP 1, CP 2), TP 2 == the single-process TP-2 reference.
On megatron-core without HybridModel (0.16) only the refusal runs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model
from test_megatron_provider import MEGATRON_WARNINGS, P_ALL, R_ALL, SBHD, THD, _tcfg, local, run

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]


def _have_hybrid() -> bool:
    """Whether the installed megatron-core has ``megatron.core.models.hybrid`` (file check: no import)."""
    spec = importlib.util.find_spec("megatron")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(r, "core", "models", "hybrid", "hybrid_model.py")) for r in roots)


HAVE_HYBRID = _have_hybrid()
needs_hybrid = pytest.mark.skipif(not HAVE_HYBRID, reason="this megatron-core has no HybridModel (new in 0.19)")
# importing Megatron's stock (TE) hybrid_layer_specs without TE warns about TE's MoE support: not about rlk
STOCK_SPEC_WARNING = pytest.mark.filterwarnings("ignore:Only transformer-engine>=1.7.0 supports MoE:UserWarning")


@pytest.mark.skipif(HAVE_HYBRID, reason="this megatron-core has HybridModel")
def test_strict_refuses_hybrid_without_hybrid_model(provider):
    import rlk_megatron_provider
    from rlk_core.errors import RlkPolicyError

    provider()
    with pytest.raises(RlkPolicyError, match="has no HybridModel"):
        rlk_megatron_provider.hybrid_stack_spec(_tcfg(), rope_theta=1e4)


# -- bitwise against the local trainer ----------------------------------------------------------------
@needs_hybrid
def test_hybrid_tp1_thd_all_r_equals_local_trainer_bitwise():
    res = run("hybrid-tp1-thd", 1, 1, False, "thd", R_ALL, backward=True, via="hybrid")
    ref, _ = local(False, THD)
    assert torch.equal(res["logp"], ref)
    assert torch.equal(res["logp_logits"], ref)
    assert res["counts"] == {"attention": 12, "ffn": 8, "logp": 2}  # the GPTModel's counts: same layers
    mods = res["readback"]["modules"]
    assert {m: mods[m]["implementation"] for m in mods} == {"attention": "rlk", "ffn": "rlk", "logp": "rlk"}
    assert all(mods[m]["contract_id"] and not mods[m]["fallback"] for m in mods)


@needs_hybrid
def test_hybrid_tp1_all_gradients_equal_local_trainer_bitwise():
    from rlk_megatron_provider.weights import from_megatron, to_megatron

    res = run("hybrid-tp1-thd", 1, 1, False, "thd", R_ALL, backward=True, via="hybrid")
    cfg = _model.config(False)
    w = _model.weights(cfg)
    _, tr = local(False, THD)
    tr.forward_logprobs(_model.sequences(THD, cfg.vocab_size)).sum().backward()
    ref = {k: v.grad for k, v in tr.master.items()}
    gpt = list(to_megatron(cfg, w, 1, 0))
    to_gpt = dict(zip(_model.gpt_to_hybrid_keys(dict.fromkeys(gpt)), gpt, strict=True))
    grads = {to_gpt[k]: v for k, v in res["grads"].items()}
    assert len(grads) == len(res["grads"]) and "decoder.final_layernorm.weight" in grads
    grads["embedding.word_embeddings.weight"] = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    got = from_megatron(cfg, [grads])
    assert [k for k in ref if k != "embed" and not torch.equal(got[k], ref[k])] == []


@needs_hybrid
def test_hybrid_sbhd_tied_all_r_equals_local_trainer_bitwise():
    res = run("hybrid-tp1-sbhd-tied", 1, 1, True, "sbhd", R_ALL, via="hybrid")
    ref, _ = local(True, SBHD)
    assert torch.equal(res["logp"], ref)


@needs_hybrid
def test_hybrid_cp2_equals_local_trainer_bitwise():
    res = run("hybrid-cp2-thd", 1, 2, False, "thd", R_ALL, via="hybrid")
    ref, _ = local(False, THD)
    assert torch.equal(res["logp"], ref)
    assert "cp_all_gather" in res["readback"]["modules"]["attention"]["ops"]


@needs_hybrid
def test_hybrid_tp2_equals_tp2_reference_bitwise():
    res = run("hybrid-tp2-thd-tied", 2, 1, True, "thd", R_ALL, via="hybrid")
    cfg = _model.config(True)
    seqs = _model.sequences(THD, cfg.vocab_size)
    assert torch.equal(res["logp"], _model.tp_reference_logprobs(cfg, _model.weights(cfg), seqs, 2))
    assert torch.equal(res["logp_vime"], res["logp_gathered_vocab"])


@needs_hybrid
def test_hybrid_native_plan_differs_from_rlk_negative_control():
    """P/P: Megatron's own layers (the stock final norm through the test's TE stand-in) — the same model,
    other arithmetic, so not the local trainer's bits."""
    res = run("hybrid-p-sbhd", 1, 1, False, "sbhd", P_ALL, via="hybrid")
    ref, _ = local(False, SBHD)
    assert not torch.equal(res["logp"], ref)
    assert torch.allclose(res["logp"], ref, rtol=0, atol=1e-4)
    assert res["counts"] == {"attention": 0, "ffn": 0, "logp": 0}


# -- the spec: stock slots for P modules, refusals naming what is not covered ----------------------------
@needs_hybrid
def test_hybrid_p_module_keeps_stock_slots(provider):
    from rlk_megatron_provider import spec

    provider(ffn="P/P", logp="P/P")
    base = spec.local_hybrid_stack_spec()
    out = spec.rlk_hybrid_stack_spec(_tcfg(), rope_theta=1e4, base=base)
    assert out.submodules.mlp_layer is base.submodules.mlp_layer  # the P module's slot is the stock object
    assert out.module is base.module  # P logp: the stock final norm
    assert out.submodules.attention_layer is not base.submodules.attention_layer
    assert out.submodules.mamba_layer is base.submodules.mamba_layer
    provider()
    assert out.module is not spec.rlk_hybrid_stack_spec(_tcfg(), rope_theta=1e4, base=base).module


@needs_hybrid
@STOCK_SPEC_WARNING
def test_hybrid_strict_refuses_stock_spec_without_qk_norm(provider):
    """Megatron 0.19.2's stock ``hybrid_stack_spec`` has no q/k norm slots: with ``qk_layernorm=True`` it
    would build attention without them, which is not the model the config (Qwen3) describes."""
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import spec

    provider()
    with pytest.raises(RlkPolicyError, match="module 'attention'.*qk_layernorm=True.*attention_layer"):
        spec.rlk_hybrid_stack_spec(_tcfg(), rope_theta=1e4, base=hybrid_stack_spec)
    # without q/k norms in the config the stock TE spec is covered: its fused TE slots become rlk layers
    out = spec.rlk_hybrid_stack_spec(_tcfg(qk_layernorm=False), rope_theta=1e4, base=hybrid_stack_spec)
    att = out.submodules.attention_layer.submodules
    assert att.self_attention.module.__name__ == "RlkSelfAttention"
    assert att.input_layernorm.module.__name__ == "RlkRMSNorm"
    assert out.submodules.mlp_layer.submodules.pre_mlp_layernorm.module.__name__ == "RlkRMSNorm"


@needs_hybrid
@STOCK_SPEC_WARNING
def test_hybrid_strict_refuses_uncovered_slots_and_stacks(provider):
    from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec

    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import _compat, spec

    provider(logp="P/P", ffn="P/P")
    base = spec.local_hybrid_stack_spec()
    gdn = __import__("dataclasses").replace(base.submodules, attention_layer=hybrid_stack_spec.submodules.gdn_layer)
    with pytest.raises(RlkPolicyError, match="module 'attention'.*attention_layer self_attention slot.*not a Self"):
        spec.rlk_hybrid_stack_spec(_tcfg(), rope_theta=1e4, base=_compat.ModuleSpec(module=base.module,
                                                                                  submodules=gdn))
    provider(attention="P/P", ffn="P/P")
    with pytest.raises(RlkPolicyError, match="module 'logp'.*not a HybridStack spec"):
        spec.rlk_hybrid_stack_spec(_tcfg(), rope_theta=1e4, base=_compat.ModuleSpec(module=torch.nn.Linear))
    provider(attention="P/P", logp="P/P")
    with pytest.raises(RlkPolicyError, match="module 'ffn'.*MoE layers"):
        spec.rlk_hybrid_stack_spec(_tcfg(num_moe_experts=4, moe_ffn_hidden_size=128), rope_theta=1e4, base=base)


@needs_hybrid
@pytest.mark.parametrize(("pattern", "module", "what"), [
    ("*-M-", "attention", "'M' \\(Mamba\\)"), ("G-*-", "attention", "'G' \\(Gated DeltaNet\\)"),
    ("*E*E", "ffn", "'E' \\(MoE\\)"), ("D-*-", "attention", "'D' \\(DeepSeek sparse attention\\)"),
])
def test_hybrid_strict_refuses_uncovered_layer_types_in_the_built_model(provider, pattern, module, what):
    """The pattern is the model's, not the spec's: ``prepare_model`` reads the built stack's layer types
    (a stand-in model object here: Mamba / GDN / DSA layers need CUDA-only packages to be built)."""
    from rlk_core.errors import RlkPolicyError
    from rlk_megatron_provider import spec

    provider(**{m: "P/P" for m in ("attention", "ffn", "logp") if m != module})
    model = types.SimpleNamespace(hybrid_layer_pattern=pattern,
                                  decoder=types.SimpleNamespace(layers=[], layer_type_list=list(pattern)))
    with pytest.raises(RlkPolicyError, match=f"module '{module}'.*HybridModel layer {what} is not covered"):
        spec.verify_model(model)
    provider(**{module: "P/P"})  # the module is P: nothing to refuse
    assert spec.verify_model(model) == {"attention": 0, "ffn": 0, "logp": 0}


@needs_hybrid
def test_hybrid_audit_records_uncovered_layer_type(provider):
    from rlk_megatron_provider import spec

    st = provider("audit", ffn="P/P", logp="P/P")
    model = types.SimpleNamespace(hybrid_layer_pattern="*-M-",
                                  decoder=types.SimpleNamespace(layers=[], layer_type_list=list("*-M-")))
    assert spec.verify_model(model) == {"attention": 0, "ffn": 0, "logp": 0}
    rec = st.recorder.to_dict()["modules"]["attention"]
    assert rec["fallback"] and "'M' (Mamba) is not covered" in rec["fallback_reason"]


@needs_hybrid
def test_hybrid_world4_tp2_cp2_equals_tp2_reference_and_repeats_bitwise():
    """World 4 (TP 2 x CP 2, the world tests' 8 query / 4 KV head model): == the single-process TP-2
    reference (!= TP 4's), a second forward the same bits on every rank, every rank all rlk."""
    from test_megatron_world import LENGTHS, MODEL, TIED, tp_reference

    res = run("hybrid-w-tp2-cp2", 2, 2, TIED, "thd", R_ALL, lengths=LENGTHS, model=MODEL, repeat=True,
              all_readbacks=True, via="hybrid")
    assert torch.equal(res["logp"], tp_reference(2))
    assert not torch.equal(res["logp"], tp_reference(4))
    assert torch.equal(res["logp_logits"], res["logp_gathered_vocab"])
    assert [r["repeat_equal"] for r in res["readbacks"]] == [True] * 4
    for r in res["readbacks"]:
        mods = r["readback"]["modules"]
        assert {m: (mods[m]["implementation"], mods[m]["fallback"]) for m in mods} == {
            m: ("rlk", False) for m in ("attention", "ffn", "logp")}
        assert {"all_reduce", "cp_all_gather"} <= set(mods["attention"]["ops"])
