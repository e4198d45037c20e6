"""benchmarks/bench_moe.py on the CPU (a smoke test, no timing): its rlk side is the call path of the vLLM plugin's R
``FusedMoE`` method — the same bits as ``rlk_vllm_plugin.moe.rlk_experts`` after the gate's ``linear`` and as the
trainer's ``moe_ffn`` — on the reference backend at a tiny shape; a routing that sends no row to some experts runs;
the native side says why it is skipped where vLLM's MoE kernels cannot load; the argument parsing refuses bad
token lists."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
_spec = importlib.util.spec_from_file_location("bench_moe", REPO / "benchmarks" / "bench_moe.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = dict(hidden=16, experts=8, ffn=12)


def tiny(tokens: int, seed: int = 3) -> dict[str, torch.Tensor]:
    return bench.make_inputs(tokens, seed, "cpu", **TINY)


@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_the_rlk_side_is_the_trainers_moe_ffn_bitwise(tokens):
    from rlk_core.ops.moe.layer import moe_ffn

    s = tiny(tokens)
    got = bench.rlk_layer(s["x"], s["router"], s["w13"], s["w2"], 3)
    want, _ = moe_ffn(s["x"], s["router"], s["w13"], s["w2"], 3)
    assert got.shape == (tokens, TINY["hidden"]) and torch.equal(got, want)
    assert bool(got.abs().sum() > 0)


def test_a_token_alone_has_its_bits_in_a_batch():
    s = tiny(9)
    batch = bench.rlk_layer(s["x"], s["router"], s["w13"], s["w2"], 3)
    alone = bench.rlk_layer(s["x"][4:5], s["router"], s["w13"], s["w2"], 3)
    assert torch.equal(alone[0], batch[4])


def test_the_negative_control_another_top_k_gives_other_bits():
    """The comparison above can fail: the same inputs with top-2 instead of top-3 are another layer."""
    from rlk_core.ops.moe.layer import moe_ffn

    s = tiny(5)
    got = bench.rlk_layer(s["x"], s["router"], s["w13"], s["w2"], 2)
    want, _ = moe_ffn(s["x"], s["router"], s["w13"], s["w2"], 3)
    assert not torch.equal(got, want)


def test_experts_without_rows_run():
    """Every token on experts 0 and 1 (the router's rows for them large): the other six get no rows."""
    s = tiny(4)
    s["router"][:2] = 10 * s["x"].sum(0)  # logits of experts 0, 1 dominate for these tokens
    from rlk_core import ops
    from rlk_core.ops.moe import moe_topk

    _, ids = moe_topk(ops.linear(s["x"], s["router"]), 2, True)
    assert set(ids.flatten().tolist()) <= {0, 1}
    from rlk_core.ops.moe.layer import moe_ffn

    got = bench.rlk_layer(s["x"], s["router"], s["w13"], s["w2"], 2)
    assert torch.equal(got, moe_ffn(s["x"], s["router"], s["w13"], s["w2"], 2)[0])


def test_the_rlk_side_is_the_vllm_plugins_r_method_bitwise():
    """``rlk_vllm_plugin.moe.rlk_experts`` (the R method's ``apply_monolithic``, ops through the plugin's route
    layer) on the gate's ``linear`` logits, a ``FusedMoE`` stand-in holding the attributes it reads."""
    pytest.importorskip("rlk_vllm_plugin")
    from rlk_core import ops
    from rlk_core.plan import RoutePlan
    from rlk_vllm_plugin import _runtime
    from rlk_vllm_plugin.moe import rlk_experts

    s = tiny(7)
    layer = types.SimpleNamespace(top_k=3, renormalize=True, scoring_func="softmax", w13_weight=s["w13"],
                                  w2_weight=s["w2"])
    before = _runtime.current()
    _runtime.install(_runtime.Runtime(plan=RoutePlan("R/R", "R/R", "R/R"), mode="strict", unfiltered_logprobs=False,
                                      attention_override=None))
    try:
        want = rlk_experts(layer, s["x"], ops.linear(s["x"], s["router"]))
        ran = _runtime.get().recorder.to_dict()["modules"]["ffn"]["ops"]
    finally:
        _runtime.install(before)
    assert {"moe_topk", "moe_grouped_linear", "moe_combine", "swiglu"} <= set(ran)
    assert torch.equal(bench.rlk_layer(s["x"], s["router"], s["w13"], s["w2"], 3), want)


def test_the_backends_are_named():
    names = bench.backends(tiny(6), 3)
    assert set(names) == {"linear", "moe_topk", "moe_grouped_linear", "moe_combine"}
    assert all(v == "rlk.reference" for v in names.values()), names


def test_the_native_side_says_why_it_is_skipped_or_gives_vllms_functions():
    fns, why = bench.native_sides()
    if fns is None:  # the CPU venv's vLLM wheel: _moe_C needs libcuda
        assert why.startswith("vLLM's fused MoE unavailable: ") and len(why) > 40
    else:
        assert why == "" and callable(fns["topk"]) and callable(fns["experts"])


def test_token_lists_parse_and_bad_ones_are_refused(capsys):
    assert bench.parse_tokens(None, False) == bench.DECODE + bench.PREFILL
    assert bench.DECODE == (1, 2, 4, 8, 16, 32, 64, 128, 256) and bench.PREFILL == (2048, 4096, 8192, 16384)
    assert bench.parse_tokens("1,8,2048", False) == (1, 8, 2048)
    assert len(bench.parse_tokens(None, True)) == 5
    for bad in ("", "0", "a,2", "-4"):
        with pytest.raises(ValueError):
            bench.parse_tokens(bad, False)
    with pytest.raises(SystemExit) as e:
        bench.main(["--tokens", "x"])
    assert e.value.code == 2 and "--tokens" in capsys.readouterr().err
    args = bench.build_parser().parse_args(["--quick", "--repeats", "5", "--backward"])
    assert args.quick and args.repeats == 5 and args.backward


def test_without_a_gpu_the_script_refuses_in_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as e:
        bench.main(["--quick"])
    assert e.value.code == 2 and "needs a CUDA GPU" in capsys.readouterr().err
