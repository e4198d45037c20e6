"""Shared fixtures of the local-engine tests: small configs and session-scoped runs (each run once)."""

from __future__ import annotations

import pytest

from rlk_core.plan import RoutePlan
from rlk_repro.engine.local import LocalRunConfig, run_local

ROUNDS = 5


def small_config(plan: RoutePlan, rounds: int = ROUNDS, **kw) -> LocalRunConfig:
    """Tiny model, 2 prompts x 3 samples, 8 new tokens; chunk 12 and page 4, so most prompts are chunked."""
    base = dict(plan=plan, rounds=rounds, seed=7, model="tiny", prompts_per_round=2, samples_per_prompt=3,
                max_new_tokens=8, chunk_size=12, page_size=4, max_num_seqs=4, lr=3e-3,
                threads=1, command=["pytest", "tests/repro"])
    base.update(kw)
    return LocalRunConfig(**base)


@pytest.fixture(name="small_config", scope="session")
def _small_config():
    return small_config


@pytest.fixture(scope="session")
def rr_run(tmp_path_factory):
    return run_local(small_config(RoutePlan("R/R", "R/R", "R/R")), tmp_path_factory.mktemp("rr"))


@pytest.fixture(scope="session")
def pp_run(tmp_path_factory):
    return run_local(small_config(RoutePlan("P/P", "P/P", "P/P")), tmp_path_factory.mktemp("pp"))
