"""Shared by the collective tests: the gloo groups (run once per module and world size) and references."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def load(name: str):
    """A helper module of this folder by path (tests use --import-mode=importlib)."""
    key = f"rlk_coll_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, HERE / f"{name}.py")
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]

_GROUPS: dict = {}


@pytest.fixture(scope="session")
def inputs():
    """tests/collectives/_inputs.py: the adversarial input builders."""
    return load("_inputs")


@pytest.fixture(scope="session")
def group_results():
    """``group_results(scenario, world)``: every rank's results, one gloo group per (scenario, world)
    for the whole session (a failing group fails each test that asks for it, with the ranks' logs)."""
    launch = load("_launch")

    def get(scenario: str, world: int) -> list[dict]:
        key = (scenario, world)
        if key not in _GROUPS:
            try:
                _GROUPS[key] = launch.run_group(scenario, world)
            except AssertionError as exc:
                _GROUPS[key] = exc
        if isinstance(_GROUPS[key], AssertionError):
            raise _GROUPS[key]
        return _GROUPS[key]

    return get
