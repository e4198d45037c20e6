"""Model, checkpoint and engine pieces: HF round trip, sampling, advantages, and the rollout engine's R path
giving the same bits for a request whatever the scheduling (chunk size, batch, page size)."""

from __future__ import annotations

import json

import pytest
import torch

from rlk_core.errors import RlkConfigError
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_repro.engine.data import encode, load_prompts, reward
from rlk_repro.engine.rollout import Request, RolloutEngine
from rlk_repro.engine.sampling import SamplingParams, race_noise, sample_token, sample_tokens
from rlk_repro.engine.trainer import group_advantages
from rlk_repro.model import PRESETS, Ops, Qwen3Config, load_checkpoint, random_weights, save_checkpoint

CFG = PRESETS["tiny"]


def test_hf_checkpoint_round_trip(tmp_path):
    w = random_weights(CFG, seed=3)
    save_checkpoint(tmp_path, CFG, w)
    cfg2, w2 = load_checkpoint(tmp_path)
    assert cfg2 == CFG and set(w2) == set(w)
    assert all(torch.equal(w[k], w2[k]) for k in w)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["model_type"] == "qwen3" and hf["num_key_value_heads"] == CFG.num_key_value_heads


def test_config_rejects_what_it_cannot_run():
    base = CFG.to_hf()
    with pytest.raises(RlkConfigError, match="rope_scaling"):
        Qwen3Config.from_hf({**base, "rope_scaling": {"type": "yarn"}})
    with pytest.raises(RlkConfigError, match="multiple"):
        Qwen3Config.from_hf({**base, "num_key_value_heads": 3})
    with pytest.raises(RlkConfigError, match="lacks"):
        Qwen3Config.from_hf({k: v for k, v in base.items() if k != "hidden_size"})


def test_random_weights_are_deterministic():
    a, b = random_weights(CFG, 5), random_weights(CFG, 5)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_sampling_is_seeded_and_filters():
    logits = torch.randn(CFG.vocab_size, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=0.7, top_k=1)
    assert sample_token(logits, p, 1) == int(logits.argmax())
    q = SamplingParams(temperature=1.0, top_p=0.9)
    draws = [sample_token(logits, q, s) for s in range(20)]
    assert draws == [sample_token(logits, q, s) for s in range(20)]
    assert len(set(draws)) > 1
    # a batch draws what each row draws alone (the noise is a function of the row's seed only)
    rows = logits[None].repeat(20, 1) + torch.randn(20, 1, generator=torch.Generator().manual_seed(3))
    assert sample_tokens(rows, [q] * 20, list(range(20))) == [sample_token(rows[i], q, i) for i in range(20)]
    with pytest.raises(RlkConfigError):
        SamplingParams(temperature=0.0)


def test_race_noise_is_exponential_and_seeded():
    seeds = torch.tensor([0, 1, 2**61 + 5], dtype=torch.int64)
    e = race_noise(seeds, 50_000)
    assert torch.equal(e, race_noise(seeds, 50_000)) and not torch.equal(e[0], e[1])
    assert bool((e > 0).all()) and bool(torch.isfinite(e).all())
    assert abs(float(e.mean()) - 1.0) < 0.02 and abs(float(e.std()) - 1.0) < 0.03  # Exp(1): mean 1, std 1


def test_group_advantages_and_reward():
    adv = group_advantages([1.0, 0.0, 0.5, 2.0, 2.0, 2.0], 3)
    assert abs(sum(adv[:3])) < 1e-9 and adv[3:] == [0.0, 0.0, 0.0]
    assert reward(list(b"x 19 y"), "19") > 1.0 > reward(list(b"zz"), "19")


def _generate(plan: RoutePlan, chunk: int, seqs: int, page: int):
    rec = ReadbackRecorder("local", "rollout", plan, mode="strict")
    w = random_weights(CFG, 11)
    eng = RolloutEngine(CFG, w, Ops(plan, "rollout", rec), device=torch.device("cpu"), dtype=torch.float32,
                        page_size=page, chunk_size=chunk, max_num_seqs=seqs, max_model_len=160, seed=chunk)
    prompts = load_prompts()
    reqs = [Request(rid=i, prompt=encode(prompts[i].text, CFG.bos_token_id),
                    params=SamplingParams(top_p=0.9, max_new_tokens=3 + i % 4, seed=5), arrival_step=i // 2)
            for i in range(5)]
    stats = eng.generate(reqs)
    return [(r.output, torch.tensor(r.logprobs)) for r in reqs], stats


def test_rollout_r_path_is_invariant_to_scheduling():
    """Chunked vs whole prefill, batch of 1 vs 4, page 4 vs 16: identical tokens and log-prob bits."""
    plan = RoutePlan("R/R", "R/R", "R/R")
    ref, s1 = _generate(plan, chunk=200, seqs=1, page=16)
    got, s2 = _generate(plan, chunk=5, seqs=4, page=4)
    assert s1.chunked_prompts == 0 and s2.chunked_prompts > 0 and s1.max_batch == 1 and s2.max_batch > 1
    for (t1, l1), (t2, l2) in zip(ref, got, strict=True):
        assert t1 == t2
        assert torch.equal(l1.view(torch.int32), l2.view(torch.int32))
