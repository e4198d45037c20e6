"""Issue 36 in the local engine: a Qwen3-MoE model family (``qwen3-moe-tiny``, ``qwen3-moe-30b-a3b-L<n>``) through the
``ffn`` module's MoE form — R/R bitwise with 0 tokens routed differently, P/P (Hugging Face's MoE arithmetic) the
negative control, the routing diagnostic in the metrics and the report, and a control that makes it fire."""

from __future__ import annotations

import json

import pytest
import torch

from rlk_core.errors import RlkConfigError
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_repro.engine.local import run_local
from rlk_repro.engine.routing import routing_metrics
from rlk_repro.model.config import PRESETS, Qwen3Config, preset
from rlk_repro.model.ops import Ops, native_moe
from rlk_repro.model.weights import expected_shapes, load_checkpoint, random_weights, save_checkpoint, to_hf

MOE = "qwen3-moe-tiny"
ROUNDS = 2


def moe_config(small_config, plan: RoutePlan, rounds: int = ROUNDS, **kw):
    return small_config(plan, rounds=rounds, model=MOE, **kw)


@pytest.fixture(scope="module")
def moe_rr(tmp_path_factory, small_config):
    return run_local(moe_config(small_config, RoutePlan("R/R", "R/R", "R/R")), tmp_path_factory.mktemp("moe-rr"))


# -- config and weights ---------------------------------------------------------------------------------------------
def test_the_30b_a3b_layer_shape_preset():
    cfg = preset("qwen3-moe-30b-a3b-L3")
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (2048, 128, 8, 768)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 4, 128)
    assert cfg.num_hidden_layers == 3 and cfg.norm_topk_prob and cfg.is_moe and not cfg.tie_word_embeddings
    shapes = expected_shapes(cfg)
    assert shapes["layers.2.w13"] == (128, 2 * 768, 2048) and shapes["layers.2.w2"] == (128, 2048, 768)
    assert shapes["layers.0.router"] == (128, 2048) and "layers.0.gate_up" not in shapes
    for bad in ("qwen3-moe-30b-a3b-L0", "qwen3-moe-30b-a3b-L", "qwen3-moe-30b-a3b-L02", "qwen3-moe-huge"):
        with pytest.raises(RlkConfigError, match="is not one of"):
            preset(bad)
    assert not PRESETS["tiny"].is_moe and "num_experts" not in PRESETS["tiny"].as_dict()  # dense: as before


def test_the_hf_config_round_trips_and_unsupported_moe_layouts_are_refused():
    cfg = PRESETS[MOE]
    hf = cfg.to_hf()
    assert hf["model_type"] == "qwen3_moe" and hf["architectures"] == ["Qwen3MoeForCausalLM"]
    assert Qwen3Config.from_hf(hf) == cfg
    for key, value, match in (("mlp_only_layers", [0], "every layer sparse"),
                              ("decoder_sparse_step", 2, "every layer sparse"),
                              ("shared_expert_intermediate_size", 64, "shared experts")):
        with pytest.raises(RlkConfigError, match=match):
            Qwen3Config.from_hf({**hf, key: value})
    with pytest.raises(RlkConfigError, match="num_experts_per_tok"):
        cfg.with_overrides(num_experts_per_tok=9)
    with pytest.raises(RlkConfigError, match="lacks the field 'moe_intermediate_size'"):
        Qwen3Config.from_hf({k: v for k, v in hf.items() if k != "moe_intermediate_size"})


def test_checkpoints_are_written_per_expert_and_read_back_bit_for_bit(tmp_path):
    cfg = PRESETS[MOE]
    w = random_weights(cfg, 5)
    save_checkpoint(tmp_path, cfg, w)
    hf = to_hf(cfg, w)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf and "model.layers.0.mlp.gate.weight" in hf
    assert not any(".experts.gate_up_proj" in k for k in hf)
    cfg2, w2 = load_checkpoint(tmp_path)
    assert cfg2 == cfg and set(w2) == set(w) and all(torch.equal(w[k], w2[k]) for k in w)


