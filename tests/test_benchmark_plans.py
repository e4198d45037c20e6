"""The benchmarks' own calls into the ops' launch plans, on the CPU. Each runs on the AOT build's enumerating plan
(meta tensors; every launch bound by Triton's own binder, as the JIT binds it), so a script whose call no longer
fits an op's plan, or whose launch no longer fits the kernel, fails here instead of in a GPU sitting (the plans of
issue 34 broke several scripts that still imported). The sweep's candidates launch what their names say and differ
from the shipped launch by their configuration alone; megatron_host's backend clock times the launch plans that the
op layer runs past ``Backend.fn``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from triton.tools.tensor_descriptor import TensorDescriptor

from rlk_core.aot import build as B
from rlk_core.ops import _plan

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
BF16 = torch.bfloat16


class Recording(B.Enumerate):
    """The build's enumerating plan for sm_90 with 132 SMs (TMA), keeping each launch as ``(kernel, arguments,
    keywords)``: a tensor argument by the name it was given (:meth:`name`) or as ``("tensor", shape, strides,
    dtype)``, a TMA descriptor as ``("desc", its tensor, box)``."""

    def __init__(self) -> None:
        super().__init__(_plan.Target("cuda", 90, 32), "benchmarks", 132, {})
        self.launches: list[tuple[str, tuple, dict]] = []
        self.names: dict[int, str] = {}

    def name(self, **tensors: torch.Tensor) -> None:
        self.names.update({id(t): n for n, t in tensors.items()})

    def _arg(self, a):
        if isinstance(a, torch.Tensor):
            return self.names.get(id(a)) or ("tensor", tuple(a.shape), a.stride(), a.dtype)
        if isinstance(a, TensorDescriptor):
            return "desc", self._arg(a.base), tuple(a.block_shape)
        return a

    def launch(self, kernel, grid, *args, **kwargs):
        super().launch(kernel, grid, *args, **kwargs)
        self.launches.append((kernel.__name__, tuple(map(self._arg, args)), kwargs))

    def run(self, fn) -> list[tuple[str, tuple, dict]]:
        """The launches of one call of ``fn``."""
        self.launches = []
        fn()
        return self.launches


def _no_descs(args: tuple) -> tuple:
    """The arguments with the descriptors left out (a launch without TMA passes None there)."""
    return tuple(None if isinstance(a, tuple) and a[:1] == ("desc",) else a for a in args)


def meta(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


@pytest.fixture()
def bench(monkeypatch):
    """``load("sweep_kernels")`` / ``load("frameworks/megatron_host")``: a script as a module, with the folders its
    imports need on ``sys.path`` (restored afterwards, with whatever the script added)."""
    monkeypatch.setattr(sys, "path", [str(BENCH), str(BENCH / "frameworks"), *sys.path])

    def load(rel: str):
        path = BENCH / f"{rel}.py"
        spec = importlib.util.spec_from_file_location(f"rlk_bench_plans_{path.stem}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    return load


@pytest.mark.parametrize(("script", "fn", "args", "kernel"), [
    ("bench_rms_norm", "rlk", lambda: (meta(64, 4096), meta(4096)), "_rms_norm_fwd_kernel"),
    ("bench_swiglu", "rlk", lambda: (meta(64, 2 * 3072),), "_swiglu_fwd_kernel"),
    ("bench_rope", "rlk", lambda: (meta(64, 8, 128), meta(64, dtype=torch.int64), meta(4096, 64, dtype=torch.float32),
                                   meta(4096, 64, dtype=torch.float32)), "_rope_fwd_kernel"),
    ("bench_logprobs", "rlk_gemm", lambda: (meta(8192, 4096), meta(151936, 4096)), "_linear_tma_kernel"),
])
def test_a_benchmarks_kernel_call_is_the_ops_launch_plan(bench, script, fn, args, kernel):
    p = Recording()
    p.run(lambda: getattr(bench(script), fn)(p, *args()))
    assert p.launches and {name for name, _, _ in p.launches} == {kernel}


def _tile(kw: dict) -> tuple:
    return kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"], kw["num_stages"], kw.get("TAIL_M", 0)


def test_the_linear_candidates_launch_their_tiles(bench):
    sk = bench("sweep_kernels")
    p, k = Recording(), 4096
    w = meta(1536, k)
    for cands in (sk.SMALL_CANDIDATES, sk.LARGE_CANDIDATES, sk.MID_CANDIDATES, sk.TAIL_CANDIDATES,
                  sk.SPLIT_TAIL_CANDIDATES):
        for name, cfg in sk.tile_cfgs(cands, k).items():
            t = cands[name]
            ((kernel, _, kw),) = p.run(lambda cfg=cfg: sk.gemm(p, meta(80, k), w, cfg))
            assert kernel == ("_linear_tma_kernel" if t[6] else "_linear_fwd_kernel"), name
            assert _tile(kw) == (t[0], t[1], t[2], t[4], t[5], t[7] if len(t) > 7 else 0), name


def test_the_split_sweeps_variants_differ_as_named(bench):
    sk = bench("sweep_kernels")
    p = Recording()
    n, k = sk.SPLIT_SHAPES["8b-tp4/qkv"]
    w = meta(n, k)
    seen = set()
    for m in sk.SPLIT_SMALL_MS + sk.SPLIT_LARGE_MS:
        x = meta(m, k)
        cfgs = sk.split_cfgs(p, x, w)
        runs = {c: p.run(lambda cfg=cfg, x=x: sk.gemm(p, x, w, cfg)) for c, cfg in cfgs.items()}
        assert runs["shipped"] == p.run(lambda x=x: sk.gemm(p, x, w)), m  # linear's own decision
        if "shipped_full_box" in cfgs:  # the last row block's smaller box, and the full one
            ((_, _, box),), ((_, _, full),) = runs["shipped"], runs["shipped_full_box"]
            assert box["REM_M"] == sk.rule.rem_rows(m, box["BLOCK_M"]) > 0 and full["REM_M"] == 0, m
            assert {**box, "REM_M": 0} == full, m
            seen.add("full box")
        if "single" in cfgs:  # the rule's row split (two launches, the second by PDL) against one tile
            assert [kw["PDL"] for _, _, kw in runs["shipped"]] == [1, 2] and len(runs["single"]) == 1, m
            seen.add("single")
        if 64 < m <= 80:
            assert [_tile(kw)[5] for c in sk.TAIL_CANDIDATES if len(sk.TAIL_CANDIDATES[c]) > 7
                    for _, _, kw in runs[c]] == [16] * 5, m
            seen.add("tail")
    assert seen == {"full box", "single", "tail"}

    split_rows, rest = sk.rule.split_candidate(4096, n, k, p.sms)
    variants = sk.pdl_variants(p, meta(4096, k), w, split_rows, sk.rule.tile_config(rest[0], k, tma=True))
    runs = {c: p.run(fn) for c, fn in variants.items()}
    assert [kw.get("PDL") for _, _, kw in runs["split_pdl"]] == [1, 2]
    assert [kw.get("PDL") for _, _, kw in runs["split_serial"]] == [None, None]
    assert [(args, _tile(kw)) for _, args, kw in runs["split_serial"]] == [
        (args, _tile(kw)) for _, args, kw in runs["split_pdl"]]  # the same two launches, one after the other
    assert len(runs["single"]) == 1


def _without(kw: dict, keys) -> dict:
    return {key: v for key, v in kw.items() if key not in keys}


CONFIG_KEYS = ("BLOCK_M", "num_warps", "num_stages", "KV_TMA")


def test_the_prefill_and_decode_candidates_are_the_shipped_launch_with_their_configuration(bench, monkeypatch):
    sk = bench("sweep_kernels")
    p = Recording()
    q, k, v, cu = meta(256, 32, 128), meta(256, 8, 128), meta(256, 8, 128), meta(2, dtype=torch.int32)
    p.name(q=q, k=k, v=v, cu=cu)
    ((_, args0, kw0),) = p.run(lambda: sk.at.attention_varlen(p, q, k, v, cu, cu, 0.1, True, None))
    for c, fn in sk.prefill_variants(p, q, k, v, cu, 0.1).items():
        ((kernel, args, kw),) = p.run(fn)
        assert kernel == "_attention_fwd_kernel" and tuple(kw[key] for key in CONFIG_KEYS) == sk.PREFILL_CANDIDATES[c]
        assert _no_descs(args) == _no_descs(args0) and _without(kw, CONFIG_KEYS) == _without(kw0, CONFIG_KEYS), c
        assert (args == args0) == (kw["KV_TMA"] == kw0["KV_TMA"]), c  # descriptors exactly where TMA is asked for

    qd, kc, vc = meta(4, 32, 128), meta(16, 16, 8, 128), meta(16, 16, 8, 128)
    table, lens, cu_q = meta(4, 4, dtype=torch.int32), meta(4, dtype=torch.int32), meta(5, dtype=torch.int32)
    p.name(q=qd, k_cache=kc, v_cache=vc, table=table, lens=lens, cu_q=cu_q)
    monkeypatch.setattr(sk.at, "decode_offsets", lambda device, n: cu_q)  # the shipped call, with these offsets
    ((_, args0, kw0),) = p.run(lambda: sk.at.attention_decode(p, qd, kc, vc, table, lens, 0.1))
    for c, fn in sk.decode_variants(p, qd, kc, vc, table, lens, 0.1, cu_q).items():
        ((kernel, args, kw),) = p.run(fn)
        assert kernel == "_attention_fwd_kernel"
        assert tuple(kw[key] for key in CONFIG_KEYS[:3]) == sk.DECODE_CANDIDATES[c], c
        assert args == args0 and _without(kw, CONFIG_KEYS[:3]) == _without(kw0, CONFIG_KEYS[:3]), c


def test_the_backward_candidates_are_the_shipped_launches_with_their_overrides(bench):
    sk = bench("sweep_kernels")
    p = Recording()
    q, k, v, do, cu = meta(256, 32, 128), meta(256, 8, 128), meta(256, 8, 128), meta(256, 32, 128), meta(
        2, dtype=torch.int32)
    p.name(q=q, k=k, v=v, do=do, cu=cu)
    runs = {c: {name: (args, kw) for name, args, kw in p.run(fn)}
            for c, fn in sk.backward_variants(p, (do, q, k, v, cu, cu, 0.1, True, None)).items()}
    assert runs["shipped"] == {name: (args, kw) for name, args, kw in p.run(
        lambda: sk.ab.attention_varlen_backward(p, do, q, k, v, cu, cu, 0.1, True, None))}
    kernels = {"stats": "_attn_bwd_stats_kernel", "dq": "_attn_bwd_dq_kernel", "dkdv": "_attn_bwd_dkdv_kernel"}
    for c, overrides in sk.BACKWARD_CANDIDATES.items():
        for part, kernel in kernels.items():
            (args, kw), (args0, kw0) = runs[c][kernel], runs["shipped"][kernel]
            assert kw == {**kw0, **overrides.get(part, {})}, (c, part)
            if "SPLIT_G" not in kw or kw["SPLIT_G"] == kw0["SPLIT_G"]:  # the per-KV-head dK/dV writes dk, dv itself
                assert _no_descs(args) == _no_descs(args0), (c, part)
    assert "_attn_bwd_group_sum_kernel" in runs["shipped"] and "_attn_bwd_group_sum_kernel" not in runs["kvhead"]


def test_the_backend_clock_times_a_plan_the_op_layer_runs_itself(bench):
    """rlk.triton's ``plan_fn`` is what the op layer calls (not ``fn``): the clock must see those calls."""
    host = bench("frameworks/megatron_host")
    from rlk_core import ops
    from rlk_core.backends import REGISTRY, Backend

    ran = []

    def plan(p, x):
        ran.append(p.device)
        return x[..., : x.shape[-1] // 2] * 2

    def fn(x):
        raise AssertionError("the op layer runs the plan, not fn")

    b = Backend("bench.test.plan", "swiglu", fn, devices=("cpu",), priority=1 << 20, builtin=True, plan_fn=plan)
    REGISTRY.register(b, replace=True)
    REGISTRY.refresh()
    try:
        clock = host.BackendClock().install()
        try:
            out = ops.swiglu(torch.ones(4, 8))
        finally:
            clock.uninstall()
    finally:
        REGISTRY.unregister("swiglu", b.id)
        REGISTRY.refresh()
    assert torch.equal(out, torch.full((4, 4), 2.0)) and ran == [torch.device("cpu")]
    assert clock.calls == 1 and clock.seconds > 0
    assert b.plan_fn is plan and b.fn is fn  # uninstalled


def test_bench_linear_tp_forces_each_variant_finished_at_tp_1_and_states_the_rule(bench):
    """bench_linear_tp.py at TP 1 times what the op runs — the forced variant's launches with the last one finished
    (FINISH, into the dtype), one launch plan; at TP > 1 the fp32 partial. Its verdict names the rows where another
    variant beat the rule by more than the slack."""
    bl = bench("bench_linear_tp")
    from rlk_core.ops.linear_tp import triton as T

    p = Recording()
    x, w = meta(1, 4096), meta(4096, 4096)
    for v, last in (("fused", "_linear_tp_fwd_kernel"), ("split", "_linear_tp_merge_kernel"),
                    ("stash", "_linear_tp_stash_kernel")):
        launches = p.run(lambda v=v: T.finished(p, x, w, None, 8, v))
        assert launches[-1][0] == last and launches[-1][2]["FINISH"] is True, v
        assert all(kw["FINISH"] is False for _, _, kw in launches[:-1]), v
        assert all(kw["FINISH"] is False for _, _, kw in p.run(lambda v=v: T.partials(p, x, w, 8, v))), v
    assert bl.parse_variants("all") == T.VARIANTS + bl.forced_variants() and bl.parse_variants("rule") == ()
    assert bl.forced_variants() in ((), T.FORCED)  # smem only where Gluon imports and the device is sm_90
    rows = [{"shape": "8b/o", "TP": 1, "M": 1, "variant": "split", "best": "split", "rule_over_best": 1.0},
            {"shape": "8b/o", "TP": 1, "M": 4096, "variant": "stash", "best": "fused", "rule_over_best": 1.3},
            {"shape": "8b/o", "TP": 4, "M": 1, "variant": "split"}]
    verdict = bl.rule_verdict(rows)
    assert verdict["rows_timed"] == 2 and verdict["rule_best_within_slack"] == 1
    assert [(r["M"], r["best"]) for r in verdict["rows_where_another_variant_is_faster"]] == [(4096, "fused")]
