"""The ``smem`` variant of linear_tp (the Gluon kernel, ``rlk_core.ops.linear_tp.gluon``) compiles for sm_90 on this
CPU machine at its tile and 1 / 2 / 4 / 8 leaves — the fp32 partial and the finished store, bf16 and fp16 — without
register spills or serialised wgmma (ptxas's report, test_kernels_compile_sm90's check), within sm_90's shared
memory and with exactly the budget the module states; and the variant is reachable only forced."""

import importlib.util

import pytest
import torch

from .test_kernels_compile_sm90 import _check_ptxas

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


def _gluon():
    """The module, or a skip naming the Gluon feature this Triton lacks."""
    try:
        from rlk_core.ops.linear_tp import gluon
    except (ImportError, AttributeError) as e:
        pytest.skip(f"Gluon for Hopper (triton.experimental.gluon ... hopper: tma, mbarrier, warpgroup_mma) is "
                    f"missing in the installed Triton: {e}")
    return gluon


def _compile(G, leaves, dtype=torch.bfloat16, finish=False, bias=False, tile=None):
    """The kernel as the JIT would compile a launch of ``gluon.launch`` on aligned operands (Triton's own binder,
    ``rlk_core.ops._plan.specialize``, on meta tensors), through Gluon's source (``GluonASTSource``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from rlk_core.ops._plan import Target, specialize
    from rlk_core.ops.linear_tp import triton as T

    cfg = T.config(dtype, 256, 512, 512, "smem")
    if tile is not None:  # (BLOCK_M, BLOCK_N, STAGES, REG_SLOTS): another budget than the shipped one
        cfg.update(BLOCK_M=tile[0], BLOCK_N=tile[1], STAGES=tile[2], REG_SLOTS=tile[3])
    k = 512 * leaves
    x = torch.empty((256, k), dtype=dtype, device="meta")
    w = torch.empty((512, k), dtype=dtype, device="meta")
    y = torch.empty((256, 512), dtype=dtype if finish else torch.float32, device="meta")
    b = torch.empty((512,), dtype=dtype, device="meta")
    xd, wd = G.descriptors(x, w, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"])
    kernel = G._linear_tp_smem_kernel
    _, bound, spec, options = specialize(
        Target("cuda", 90, 32), kernel, (xd, wd, y, b if bias else y, 256, 512, 512, 512, 1),
        dict(LEAVES=leaves, REG_SLOTS=cfg["REG_SLOTS"], FINISH=finish, HAS_BIAS=bias, GROUP_M=cfg["GROUP_M"],
             STAGES=cfg["STAGES"], num_warps=cfg["num_warps"]))
    signature, constexprs, attrs = {}, {}, {}
    for i, (name, (ty, attr)) in enumerate(zip(bound, spec, strict=True)):
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    assert constexprs["stride_yn"] == 1  # specialised as the launch is: a unit output stride
    src = GluonASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": options["num_warps"]})
    _check_ptxas(compiled.asm["ptx"], kernel.__name__)
    budget = G.smem_bytes(cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["STAGES"], leaves, cfg["REG_SLOTS"])
    return compiled, cfg, budget


@pytest.mark.parametrize("leaves", [1, 2, 4, 8])
def test_smem_partial_compiles_without_spills(leaves):
    G = _gluon()
    compiled, cfg, budget = _compile(G, leaves)
    ptx = compiled.asm["ptx"]
    assert (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]) == (128, 128, 64, 8)
    assert compiled.metadata.shared == budget <= G.SMEM_LIMIT, (compiled.metadata.shared, budget)
    # a leaf's k-step of 64 is four chained k16 wgmma per warpgroup, each leaf's loop once in the unrolled kernel
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16") == 4 * leaves
    assert "cp.async.bulk.tensor.2d" in ptx
    assert "fma.rn.f32" not in ptx  # the tree's adds are adds (nothing to contract)


@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)])
def test_smem_finished_compiles_without_spills(dtype, bias):
    G = _gluon()
    compiled, _, budget = _compile(G, 8, dtype, finish=True, bias=bias)
    assert compiled.metadata.shared == budget <= G.SMEM_LIMIT
    if dtype == torch.bfloat16:  # the rounding on the bits, as triton._round (no cvt of a NaN)
        assert "cvt.rn.bf16.f32" not in compiled.asm["ptx"]


def test_every_waiting_subtree_in_shared_memory_compiles():
    """The register file holding only the live accumulator (REG_SLOTS 0): at 128x64 / 4 stages and 8 leaves the
    three waiting tiles are 96 KiB, the ring 96 KiB."""
    G = _gluon()
    compiled, _, budget = _compile(G, 8, tile=(128, 64, 4, 0))
    assert compiled.metadata.shared == budget == 3 * 128 * 64 * 4 + 4 * (128 + 64) * 64 * 2 + 4 * 8
    ptx = compiled.asm["ptx"]
    assert "ld.shared" in ptx and "st.shared" in ptx  # the waiting tiles' stores and loads


def test_the_budget_does_not_fit_a_third_waiting_tile_at_128x128():
    """Why REG_SLOTS is 1 at 128x128: all three waiting tiles of 8 leaves in shared memory exceed sm_90's block."""
    G = _gluon()
    assert G.smem_bytes(128, 128, 64, 3, 8, 0) > G.SMEM_LIMIT >= G.smem_bytes(128, 128, 64, 3, 8, 1)


def test_smem_is_forced_only_and_refuses_what_it_does_not_implement():
    G = _gluon()
    from rlk_core.ops.linear_tp import triton as T

    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for m in (1, 16, 17, 128, 129, 1024, 8192):
            assert T.variant(dtype, m, 4096, 512) in T.VARIANTS  # the rule never picks it
    assert "smem" not in T.VARIANTS and "smem" in T.FORCED
    assert T.config(torch.bfloat16, 1024, 4096, 512, "smem")["VARIANT"] == "smem"
    with pytest.raises(ValueError, match="bf16 / fp16 only"):
        T.config(torch.float32, 1024, 4096, 512, "smem")
    with pytest.raises(ValueError, match="EVEN_K only"):
        T.config(torch.bfloat16, 1024, 4096, 512 + 16, "smem")
    with pytest.raises(ValueError, match="no variant"):
        T.config(torch.bfloat16, 1024, 4096, 512, "nope")
    # the AOT build compiles none of it
    assert not any(call[1][4].get("VARIANT") == "smem" for call in T.build_calls(torch.bfloat16, 132))
    assert G.TILE[:2] == (128, 128)