def test_the_local_model_computes_what_transformers_qwen3_moe_computes(tmp_path):
    """transformers' own Qwen3MoeForCausalLM loads the checkpoint this engine writes (per expert, as the Hub's): its
    log-probs are the local trainer's (P, fp32) and rlk's (R) within fp32 tolerance."""
    transformers = pytest.importorskip("transformers")
    cfg = PRESETS[MOE]
    save_checkpoint(tmp_path, cfg, random_weights(cfg, 9))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    from rlk_repro.engine.trainer import Trainer

    _, weights = load_checkpoint(tmp_path)
    seq = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        want = torch.log_softmax(hf(torch.tensor([seq[:-1]])).logits[0].float(), -1)
    want = want.gather(-1, torch.tensor(seq[1:])[:, None]).squeeze(-1)
    for letter in "PR":
        plan = RoutePlan(f"{letter}/{letter}", f"{letter}/{letter}", f"{letter}/{letter}")
        ops = Ops(plan, "train", ReadbackRecorder("local", "train", plan))
        trainer = Trainer(cfg, weights, ops, device=torch.device("cpu"), dtype=torch.float32, temperature=1.0)
        with torch.no_grad():
            got = trainer.forward_logprobs([seq])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_production_moe_is_hugging_face_s_block():
    """``native_moe`` (the P side) is transformers' Qwen3MoeSparseMoeBlock's arithmetic: the same bits as that block
    with the same weights (its weights cast to x's dtype, index_add_ in x's dtype)."""
    qwen3_moe = pytest.importorskip("transformers.models.qwen3_moe.modeling_qwen3_moe")
    from transformers import Qwen3MoeConfig

    g = torch.Generator().manual_seed(3)
    e, h, i, k = 8, 64, 32, 2
    router, w13, w2 = torch.randn(e, h, generator=g), torch.randn(e, 2 * i, h, generator=g) * 0.1, \
        torch.randn(e, h, i, generator=g) * 0.1
    block = qwen3_moe.Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=h, moe_intermediate_size=i, num_experts=e,
                                                            num_experts_per_tok=k, norm_topk_prob=True)).eval()
    with torch.no_grad():
        block.gate.weight.copy_(router)
        block.experts.gate_up_proj.copy_(w13)
        block.experts.down_proj.copy_(w2)
        x = torch.randn(40, h, generator=g)
        want = block(x[None])[0]
        got, ids = native_moe(x, router, w13, w2, k, True)
    assert torch.equal(got, want)
    assert ids.shape == (40, k)


# -- the loop -------------------------------------------------------------------------------------------------------
def test_rr_moe_is_bitwise_with_no_token_routed_differently(moe_rr):
    rounds = moe_rr.rounds
    assert [r["mismatch_count"] for r in rounds] == [0] * ROUNDS and all(r["element_count"] > 0 for r in rounds)
    assert moe_rr.bitwise["torch_equal"] and moe_rr.exit_code == 0 and moe_rr.weights_changed_every_round
    for r in rounds:
        # every token the model ran on both sides (prompts and responses but their last token)
        assert r["routing_compared_tokens"] > r["element_count"]
        assert r["routing_mismatch_tokens"] == r["routing_mismatch_layer_tokens"] == 0
        assert r["routing_mismatch_fraction"] == 0.0
    rows = [json.loads(x) for x in (moe_rr.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(x["mismatch_count"], x["routing_mismatch_tokens"]) for x in rows] == [(0, 0)] * ROUNDS
    for path in (moe_rr.run_dir / "readbacks").glob("*.json"):
        ops = json.loads(path.read_text())["modules"]["ffn"]["ops"]
        for op in ("moe_topk", "moe_grouped_linear", "moe_combine"):
            assert ops[op]["contract_id"] == "rlk.moe.v1" and ops[op]["backend_id"].startswith("rlk."), (path, op)
        assert ops["moe_grouped_linear"]["call_count"] == 2 * ops["moe_topk"]["call_count"] > 0


def test_pp_moe_is_the_negative_control(tmp_path, small_config):
    """P/P differs on this CPU (every module P); and the MoE block alone on P (ffn P/P, the rest R/R) differs too in
    fp32: per-expert F.linear over however many tokens each expert received (oneDNN picks its kernel by M) and the
    index_add_ combine. (In bf16 the ffn-only cell happened to be bitwise here: the fp32 cell is the control.)"""
    pp = run_local(moe_config(small_config, RoutePlan("P/P", "P/P", "P/P")), tmp_path / "pp")
    assert pp.bitwise["mismatch_count"] > 0 and pp.exit_code == 0 and not pp.bitwise["require_exact"]
    ffn = run_local(moe_config(small_config, RoutePlan("R/R", "P/P", "R/R")), tmp_path / "ffn")
    assert ffn.bitwise["mismatch_count"] > 0
    for path in (ffn.run_dir / "readbacks").glob("*.json"):
        ops = json.loads(path.read_text())["modules"]["ffn"]["ops"]
        assert ops["moe_grouped_linear"]["backend_id"] == "production.torch"


def test_the_routing_diagnostic_counts_expert_sets_not_slot_order():
    a = torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 7]]])  # 2 tokens, 2 layers, k = 2
    same_sets = a.flip(-1)
    assert routing_metrics([a], [same_sets])["routing_mismatch_tokens"] == 0
    other = a.clone()
    other[1, 0, 1] = 3  # token 1, layer 0: {4, 3} instead of {4, 5}
    got = routing_metrics([a[:1], a[1:]], [other[:1], other[1:]])
    assert got == {"routing_compared_tokens": 2, "routing_mismatch_tokens": 1, "routing_mismatch_fraction": 0.5,
                   "routing_mismatch_layer_tokens": 1}
    with pytest.raises(RlkConfigError, match="tokens, layers, k"):
        routing_metrics([a], [a[:1]])


