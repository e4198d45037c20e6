"""Fixtures shared by the Megatron suites."""

from __future__ import annotations

import pytest


@pytest.fixture
def provider(monkeypatch):
    """``provider(mode="strict", attention=..., ffn=..., logp=...)``: the provider initialised from the
    ``RL_KERNEL_*`` variables (every module ``R/R`` unless given), its state reset before and after."""
    from rlk_megatron_provider import _state

    def make(mode: str = "strict", **cases):
        _state.reset()
        for m in ("attention", "ffn", "logp"):
            monkeypatch.setenv(f"RL_KERNEL_{m.upper()}_CASE", cases.get(m, "R/R"))
        monkeypatch.setenv("RL_KERNEL_MODE", mode)
        import rlk_megatron_provider

        return rlk_megatron_provider.initialize_from_environment()

    yield make
    _state.reset()
