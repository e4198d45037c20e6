import subprocess
import sys
from pathlib import Path

import pytest

from rlk_core import envs
from rlk_core.errors import RlkConfigError
from rlk_core.plan import PRESETS, RoutePlan

ROOT = Path(__file__).resolve().parents[2]


def test_every_variable_is_prefixed_documented_and_parses_its_default():
    names = [v.name for v in envs.ENV_VARS]
    assert len(names) == len(set(names))
    for v in envs.ENV_VARS:
        assert v.name.startswith(("RL_KERNEL_", "RLK_")), v.name
        assert v.doc.strip()
        assert v.parse(None) == v.default


@pytest.mark.parametrize("name", ["RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE"])
def test_cases_parse_and_bad_values_name_variable_value_and_allowed(name):
    assert envs.get(name, {name: "r/p"}) == "R/P"
    assert envs.get(name, {}) == "P/P"
    with pytest.raises(RlkConfigError) as err:
        envs.get(name, {name: "R/X"})
    msg = str(err.value)
    assert name in msg and "'R/X'" in msg and "P/P, P/R, R/P, R/R" in msg


def test_mode_readback_dir_run_id_and_backend_overrides():
    env = {"RL_KERNEL_MODE": "audit", "RL_KERNEL_READBACK_DIR": "rb", "RL_KERNEL_RUN_ID": "run-1",
           "RLK_BACKENDS": "linear=rlk.reference, rms_norm=acme.fast"}
    snap = envs.snapshot(env)
    assert snap["RL_KERNEL_MODE"] == "audit"
    assert Path(snap["RL_KERNEL_READBACK_DIR"]).is_absolute()
    assert snap["RL_KERNEL_RUN_ID"] == "run-1"
    assert snap["RLK_BACKENDS"] == {"linear": "rlk.reference", "rms_norm": "acme.fast"}
    for name, bad in [("RL_KERNEL_MODE", "lenient"), ("RL_KERNEL_RUN_ID", "a/b"), ("RLK_BACKENDS", "linear"),
                      ("RLK_LOAD_PLUGINS", "maybe")]:
        with pytest.raises(RlkConfigError, match=name):
            envs.get(name, {name: bad})


def test_unknown_variable_is_a_key_error():
    with pytest.raises(KeyError, match="not an rlk environment variable"):
        envs.get("RL_KERNEL_NOPE")


def test_docs_envvars_is_generated_from_the_table():
    text = (ROOT / "docs" / "envvars.md").read_text()
    assert text == envs.markdown(), "docs/envvars.md is stale: python -m rlk_core.envs > docs/envvars.md"
    out = subprocess.run([sys.executable, "-m", "rlk_core.envs"], capture_output=True, text=True, check=True)
    assert out.stdout == text


def test_route_plan_from_env_letters_presets_and_env_roundtrip():
    plan = RoutePlan.from_env({"RL_KERNEL_ATTENTION_CASE": "P/R", "RL_KERNEL_LOGP_CASE": "R/R"})
    assert plan == RoutePlan("P/R", "P/P", "R/R")
    assert plan.letter("attention", "train") == "P" and plan.letter("attention", "rollout") == "R"
    assert plan.implementation("logp", "train") == "rlk" and plan.implementation("ffn", "rollout") == "production"
    assert RoutePlan.from_env(plan.env()) == plan
    assert PRESETS["native"] == RoutePlan() and PRESETS["consistency"].name == "consistency"
    assert RoutePlan.from_dict({"ffn": "r/r"}).ffn == "R/R"
    with pytest.raises(RlkConfigError, match="module"):
        plan.case("mlp")
    with pytest.raises(RlkConfigError, match="side"):
        plan.letter("ffn", "inference")
    with pytest.raises(RlkConfigError, match="P/P, P/R"):
        RoutePlan(attention="X/Y")
    with pytest.raises(RlkConfigError, match="preset"):
        RoutePlan.preset("fast")


def test_import_has_no_side_effects():
    code = ("import os, sys; before = dict(os.environ); import rlk_core, rlk_core.ops, rlk_core.testing; "
            "assert dict(os.environ) == before; "
            "import torch; assert not torch.cuda.is_initialized(); "
            "assert 'triton' not in sys.modules; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_the_case_variables_are_spelled_once_for_the_evidence_modules():
    from rlk_core import plan
    from rlk_validate.evidence import MODULES

    assert tuple(envs.CASE_VARS) == tuple(MODULES) and plan.CASE_VARS is envs.CASE_VARS
    assert [v.name for v in envs.ENV_VARS[:3]] == list(envs.CASE_VARS.values())
