"""``RLK_VALUE_CHECKS``: which range checks on index values run (each one syncs a GPU)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.errors import RlkInputError
from rlk_core.ops import _checks as C
from rlk_core.ops import rope


@pytest.mark.parametrize("mode,cpu,meta", [("auto", True, False), ("always", True, False), ("never", False, False)])
def test_values_checked_modes(monkeypatch, mode, cpu, meta):
    monkeypatch.setenv("RLK_VALUE_CHECKS", mode)
    assert C.values_checked(torch.zeros(3, dtype=torch.int32), None) is cpu
    assert C.values_checked(torch.zeros(3, dtype=torch.int32, device="meta")) is meta


def test_auto_checks_cpu_values_and_never_skips_them(monkeypatch):
    x = torch.randn(2, 1, 8)
    bad = torch.tensor([0, -5])
    with pytest.raises(RlkInputError, match="positions has values in"):
        rope(x, bad, 10000.0)
    monkeypatch.setenv("RLK_VALUE_CHECKS", "never")
    C.in_range(bad, "rope", "positions", 0, 10)  # skipped: no error raised


def test_bad_mode_is_a_config_error(monkeypatch):
    from rlk_core.errors import RlkConfigError

    monkeypatch.setenv("RLK_VALUE_CHECKS", "sometimes")
    with pytest.raises(RlkConfigError, match="RLK_VALUE_CHECKS"):
        C.values_checked(torch.zeros(1))
