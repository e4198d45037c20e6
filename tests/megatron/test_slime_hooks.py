"""The slime / VIME hook callables of rlk-megatron-provider against real megatron-core (0.16.1, CPU).

- ``slime_spec`` (``--spec rlk_megatron_provider slime_spec``): rlk classes in exactly the R modules' slots,
  Megatron's stock local classes in the P ones; the model it builds (as slime delegates to it) computes the
  local trainer's log-probs bit for bit;
- ``record_logprobs`` (``--custom-tis-function-path``): returns its inputs, writes ``rlk.vime-logprobs.v1``
  records that ``rlk-validate import-vime`` re-packs exactly.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import types

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _model
from test_megatron_provider import MEGATRON_WARNINGS, R_ALL, THD, local, run

import rlk_megatron_provider
from rlk_core.errors import RlkConfigError, RlkPolicyError
from rlk_megatron_provider import slime_hooks

pytestmark = [pytest.mark.megatron, *MEGATRON_WARNINGS]
MODULES = ("attention", "ffn", "logp")


def _classes(obj) -> set[type]:
    """Every module class a spec slot builds (ModuleSpec trees, MLP builder partials, bare classes)."""
    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(obj, ModuleSpec):
        out = _classes(obj.module)
        if obj.submodules is not None:
            out |= _classes(obj.submodules)
        return out
    if isinstance(obj, functools.partial):
        return _classes(getattr(obj.func, "__self__", None)) | _classes(obj.keywords.get("submodules"))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return set().union(*[_classes(getattr(obj, f.name)) for f in dataclasses.fields(obj)])
    return {obj} if isinstance(obj, type) else set()


def _is_rlk(cls: type) -> bool:
    return cls.__module__.startswith("rlk_megatron_provider")


SLOTS = {"attention": ("input_layernorm", "self_attention"), "ffn": ("pre_mlp_layernorm", "mlp")}


@pytest.mark.parametrize("r_modules", [MODULES, ("attention",), ("ffn",), ("logp",), ("attention", "logp"), ()])
def test_slime_spec_gives_rlk_modules_exactly_for_r_routes(provider, r_modules, monkeypatch):
    from rlk_megatron_provider import _compat

    # the block spec asks for the pipeline rank (slime builds it after initialize_model_parallel)
    monkeypatch.setattr(_compat.parallel_state, "get_pipeline_model_parallel_rank", lambda: 0)

    provider(**{m: ("R/R" if m in r_modules else "P/R") for m in MODULES})
    cfg = _model.config(False)
    prov = rlk_megatron_provider.slime_spec(_model.slime_args(cfg), _model.transformer_config(cfg, 1, 1), None)
    assert callable(prov) and "pre_process" in __import__("inspect").signature(prov).parameters  # slime: provider
    assert prov.rlk_modules() == list(r_modules)
    stock = _compat.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    stock_block = _compat.stock_block_submodules(_model.transformer_config(cfg, 1, 1), stock)
    for module, slots in SLOTS.items():
        for slot in slots:
            got = _classes(getattr(prov.layer_spec.submodules, slot))
            if module in r_modules:
                assert got and all(_is_rlk(c) or c is _compat.IdentityOp for c in got), (slot, got)
            else:  # the stock local spec's own classes, no rlk class
                assert got == _classes(getattr(stock.submodules, slot)), (slot, got)
    # the block: every layer is the layer spec; the final norm (module logp) is rlk's iff logp is R
    block = prov.block_spec(None)
    assert len(block.layer_specs) == cfg.num_hidden_layers
    assert all(_classes(layer) == _classes(prov.layer_spec) for layer in block.layer_specs)
    final = _classes(block.layer_norm)
    assert final == ({rlk_megatron_provider.layers.RlkRMSNorm} if "logp" in r_modules
                     else _classes(stock_block.layer_norm))
    untouched = ("self_attn_bda", "mlp_bda", "pre_cross_attn_layernorm", "cross_attention", "cross_attn_bda")
    assert all(getattr(prov.layer_spec.submodules, s) is getattr(stock.submodules, s) or
               _classes(getattr(prov.layer_spec.submodules, s)) == _classes(getattr(stock.submodules, s))
               for s in untouched)


def test_slime_spec_refuses_uncovered_launch_arguments(provider):
    cfg = _model.config(False)
    tcfg = _model.transformer_config(cfg, 1, 1)
    provider(ffn="P/P", logp="P/P")
    with pytest.raises(RlkPolicyError, match="module 'attention'.*rotary_percent=0.5"):
        rlk_megatron_provider.slime_spec(_model.slime_args(cfg, rotary_percent=0.5), tcfg, None)
    provider(attention="P/P", ffn="P/P")
    with pytest.raises(RlkPolicyError, match="module 'logp'.*mtp_num_layers=1"):
        rlk_megatron_provider.slime_spec(_model.slime_args(cfg, mtp_num_layers=1), tcfg, None)
    provider()
    with pytest.raises(RlkConfigError, match="--transformer-impl local"):
        rlk_megatron_provider.slime_spec(_model.slime_args(cfg, transformer_impl="transformer_engine"), tcfg, None)
    st = provider("audit", ffn="P/P", logp="P/P")  # audit: recorded, Megatron's own attention stays
    prov = rlk_megatron_provider.slime_spec(_model.slime_args(cfg, rotary_percent=0.5), tcfg, None)
    assert prov.rlk_modules() == [] and not any(_is_rlk(c) for c in _classes(prov.layer_spec))
    assert "rotary_percent" in st.recorder.to_dict()["modules"]["attention"]["fallback_reason"]


def test_slime_spec_model_equals_local_trainer_bitwise():
    """The GPTModel slime gets from the provider (rlk LM head included: prepare_model ran) == the local
    trainer's log-probs, through both the fused provider path and slime's logits path."""
    res = run("tp1-thd-slime-spec", 1, 1, False, "thd", R_ALL, via="slime_spec")
    ref, _ = local(False, THD)
    assert torch.equal(res["logp"], ref)
    assert torch.equal(res["logp_logits"], ref)
    assert res["counts"] == {"attention": 12, "ffn": 8, "logp": 2}
    hooks = json.dumps(res["readback"])
    assert "slime_spec" in hooks and "rlk_output_layer" in hooks


# -- record_logprobs ------------------------------------------------------------------------------------
def _batch(seed: int, lengths=(5, 3, 7), drift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    roll = [-torch.rand(n, generator=g) * 3 for n in lengths]
    train = [r.clone() for r in roll]
    train[0] = train[0] - drift
    masks = [torch.ones(n, dtype=torch.int32) for n in lengths]
    masks[-1][-1] = 0
    return dict(args=types.SimpleNamespace(), pg_loss=torch.randn(sum(lengths), generator=g),
                train_log_probs=train, rollout_log_probs=roll, loss_masks=masks,
                total_lengths=[n + 4 for n in lengths], response_lengths=list(lengths))


@pytest.fixture
def records(monkeypatch, tmp_path):
    slime_hooks.reset_calls()
    monkeypatch.setenv("RL_KERNEL_LOGPROB_RECORDS_DIR", str(tmp_path / "vime" / "logprob-records"))
    yield tmp_path / "vime"
    slime_hooks.reset_calls()


def _train_one_step(rollout_id: int, kwargs: dict):
    """Stands in for slime's train loop: the hook finds the round in its caller's ``rollout_id``."""
    return rlk_megatron_provider.record_logprobs(**kwargs)


def test_record_logprobs_returns_its_inputs_and_writes_one_record_per_call(records):
    from safetensors import safe_open

    kw = _batch(0)
    out = _train_one_step(3, kw)
    assert out[0] is kw["pg_loss"] and out[1] is kw["loss_masks"] and out[2] == {}
    _train_one_step(3, _batch(1))
    _train_one_step(4, _batch(2))
    names = sorted(os.listdir(records / "logprob-records"))
    assert names == ["rollout-000003.rank0.call0.safetensors", "rollout-000003.rank0.call1.safetensors",
                     "rollout-000004.rank0.call0.safetensors"]  # no temp files left behind
    with safe_open(str(records / "logprob-records" / names[0]), "pt") as f:
        meta, t = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    assert (meta["schema"], meta["rollout_id"], meta["rank"], meta["call"]) == ("rlk.vime-logprobs.v1", "3", "0", "0")
    assert torch.equal(t["train_logprobs"], torch.cat(kw["train_log_probs"]))
    assert torch.equal(t["rollout_logprobs"], torch.cat(kw["rollout_log_probs"]))
    assert t["loss_mask"].dtype == torch.uint8
    assert torch.equal(t["loss_mask"], torch.cat(kw["loss_masks"]).to(torch.uint8))
    assert t["response_lengths"].tolist() == [5, 3, 7]


def test_record_logprobs_writes_what_import_vime_accepts(records, tmp_path):
    from safetensors.numpy import load_file

    from rlk_validate.cli import main
    from rlk_validate.evidence import VIME_LAUNCH_SCHEMA

    plan = {m: "R/R" for m in MODULES}
    records.mkdir()
    (records / "rlk-launch.json").write_text(json.dumps({
        "schema": VIME_LAUNCH_SCHEMA, "engine": "vime", "run_id": "r1", "mode": "consistency", "plan": plan,
        "exact_required": True, "rounds": 2, "steps_per_round": 1}))
    batches = {(r, c): _batch(10 * r + c, drift=(2.0 ** -10 if (r, c) == (1, 1) else 0.0))
               for r in range(2) for c in range(2)}
    for (r, _c), kw in sorted(batches.items()):
        _train_one_step(r, kw)
    dst = tmp_path / "imported"
    assert main(["import-vime", str(records), str(dst)]) == 0
    report = json.loads((dst / "bitwise-validation.json").read_text())
    assert report["element_count"] == 4 * 14  # 4 calls x 15 tokens, one masked each
    assert report["mismatch_count"] == 5 and [x["mismatch_count"] for x in report["rounds"]] == [0, 5]
    packed = load_file(str(dst / "train-data" / "round-0001.rank0.safetensors"))
    rows = [x for c in range(2) for x in batches[(1, c)]["train_log_probs"]]
    assert packed["train_logprobs"].shape == (6, 7)
    for i, row in enumerate(rows):
        n = row.numel()
        mask = packed["response_mask"][i, :n] != 0
        assert np.array_equal(packed["train_logprobs"][i, :n][mask], row.numpy()[mask])


def test_record_logprobs_cuts_full_length_masks_to_the_cp_local_tokens(records, monkeypatch):
    from safetensors.torch import load_file

    total, resp = 23, 15
    for cp in (2, 4):  # the ranks' ranges partition the response, in zigzag order
        cover = sorted(i for r in range(cp) for a, b in slime_hooks.cp_response_ranges(total, resp, cp, r)
                       for i in range(a, b))
        assert cover == list(range(resp))
    full_mask = torch.tensor([1] * 10 + [0] * 5, dtype=torch.int32)
    ranges = slime_hooks.cp_response_ranges(total, resp, 2, 1)
    n = sum(b - a for a, b in ranges)
    monkeypatch.setattr(slime_hooks, "parallel_ranks", lambda: {"global": 5, "tp": 0, "cp": 1, "cp_size": 2})
    lp = -torch.rand(n)
    kw = dict(pg_loss=torch.zeros(n), train_log_probs=[lp], rollout_log_probs=[lp.clone()],
              loss_masks=[full_mask], total_lengths=[total], response_lengths=[resp])
    _train_one_step(0, kw)
    t = load_file(str(records / "logprob-records" / "rollout-000000.rank5.call0.safetensors"))
    assert torch.equal(t["loss_mask"], torch.cat([full_mask[a:b] for a, b in ranges]).to(torch.uint8))
    assert t["response_lengths"].tolist() == [n]


def test_record_logprobs_writes_nothing_off_tp_rank_0_or_without_the_variable(records, monkeypatch):
    ranks = slime_hooks.parallel_ranks
    monkeypatch.setattr(slime_hooks, "parallel_ranks", lambda: {"global": 1, "tp": 1, "cp": 0, "cp_size": 1})
    kw = _batch(0)
    assert _train_one_step(0, kw)[0] is kw["pg_loss"]
    assert not (records / "logprob-records").exists()
    monkeypatch.setattr(slime_hooks, "parallel_ranks", ranks)
    monkeypatch.delenv("RL_KERNEL_LOGPROB_RECORDS_DIR")
    assert _train_one_step(0, kw)[1] is kw["loss_masks"]
    assert not (records / "logprob-records").exists()


def test_record_logprobs_refuses_without_a_round_or_with_disagreeing_shapes(records):
    kw = _batch(0)
    with pytest.raises(RlkConfigError, match="rollout_id"):
        rlk_megatron_provider.record_logprobs(**kw)
    bad = {**kw, "rollout_log_probs": kw["rollout_log_probs"][:2]}
    with pytest.raises(RlkConfigError, match="one per sample"):
        _train_one_step(0, bad)
    bad = {**kw, "loss_masks": [m[:-1] for m in kw["loss_masks"]]}
    with pytest.raises(RlkConfigError, match="sample 0 has 5 log-probs and a loss mask of 4"):
        _train_one_step(0, bad)
    assert rlk_megatron_provider.record_logprobs(**kw, rollout_id=7)[2] == {}  # an explicit round is taken
    assert os.listdir(records / "logprob-records") == ["rollout-000007.rank0.call0.safetensors"]


def test_the_vime_launch_names_exist():
    """Every provider callable `rlk-repro plan --engine vime` names (ENTRY_POINTS) is this package's."""
    import importlib

    from rlk_repro.vime import ENTRY_POINTS

    module, name = ENTRY_POINTS["megatron_spec"]
    assert getattr(importlib.import_module(module), name) is rlk_megatron_provider.slime_spec
    for key in ("megatron_init", "linear_logp_provider", "logprob_recorder"):
        module, _, name = ENTRY_POINTS[key].rpartition(".")
        assert callable(getattr(importlib.import_module(module), name)), key
    assert ENTRY_POINTS["logprob_records_var"] == slime_hooks.RECORDS_VAR