def test_a_missed_weight_sync_shows_in_the_routing_diagnostic(tmp_path, small_config, monkeypatch):
    """The negative control of the diagnostic: a rollout engine that keeps its first weights (a weight sync that
    copied nothing) routes tokens of the later rounds to other experts than the updated trainer does, and says so
    next to the log-prob mismatches."""
    from rlk_repro.engine.rollout import RolloutEngine

    sync = RolloutEngine.load_weights

    def stale(self, weights):
        return True if self.weights else sync(self, weights)

    monkeypatch.setattr(RolloutEngine, "load_weights", stale)
    res = run_local(moe_config(small_config, RoutePlan("R/R", "R/R", "R/R")), tmp_path)
    first, later = res.rounds[0], res.rounds[1]
    assert first["mismatch_count"] == first["routing_mismatch_tokens"] == 0  # the same weights in round 0
    assert later["mismatch_count"] > 0 and later["routing_mismatch_tokens"] > 0
    assert 0 < later["routing_mismatch_fraction"] <= 1
    summary = (res.run_dir / "report" / "summary.md").read_text()
    assert f"{later['routing_mismatch_tokens']}/{later['routing_compared_tokens']}" in summary


def test_the_report_shows_the_routing_diagnostic(moe_rr, rr_run, tmp_path):
    from rlk_repro import cli

    out = tmp_path / "report"
    assert cli.main(["report", str(moe_rr.run_dir), str(rr_run.run_dir), "--output", str(out)]) == cli.EXIT_OK
    doc = json.loads((out / "metrics-summary.json").read_text())
    by_model = {r["model"]: r for r in doc["runs"]}
    moe = by_model[MOE]
    assert moe["routing_mismatch_tokens"] == 0
    assert moe["routing_compared_tokens"] == sum(r["routing_compared_tokens"] for r in moe_rr.rounds)
    assert by_model["tiny"]["routing"] == "dense"
    table = (out / "metrics-summary.md").read_text()
    assert "tokens routed differently (MoE)" in table and f"0 of {moe['routing_compared_tokens']} (0%)" in table
    assert "routing" in (moe_rr.run_dir / "report" / "summary.md").read_text()


def test_the_cli_takes_the_moe_presets_and_the_frameworks_engine_runs_them_at_tp_1():
    from rlk_repro.engine.frameworks import FrameworksRunConfig
    from rlk_repro.model.config import preset_name

    assert preset_name("qwen3-moe-30b-a3b-L4") == "qwen3-moe-30b-a3b-L4"
    FrameworksRunConfig(model=MOE, device="cuda", dtype="bfloat16", top_p=1.0).validate()
    with pytest.raises(RlkConfigError, match="runs a Qwen3-MoE model at TP 1"):
        FrameworksRunConfig(model=MOE, device="cuda", dtype="bfloat16", top_p=1.0, tp=2, train_tp=2,
                            rollout_tp=2).validate()
