"""Every GPU kernel compiles for sm_90 (H100/H200) on this CPU machine, through Triton's whole pipeline down
to a cubin (the wheel bundles ptxas), with the shipped configurations and the specialisation a launch on
real tensors gets; ptxas's report is checked for register spills and serialised wgmma.

The interpreter tests run the kernels' Python, not Triton's compiler: a kernel can pass them and still
be rejected by the compiler (a plain module global read inside a kernel did, once, and cost a device
call). The PTX is also checked for the MMA instructions the docs claim: wgmma for tiles of 64 rows and
more, ``mma.sync`` for the GEMM's 16-row tail."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

BF16_BOX = "tensordesc<bf16[{},{}]>"


def compile_sm90(kernel, constexprs, pointers=None, descriptors=None, floats=(), num_warps=4, num_stages=3,
                 full=False, ones=(), plain=(), max_spill=0):
    """Compile ``kernel`` for sm_90: arguments ending in ``_ptr`` are bf16 pointers unless ``pointers``
    says otherwise, ``descriptors`` maps TMA descriptor arguments to their boxes, ``floats`` are fp32
    scalars, the rest int32; returns the PTX (``full``: the compiled kernel, with its metadata).

    Specialised as a launch on real tensors is: pointers 16-byte aligned, integer arguments (strides,
    sizes) divisible by 16 except those in ``plain`` and the kernel's ``do_not_specialize``, and those in
    ``ones`` equal to 1 (Triton turns such an argument into a constant: a unit stride). Without this the
    compile would address every element separately — ptxas's register counts would not be the launch's.
    ``max_spill``: bytes of register spill stores ptxas may report (see :func:`_check_ptxas`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers, descriptors = pointers or {}, descriptors or {}
    constexprs = {**constexprs, **{name: 1 for name in ones}}
    loose = {*plain, *getattr(kernel, "do_not_specialize", ())}
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in descriptors:
            signature[name] = BF16_BOX.format(*descriptors[name])
        else:
            if name.endswith("_ptr"):
                signature[name] = pointers.get(name, "*bf16")
            else:
                signature[name] = "fp32" if name in floats else "i32"
            if name not in floats and name not in loose:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    _check_ptxas(compiled.asm["ptx"], kernel.__name__, max_spill)
    return compiled if full else compiled.asm["ptx"]


def _check_ptxas(ptx: str, name: str, max_spill: int = 0) -> None:
    """ptxas's own report on the kernel (the bundled ptxas, ``-v``): at most ``max_spill`` bytes of
    register spill stores, and no wgmma serialised by its accumulator being written between pipeline
    stages (warning C7515: the MMAs then run one after the other; it appears, e.g., when a 64-row tail dot
    shares the K loop with a 128-row one)."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    import triton

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    assert ptxas.exists(), f"{ptxas}: the Triton wheel's ptxas (it also built the cubin)"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        proc = subprocess.run([str(ptxas), "-v", "--gpu-name=sm_90a", str(src), "-o", str(Path(tmp) / "k.cubin")],
                              capture_output=True, text=True, timeout=300)
    report = proc.stdout + proc.stderr
    assert proc.returncode == 0, report[-2000:]
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert spills is not None, report[-2000:]
    assert int(spills.group(1)) <= max_spill, f"{name} spills registers:\n{report[-2000:]}"
    assert "C7515" not in report, f"{name}: ptxas serialises its wgmma:\n{report[-2000:]}"


INT_PTRS = {n: "*i32" for n in ("table_ptr", "cu_q_ptr", "lens_ptr", "qpos_ptr", "pos_ptr", "cu_k_ptr")}


@pytest.mark.parametrize("paged", [False, True])
def test_attention_forward_compiles(paged):
    import torch

    from rlk_core.ops.attention import triton as at

    cfg = at.config(torch.bfloat16, 128, "decode" if paged else "prefill")
    tma = cfg.pop("KV_TMA") and not paged
    warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    box = (cfg["BLOCK_N"], cfg["D_PAD"])
    const = dict(cfg, G_PAD=4, PAGED=paged, KV_TMA=tma)
    if not tma:
        const.update(k_desc=None, v_desc=None)
    ptx = compile_sm90(at._attention_fwd_kernel, const, INT_PTRS, {"k_desc": box, "v_desc": box} if tma else None,
                       floats=("qk_scale",), num_warps=warps, num_stages=stages,
                       ones=("stride_qd", "stride_kd", "stride_vd", "stride_od"))
    assert "wgmma" in ptx


def test_kv_cache_write_compiles():
    from rlk_core.ops.attention import triton as at

    compile_sm90(at._kv_cache_write_kernel, dict(HEAD_D=128, D_PAD=128, H_PAD=8), {"slot_ptr": "*i64"})


def test_attention_backward_compiles():
    import torch

    from rlk_core.ops.attention import triton_backward as ab

    cfg = ab.config(torch.bfloat16, 128)
    ptrs = {**INT_PTRS, "lse_ptr": "*fp32", "delta_ptr": "*fp32"}
    common = dict(G=4, MODE=ab.MODE_ALIGNED, IEEE=False)
    for kernel, part in ((ab._attn_bwd_stats_kernel, "stats"), (ab._attn_bwd_dq_kernel, "dq")):
        c = dict(cfg[part])
        warps, stages = c.pop("num_warps"), c.pop("num_stages")
        box = (c["BLOCK_N"], c["BLOCK_D"])
        assert c["KV_TMA"]
        ptx = compile_sm90(kernel, dict(common, **c), ptrs, {"k_desc": box, "v_desc": box},
                           floats=("qk_scale2", "scale"), num_warps=warps, num_stages=stages)
        assert "wgmma" in ptx, part
    c = dict(cfg["dkdv"])
    warps, stages = c.pop("num_warps"), c.pop("num_stages")
    # dK/dV: two 64x128 fp32 accumulators on 4 warps (128 registers a thread) beside the recomputed P and
    # dS tiles: 255 registers and 128 bytes spilled (ptxas, this configuration; measured 1.12x flash anyway)
    compile_sm90(ab._attn_bwd_dkdv_kernel, dict(common, **c), {**ptrs, "dk_ptr": "*fp32", "dv_ptr": "*fp32"},
                 floats=("qk_scale2", "scale"), num_warps=warps, num_stages=stages, max_spill=128)
    compile_sm90(ab._attn_bwd_group_sum_kernel, dict(G=4, BLOCK_T=ab._SUM_BLOCK_T, BLOCK_D=128),
                 {"dk_part_ptr": "*fp32", "dv_part_ptr": "*fp32"}, floats=("scale",))


SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def compile_gemm_tma(tile, rem=0, pdl=0):
    """The persistent TMA GEMM for one tile (a 7th entry: the tail's rows), with a last-row-block box of
    ``rem`` rows, as a row split's first (``pdl`` 1) or second (2) launch or neither; the compiled kernel."""
    from rlk_core.ops.linear import triton as lt

    c = lt.tile_config(tile, 4096, tma=True)
    bm, bn, bk, tail = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["TAIL_M"]
    boxes = {"x_desc": (bm, bk), "w_desc": (bn, bk), "y_desc": (bm, bn)}
    const = dict(HAS_BIAS=True, IEEE=False, NUM_PROGRAMS=132, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 GROUP_M=c["GROUP_M"], TAIL_M=tail, REM_M=rem, PDL=pdl)
    if tail or rem:
        boxes.update(xt_desc=(tail or rem, bk), yt_desc=(tail or rem, bn))
    else:
        const.update(xt_desc=None, yt_desc=None)
    return compile_sm90(lt._linear_tma_kernel, const, descriptors=boxes, num_warps=c["num_warps"],
                        num_stages=c["num_stages"], full=True)


@pytest.mark.parametrize("tile,m", [((64, 64, 128, 8, 4, 4, 16), 65), ((128, 256, 64, 8, 8, 3), 4096),
                                    ((128, 256, 64, 8, 8, 3), 4136), ((128, 64, 128, 8, 8, 4), 100),
                                    ((64, 32, 256, 8, 4, 4), 65), ((64, 32, 256, 8, 4, 4), 90),
                                    ((64, 128, 64, 8, 4, 5), 20), ((64, 64, 128, 8, 4, 4), 96)])
def test_gemm_tma_kernel_compiles(tile, m):
    """The persistent TMA GEMM: plain, with the 16-row tail, and with the last row block's smaller box
    (64-row tiles only: M = 65 a 16-row box, 90 and 20 a 32-row box, 96 none), within shared memory."""
    from rlk_core.ops.linear import triton as lt

    tail = tile[6] if len(tile) > 6 else 0
    rem = 0 if tail else lt.rem_rows(m, tile[0])
    assert rem == {65: 16, 90: 32, 20: 32}.get(m, 0) or tail
    compiled = compile_gemm_tma(tile, rem)
    ptx = compiled.asm["ptx"]
    assert "wgmma" in ptx
    # the tail's / last row block's dot below 64 rows: mma.sync beside the wgmma of the full rows
    assert ("mma.sync" in ptx) == (0 < (tail or rem) < 64)
    assert compiled.metadata.shared <= SMEM_LIMIT, compiled.metadata.shared


@pytest.mark.parametrize("pdl,instruction", [(0, None), (1, "griddepcontrol.launch_dependents"),
                                             (2, "griddepcontrol.wait")])
def test_gemm_row_split_launches_carry_their_grid_dependency_control(pdl, instruction):
    """A row split's first launch lets the second start early; the second waits for the first before its
    programs exit (the only thing that orders the first launch before work queued after the second)."""
    ptx = compile_gemm_tma((128, 256, 64, 8, 8, 3), pdl=pdl).asm["ptx"]
    found = {i for i in ("griddepcontrol.launch_dependents", "griddepcontrol.wait") if i in ptx}
    assert found == ({instruction} if instruction else set())


def test_every_gemm_tile_fits_shared_memory_with_its_last_box():
    """Every TMA tile the rule can pick, with every last-row-block box :func:`rem_rows` can give it (the
    shared memory of both K loops adds up; a 64-row box beside 128x256 tiles was measured not to fit)."""
    from rlk_core.ops.linear import tiles as rule
    from rlk_core.ops.linear import triton as lt

    tma_tiles = {*rule._SMALL_TMA, *rule._MID_TMA, *rule._TAIL_TMA, *(e[0] for e in rule._LARGE_TMA)}
    for tile in sorted(tma_tiles):
        rems = {0} if len(tile) > 6 else {lt.rem_rows(m, tile[0]) for m in range(1, 2 * tile[0] + 1)}
        for rem in sorted(rems):
            shared = compile_gemm_tma(tile, rem).metadata.shared
            assert shared <= SMEM_LIMIT, (tile, rem, shared)


def test_gemm_pointer_kernel_compiles_for_decode_tiles():
    from rlk_core.ops.linear import tiles as rule
    from rlk_core.ops.linear import triton as lt

    c = lt.tile_config(rule._DECODE[0], 4096)
    ptx = compile_sm90(lt._linear_fwd_kernel, dict(HAS_BIAS=False, EVEN_K=True, IEEE=False, BLOCK_M=c["BLOCK_M"],
                       BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"], b_ptr=None),
                       num_warps=c["num_warps"], num_stages=c["num_stages"],
                       ones=("stride_xk", "stride_wk", "stride_yn"))
    assert "mma.sync" in ptx  # 16-row tiles: below wgmma's 64


def test_rowwise_kernels_compile():
    from rlk_core.ops.rms_norm import triton as rms
    from rlk_core.ops.rope import triton as rope
    from rlk_core.ops.swiglu import triton as swiglu

    c = rms.config(4096)
    compile_sm90(rms._rms_norm_fwd_kernel, {"BLOCK_H": c["BLOCK_H"], "ROWS": c["ROWS"]}, floats=("eps",),
                 num_warps=c["num_warps"])
    c = swiglu.config(12288)
    compile_sm90(swiglu._swiglu_fwd_kernel, {"BLOCK": c["BLOCK"]}, num_warps=c["num_warps"])
    c = rope.config(32, 64)
    compile_sm90(rope._rope_fwd_kernel, dict(HALF=64, D=128, R=128, BLOCK_H=c["BLOCK_H"], BLOCK_HALF=c["BLOCK_HALF"],
                                             BLOCK_PASS=0),
                 {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}, num_warps=c["num_warps"])


@pytest.mark.parametrize("h", [128, 1000, 1024, 4096, 8192])
@pytest.mark.parametrize("wdtype", ["*bf16", "*fp32"])
def test_rms_norm_backward_kernels_compile(h, wdtype):
    """dx and the dweight partials (the q/k-norm width 128, Qwen3-0.6B's 1024, 8B's 4096) and the merge of the
    partials, bf16 activations with a bf16 or fp32 weight: no register spills."""
    from rlk_core.ops.rms_norm import triton as rms

    c = rms.config(h)
    compile_sm90(rms._rms_norm_bwd_kernel, {"BLOCK_H": c["BLOCK_H"], "ROWS": c["ROWS"]},
                 {"w_ptr": wdtype, "part_ptr": "*fp32"}, floats=("eps",), num_warps=c["num_warps"])
    compile_sm90(rms._rms_norm_bwd_dw_kernel, {"BLOCK_P": rms.DW_BLOCK_P, "BLOCK_N": rms.DW_BLOCK_N},
                 {"part_ptr": "*fp32", "dw_ptr": wdtype}, num_warps=rms.DW_WARPS)


@pytest.mark.parametrize("inter", [3072, 12288, 100])
def test_swiglu_backward_kernel_compiles(inter):
    from rlk_core.ops.swiglu import triton as swiglu

    c = swiglu.config(inter)
    compile_sm90(swiglu._swiglu_bwd_kernel, {"BLOCK": c["BLOCK"]}, num_warps=c["num_warps"])


@pytest.mark.parametrize("kernel", ["_rope_fwd_kernel", "_rope_bwd_kernel"])
@pytest.mark.parametrize("heads,d,rd", [(16, 128, 128), (32, 128, 128), (8, 128, 64)])
def test_rope_kernels_compile(kernel, heads, d, rd):
    """The forward and the backward (the forward's code with sin negated), with the table-row bound N_POS; the
    launches pass enable_fp_fusion=False, which only splits FMAs (this helper compiles with Triton's defaults)."""
    from rlk_core.ops._plan import next_pow2
    from rlk_core.ops.rope import triton as rope

    c = rope.config(heads, rd // 2)
    compile_sm90(getattr(rope, kernel), dict(HALF=rd // 2, D=d, R=rd, BLOCK_H=c["BLOCK_H"],
                                             BLOCK_HALF=c["BLOCK_HALF"], BLOCK_PASS=next_pow2(d - rd) if d > rd else 0),
                 {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}, num_warps=c["num_warps"])


def test_logprob_kernels_compile():
    from rlk_core.ops.token_logprobs import triton as tt

    f32 = {n: "*fp32" for n in ("temp_ptr", "m_ptr", "s_ptr", "zt_ptr", "lse_ptr", "glogp_ptr", "glse_ptr")}
    ptrs = {**f32, "target_ptr": "*i64"}
    compile_sm90(tt._logp_block_fwd_kernel, {"BLOCK_T": tt.BLOCK_T, "BLOCK": tt.L.BLOCK}, ptrs,
                 num_warps=tt.NUM_WARPS)
    compile_sm90(tt._logp_grad_kernel, {"BLOCK_T": tt.GRAD_BLOCK_T, "BLOCK_N": tt.GRAD_BLOCK_N}, ptrs,
                 num_warps=tt.NUM_WARPS)


def test_ptxas_check_catches_spills_and_serialised_wgmma():
    """The ptxas check can fail: the decode GEMM compiled without its unit strides (every element addressed
    separately) spills, and a 64-row tail dot beside a 128-row one in the same K loop (not a shipped
    tile) serialises the wgmma."""
    from rlk_core.ops.linear import tiles as rule
    from rlk_core.ops.linear import triton as lt

    c = lt.tile_config(rule._DECODE[0], 4096)
    with pytest.raises(AssertionError, match="spills registers"):
        compile_sm90(lt._linear_fwd_kernel, dict(HAS_BIAS=False, EVEN_K=True, IEEE=False, BLOCK_M=c["BLOCK_M"],
                     BLOCK_N=c["BLOCK_N"], BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"], b_ptr=None),
                     num_warps=c["num_warps"], num_stages=c["num_stages"])
    with pytest.raises(AssertionError, match="serialises its wgmma"):
        compile_gemm_tma((128, 256, 64, 8, 8, 2, 64))


# -- the linear backward's stored-layout GEMMs (ops/linear/triton.py: _linear_bwd_tma_kernel, _linear_bwd_kernel) --
def compile_gemm_stored(tile, a_km, b_kn, y):
    """The persistent stored-layout TMA GEMM for one tile: ``a_km`` the left operand stored [K, M] (dW), ``b_kn``
    the right one stored [K, N] (dx, dW), ``y`` the output's store ("tma", or pointer stores of "bf16"/"fp32");
    the compiled kernel."""
    from rlk_core.ops.linear import tiles as rule
    from rlk_core.ops.linear import triton as lt

    c = rule.stored_tile_config(tile, tma=True)
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    boxes = {"a_desc": (bk, bm) if a_km else (bm, bk), "b_desc": (bk, bn) if b_kn else (bn, bk)}
    const = dict(A_KM=a_km, B_KN=b_kn, Y_TMA=y == "tma", NUM_PROGRAMS=132, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                 GROUP_M=c["GROUP_M"])
    if y == "tma":
        boxes["y_desc"] = (bm, bn)
    else:
        const["y_desc"] = None
    return compile_sm90(lt._linear_bwd_tma_kernel, const, {"y_ptr": "*" + ("bf16" if y == "tma" else y)}, boxes,
                        num_warps=c["num_warps"], num_stages=c["num_stages"], full=True, ones=("stride_yn",))


def _stored_tma_variants():
    """(tile, a_km, b_kn, y) of every TMA variant :func:`stored_config` and the launcher can give: dx's layout
    (W stored [K, N]), dW's (both operands stored [K, N]) and a transposed x alone; the output stored by TMA or,
    where it is not TMA-compatible, by pointers; fp32 outputs (`into`) only with their own tile."""
    from rlk_core.ops.linear import tiles as rule

    layouts = ((False, True), (True, True), (True, False))
    return [(tile, a_km, b_kn, y) for tile, ys in [*((e[0], ("tma", "bf16")) for e in rule._STORED_TMA),
                                                   (rule._STORED_F32_OUT, ("fp32",))]
            for a_km, b_kn in layouts for y in ys]


@pytest.mark.parametrize("tile,a_km,b_kn,y", _stored_tma_variants())
def test_linear_backward_tma_kernel_compiles(tile, a_km, b_kn, y):
    """Every stored-layout TMA variant compiles to wgmma (an operand stored [K, M] or [K, N] is read M- or
    N-major from shared memory, no transposed copy), without spills, within shared memory."""
    compiled = compile_gemm_stored(tile, a_km, b_kn, y)
    assert "wgmma" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= SMEM_LIMIT, compiled.metadata.shared


def test_linear_backward_fp32_output_needs_its_smaller_tile_negative_control():
    """The shared-memory check above can fail: the 128x256 tile with its fp32 output stored by pointers needs
    more than an SM has (why fp32 outputs get a tile of their own)."""
    compiled = compile_gemm_stored((128, 256, 64, 8, 8, 3), False, True, "fp32")
    assert compiled.metadata.shared > SMEM_LIMIT, compiled.metadata.shared


@pytest.mark.parametrize("dtype,role", [("bf16", "dx"), ("bf16", "dw"), ("bf16", "db"), ("fp32", "dw"),
                                        ("fp32", "db")])
def test_linear_backward_pointer_kernel_compiles(dtype, role):
    """The pointer-load variant (what TMA cannot take: fp32, db's broadcast ones, misaligned operands) with the
    unit strides a launch gets: dx reads dy [T, N] and W [N, K] along their rows, dW and db read dy^T as
    stored [T, N] (unit stride along M), db's ones broadcast (stride 0 along K). M and K (the token count)
    stay unspecialised."""
    import torch

    from rlk_core.ops.linear import tiles as rule
    from rlk_core.ops.linear import triton as lt

    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    tile = (rule._STORED_NARROW if role == "db" else rule._STORED_PTR)[tdt]
    c = rule.stored_tile_config(tile, tdt, False)
    ones = {"dx": ("stride_ak", "stride_bn", "stride_yn"), "dw": ("stride_am", "stride_bn", "stride_yn"),
            "db": ("stride_am", "stride_bn", "stride_yn")}[role]
    ptx = compile_sm90(lt._linear_bwd_kernel, dict(IEEE=c["IEEE"], BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"],
                                                   BLOCK_K=c["BLOCK_K"], GROUP_M=c["GROUP_M"]),
                       {n: "*" + dtype for n in ("a_ptr", "b_ptr", "y_ptr")}, num_warps=c["num_warps"],
                       num_stages=c["num_stages"], ones=ones)
    assert ("wgmma" in ptx) == (dtype == "bf16")  # fp32: ieee dots (no tensor cores)
