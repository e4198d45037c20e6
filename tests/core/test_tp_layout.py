"""RL_KERNEL_TP_INVARIANT and the TP layout rule: strict mode refuses train TP != rollout TP without invariant mode,
saying what to set; with it any power-of-two TP dividing G passes (docs/ops/linear_tp.md)."""

import pytest

from rlk_core import envs
from rlk_core.errors import RlkConfigError, RlkPolicyError
from rlk_core.tp import DEFAULT_LEAVES, check_tp_layout, tp_invariant_leaves


@pytest.mark.parametrize("raw, g", [(None, 0), ("", 0), ("off", 0), ("0", 0), ("on", 8), ("ON", 8), ("2", 2),
                                    ("8", 8), ("16", 16)])
def test_the_variable_parses_to_g(raw, g):
    env = {} if raw is None else {"RL_KERNEL_TP_INVARIANT": raw}
    assert tp_invariant_leaves(env) == g
    if raw == "on":
        assert g == DEFAULT_LEAVES


@pytest.mark.parametrize("raw", ["1", "3", "12", "-8", "yes", "8.0"])
def test_bad_values_are_refused(raw):
    with pytest.raises(RlkConfigError, match="RL_KERNEL_TP_INVARIANT"):
        envs.get("RL_KERNEL_TP_INVARIANT", {"RL_KERNEL_TP_INVARIANT": raw})


def test_strict_mode_refuses_different_tps_without_invariant_mode_and_says_what_to_set():
    assert check_tp_layout(2, 2, env={}) is None
    with pytest.raises(RlkPolicyError, match="RL_KERNEL_TP_INVARIANT=8 on both sides"):
        check_tp_layout(4, 1, env={})
    with pytest.raises(RlkPolicyError, match="RL_KERNEL_TP_INVARIANT=16"):
        check_tp_layout(16, 2, env={})
    assert "train TP 4 != rollout TP 1" in check_tp_layout(4, 1, env={}, mode="audit")
    assert "train TP 4 != rollout TP 1" in check_tp_layout(4, 1, env={"RL_KERNEL_MODE": "audit"})


def test_invariant_mode_allows_any_power_of_two_tp_dividing_g():
    env = {"RL_KERNEL_TP_INVARIANT": "8"}
    for train in (1, 2, 4, 8):
        for rollout in (1, 2, 4, 8):
            assert check_tp_layout(train, rollout, env=env) is None
    with pytest.raises(RlkPolicyError, match="train TP 3 is not a power of two dividing RL_KERNEL_TP_INVARIANT=8"):
        check_tp_layout(3, 1, env=env)
    with pytest.raises(RlkPolicyError, match="rollout TP 16"):
        check_tp_layout(4, 16, env=env)
    with pytest.raises(RlkPolicyError, match="positive integer"):
        check_tp_layout(0, 1, env=env)
