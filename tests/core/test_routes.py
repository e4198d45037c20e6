"""The route layer (``rlk_core.routes``): one table of each module's ops, used by every client."""

from __future__ import annotations

from pathlib import Path

import pytest

import rlk_core.ops as ops
from rlk_core import routes
from rlk_core.contracts import OP_CONTRACTS
from rlk_core.errors import RlkConfigError
from rlk_core.plan import MODULES, SIDES, RoutePlan
from rlk_core.readback import ReadbackRecorder

ROOT = Path(__file__).resolve().parents[2]


def test_docs_routes_is_generated_from_the_table():
    text = (ROOT / "docs" / "routes.md").read_text()
    assert text == routes.markdown(), "docs/routes.md is stale: python -m rlk_core.routes > docs/routes.md"


def test_every_module_and_side_has_ops_that_exist_and_have_a_contract():
    assert set(routes.MODULE_OPS) == {(m, s) for m in MODULES for s in SIDES}
    named = {n for names in routes.MODULE_OPS.values() for n in names}
    named |= {n for names in routes.TP_OPS.values() for n in names} | set(routes.BACKWARD_OPS.values())
    for name in sorted(named):
        assert name in OP_CONTRACTS, name
    for name in sorted(named - set(routes.BACKWARD_OPS.values())):
        assert routes.op_function(name) is getattr(ops, name)
    assert routes.op_function("no_such_op") is None


def test_the_local_engine_is_a_client_of_the_route_layer():
    from rlk_repro.model import ops as local_ops

    plan = RoutePlan("R/R", "P/P", "R/P")
    table = local_ops.Ops(plan, "train", ReadbackRecorder("local", "train", plan))
    assert isinstance(table.routes, routes.SideRoutes)
    assert table.r == {"attention": True, "ffn": False, "logp": True}
    assert not hasattr(local_ops, "_NEEDS") and not hasattr(local_ops, "_FAMILY")


def test_side_routes_call_reports_and_refuses_a_p_module():
    import torch

    plan = RoutePlan("P/P", "R/R", "P/P")
    rec = ReadbackRecorder("local", "rollout", plan)
    side = routes.SideRoutes(plan, "rollout", rec)
    y = side.call("ffn", "swiglu", torch.ones(2, 4))
    assert y.shape == (2, 2)
    assert rec.to_dict()["modules"]["ffn"]["ops"]["swiglu"]["backend_id"] == "rlk.reference"
    with pytest.raises(RlkConfigError, match="does not run rlk op"):
        side.call("attention", "rope", torch.ones(1, 1, 2), torch.zeros(1, dtype=torch.int64), 1e4)
    with pytest.raises(RlkConfigError, match="does not run rlk op"):
        side.call("ffn", "attention_decode")
    with pytest.raises(RlkConfigError, match="recorder is for side"):
        routes.SideRoutes(plan, "train", rec)


def test_side_routes_call_opens_the_modules_scope_and_closes_it_on_error():
    """Inside ``call`` the op reports to the recorder under the call's module (nested calls too); after it,
    normal or raising, the scope that was active before is back."""
    import torch

    from rlk_core.readback import active_scope

    plan = RoutePlan("R/R", "R/R", "P/P")
    rec = ReadbackRecorder("local", "rollout", plan)
    side = routes.SideRoutes(plan, "rollout", rec)
    seen = []
    side._calls[("ffn", "probe")] = (lambda: seen.append(active_scope()) or 1 / 0, rec._scopes["ffn"])
    with pytest.raises(ZeroDivisionError):
        side.call("ffn", "probe")
    assert seen == [(rec, "ffn")] and active_scope() is None
    with rec.scope("attention"):
        side.call("ffn", "swiglu", torch.ones(2, 4))
        assert active_scope() == (rec, "attention")
    doc = rec.to_dict()["modules"]
    assert doc["ffn"]["ops"]["swiglu"]["call_count"] == 1 and "attention" not in doc


def test_rlk_ops_of_a_plan():
    plan = RoutePlan("R/P", "P/R", "R/R")
    assert routes.rlk_ops(plan, "train", backward=True) == {"linear", "rms_norm", "rope", "attention_varlen",
                                                           "rms_norm_backward", "rope_backward",
                                                           "attention_varlen_backward", "linear_logprobs",
                                                           "linear_logprobs_backward", "token_logprobs",
                                                           "token_logprobs_backward", "kept_set", "apply_kept"}
    assert routes.rlk_ops(plan, "rollout") == {"linear", "rms_norm", "swiglu", "token_logprobs", "kept_set",
                                                "apply_kept"}


@pytest.mark.parametrize("flags,env,mode,expected,source", [
    ({}, {}, None, "P/P", "default (native)"),
    ({}, {}, "consistency", "R/R", "--mode consistency"),
    ({}, {"RL_KERNEL_FFN_CASE": "r/p"}, "consistency", "R/P", "RL_KERNEL_FFN_CASE"),
    ({"ffn": "P/R"}, {"RL_KERNEL_FFN_CASE": "R/P"}, "native", "P/R", "flag --ffn-case"),
    ({}, {"RL_KERNEL_FFN_CASE": ""}, "consistency", "R/R", "--mode consistency"),
])
def test_resolve_precedence(flags, env, mode, expected, source):
    got = routes.resolve(flags, mode, env)
    assert got.plan.ffn == expected and got.sources["ffn"] == source


@pytest.mark.parametrize("bad", ["RR", "R-R", "X/Y", "R/R/R", "", "r/ r"])
def test_resolve_rejects_bad_cases_naming_their_origin(bad):
    if bad != "":
        with pytest.raises(RlkConfigError, match="--ffn-case"):
            routes.resolve({"ffn": bad})
    with pytest.raises(RlkConfigError, match="RL_KERNEL_LOGP_CASE"):
        routes.resolve({}, None, {"RL_KERNEL_LOGP_CASE": bad or "  "})
    with pytest.raises(RlkConfigError, match="unknown module"):
        routes.resolve({"mlp": "R/R"})
