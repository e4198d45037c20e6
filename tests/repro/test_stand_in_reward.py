"""The stand-in reward does not saturate while the policy has entropy (issue 41, item 13): vocab_reward's 0/1 term
gave every sample of a group the same reward once all its tokens were in the lower half of the vocabulary (every
advantage 0); the graded token score separates any two samples with different tokens."""

from __future__ import annotations

from rlk_repro.engine.data import stand_in_reward, token_score, vocab_reward
from rlk_repro.engine.local import default_lr
from rlk_repro.engine.trainer import group_advantages
from rlk_repro.model.config import preset

V = 151936


def test_the_old_reward_saturates_with_a_spread_policy_the_graded_one_does_not():
    group = [[1000 + 7 * i + j for j in range(20)] for i in range(4)]  # 4 distinct responses, all in the low half
    assert set(group_advantages([vocab_reward(r, "42", V) for r in group], 4)) == {0.0}  # negative control
    adv = group_advantages([stand_in_reward(r, "42") for r in group], 4)
    assert all(a != 0 for a in adv)
    assert len({stand_in_reward(r, "42") for r in group}) == 4
    assert all(0 <= token_score(i) < 1 for i in range(5000))


def test_the_default_lr_scales_with_width():
    # the measured points (docstring of default_lr): tiny 1e-4 (CPU, 10 rounds), the 0.6B shape 1e-6 (H200, 10 rounds)
    assert default_lr(preset("tiny")) == 1e-4 and default_lr(preset("qwen3-0.6b")) == 1e-6
    assert default_lr(preset("small")) == 3e-5 and default_lr(preset("qwen3-moe-30b-a3b-L2")) == 3e-7
