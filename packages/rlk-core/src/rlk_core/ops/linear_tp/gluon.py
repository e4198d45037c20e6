"""The ``smem`` variant of ``linear_tp_partials`` (contract ``rlk.gemm.tp.v1``): a Hopper Gluon kernel, forced only.

The same arithmetic as every variant of :mod:`rlk_core.ops.linear_tp.triton` — leaf ``j`` a fresh fp32 accumulator
through its k-steps of ``BLOCK_K`` in increasing k (the first k-step with ``use_acc=False``), the leaves merged by
the adjacent-pairs tree in the binary counter's order (``t = s1 + t``, the older subtree on the left), fp32 adds,
the root stored once unrounded (or finished: ``f32(bias)`` added once, one rounding, canonical NaN). What differs is
where the work lives, and so the tile it allows:

- the operands come by TMA (descriptors over ``x [M, K]`` and ``w [N, K]``) into a ``STAGES``-deep shared-memory
  ring, one mbarrier per stage; the producer runs ``STAGES - 1`` k-steps ahead across leaf boundaries (a leaf's
  k-steps are consecutive column blocks of K, so the ring never restarts);
- the MMA is async wgmma from shared memory into one register accumulator, one group in flight: after k-step
  ``g`` is issued, the wait for all but one means ``g - 1``'s MMA has read its stage, which is refilled then;
- the waiting subtrees of the binary counter are fp32 tiles in shared memory (``gl.allocate_shared_memory``:
  exact stores and loads), except the lowest ``REG_SLOTS`` (0 or 1) kept in registers. So the register file holds
  the live accumulator (and at most one waiting tile), and the tile is ``linear``'s 128x128 with 8 warps.

Shared memory (bf16 / fp16, 128x128 tile, ``BLOCK_K`` 64, 3 stages, ``REG_SLOTS`` 1): the ring 3 x (16 + 16) KiB =
96 KiB; the waiting tiles in shared memory ``slots(LEAVES) - 1`` x 64 KiB: 0 at 1 and 2 leaves, 64 KiB at 4, 128
KiB at 8 — 224 KiB at 8 leaves (sm_90 allows 227 KiB a block); registers: two 128x128 fp32 tiles over 256 threads,
64 + 64 a thread. EVEN_K only (``LEAF_K % BLOCK_K == 0``: a leaf's last box never reaches the next leaf's columns;
TMA zero-fills rows past M and N), sm_90 only (wgmma), through the JIT plan only (no AOT build of Gluon kernels).
:func:`rlk_core.ops.linear_tp.triton.variant` never picks it: written and compile-checked, not run on a GPU.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

DTYPES = frozenset({torch.bfloat16, torch.float16})
MAX_LEAVES = 8
# (BLOCK_M, BLOCK_N, GROUP_M, num_warps, STAGES, REG_SLOTS); BLOCK_K from the leaf length (triton.tile_config)
TILE = (128, 128, 8, 8, 3, 1)
SMEM_LIMIT = 232448  # bytes of shared memory a block may have on sm_90 (227 KiB)


@gluon.constexpr_function
def smem_slots(leaves, reg_slots):
    """Waiting subtrees of the binary counter kept in shared memory: ``log2(leaves)`` less those in registers."""
    return max(0, (leaves.bit_length() - 1) - reg_slots)


def smem_bytes(block_m: int, block_n: int, block_k: int, stages: int, leaves: int, reg_slots: int,
               elem: int = 2) -> int:
    """The kernel's shared memory: the operand ring, the waiting fp32 tiles and one mbarrier per stage."""
    ring = stages * (block_m + block_n) * block_k * elem
    return ring + smem_slots(leaves, reg_slots) * block_m * block_n * 4 + stages * 8


def config(dtype: torch.dtype, leaf_k: int, base: dict) -> dict:
    """The launch configuration of the forced variant: ``base`` is ``triton.tile_config`` of :data:`TILE` (so
    ``BLOCK_K`` is every variant's: a function of the dtype and the leaf length), refused where the kernel does not
    apply (:func:`check`)."""
    check(dtype, leaf_k, base["BLOCK_K"])
    bm, bn, group, warps, stages, reg_slots = TILE
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=base["BLOCK_K"], GROUP_M=group, num_warps=warps, STAGES=stages,
                REG_SLOTS=reg_slots, VARIANT="smem")


def check(dtype: torch.dtype, leaf_k: int, block_k: int) -> None:
    """Refuse what the variant does not implement, with the reason."""
    if dtype not in DTYPES:
        raise ValueError(f"linear_tp variant 'smem': dtype {dtype} unsupported (bf16 / fp16 only: wgmma from shared "
                         "memory; fp32 runs the ieee-dot variants)")
    if leaf_k % block_k:
        raise ValueError(f"linear_tp variant 'smem': the leaf length {leaf_k} is not a multiple of BLOCK_K={block_k} "
                         "(EVEN_K only: the last box of a leaf would read the next leaf's columns)")


@gluon.constexpr_function
def _warps_per_cta(block_m, num_warps):
    """wgmma's warp grid: the [4, 1] warpgroup repeated along M while rows remain (16 a warp), then along N."""
    w = [4, 1]
    while w[0] * w[1] < num_warps:
        if block_m > 16 * w[0]:
            w[0] *= 2
        else:
            w[1] *= 2
    return w


@gluon.constexpr_function
def _instr_n(block_m, block_n, num_warps):
    """The widest wgmma N (a multiple of 8 up to 256) that divides the tile's columns per warp column."""
    reps_m = -(-block_m // 16)
    reps_n = -(-num_warps // reps_m)
    cap = max(block_n // reps_n, 8)
    n = 256
    while n > cap or block_n % n:
        n -= 8
    return n


@gluon.jit
def _grouped(pid, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr):
    """``linear``'s grouped tile order (which program computes which tile; never an element's arithmetic)."""
    num_m = gl.cdiv(M, BLOCK_M)
    num_n = gl.cdiv(N, BLOCK_N)
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = gl.minimum(num_m - first_m, GROUP_M)
    return first_m + ((pid % in_group) % size_m), (pid % in_group) // size_m


@gluon.jit
def _fetch(x_desc, w_desc, x_ring, w_ring, ready, g, total, off_m, off_n,
           BLOCK_K: gl.constexpr, STAGES: gl.constexpr):
    """Global k-step ``g`` (column block ``g`` of K: leaves are contiguous) into stage ``g % STAGES``, if any."""
    if g < total:
        s = g % STAGES
        bar = ready.index(s)
        mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [off_m, g * BLOCK_K], bar, x_ring.index(s))
        tma.async_copy_global_to_shared(w_desc, [off_n, g * BLOCK_K], bar, w_ring.index(s))


@gluon.jit
def _f32(b):
    """A loaded bias in fp32, exactly (bf16 by its bits, fp16 by the conversion)."""
    if b.dtype == gl.bfloat16:
        out = (b.to(gl.uint16, bitcast=True).to(gl.uint32) << 16).to(gl.float32, bitcast=True)
    else:
        out = b.to(gl.float32)
    return out


@gluon.jit
def _round(v, y_ptr):
    """triton._round: ``v`` rounded to ``y_ptr``'s dtype (bf16 on the bits, nearest even; fp16 by the conversion),
    a NaN made the dtype's canonical quiet NaN (0x7FC0 / 0x7E00) after the conversion."""
    ty: gl.constexpr = y_ptr.dtype.element_ty
    nan = v != v
    if ty == gl.bfloat16:
        u = v.to(gl.uint32, bitcast=True)
        r = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
        y = gl.where(nan, 0x7FC0, r).to(gl.uint16).to(gl.bfloat16, bitcast=True)
    else:
        canon = gl.full(v.shape, 0x7E00, gl.int16, v.type.layout).to(gl.float16, bitcast=True)
        y = gl.where(nan, canon, v.to(gl.float16))
    return y


@gluon.jit(do_not_specialize=["M"])
def _linear_tp_smem_kernel(
    x_desc, w_desc, y_ptr, b_ptr, M, N, LEAF_K, stride_ym, stride_yn,
    LEAVES: gl.constexpr, REG_SLOTS: gl.constexpr, FINISH: gl.constexpr, HAS_BIAS: gl.constexpr,
    GROUP_M: gl.constexpr, STAGES: gl.constexpr,
):
    """One program per output tile: every leaf in order through the TMA ring and async wgmma, the binary counter's
    waiting subtrees in shared memory (slot ``s`` holds a finished subtree of ``2^(s + REG_SLOTS)`` leaves; with
    ``REG_SLOTS`` 1 the one-leaf subtree waits in registers), the root stored once."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
    NUM_WARPS: gl.constexpr = gl.num_warps()
    gl.static_assert(LEAVES == 1 or LEAVES == 2 or LEAVES == 4 or LEAVES == 8)
    gl.static_assert(REG_SLOTS == 0 or REG_SLOTS == 1)
    gl.static_assert(STAGES >= 2)
    SLOTS: gl.constexpr = smem_slots(LEAVES, REG_SLOTS)

    pid_m, pid_n = _grouped(gl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=_warps_per_cta(BLOCK_M, NUM_WARPS),
        instr_shape=[16, _instr_n(BLOCK_M, BLOCK_N, NUM_WARPS), 256 // x_desc.dtype.primitive_bitwidth])

    x_ring = gl.allocate_shared_memory(x_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], x_desc.layout)
    w_ring = gl.allocate_shared_memory(w_desc.dtype, [STAGES, BLOCK_N, BLOCK_K], w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    if SLOTS > 0:
        pend_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float32)
        pend = gl.allocate_shared_memory(gl.float32, [SLOTS, BLOCK_M, BLOCK_N], pend_layout)

    ksteps = LEAF_K // BLOCK_K
    total = LEAVES * ksteps
    for i in gl.static_range(STAGES - 1):
        _fetch(x_desc, w_desc, x_ring, w_ring, ready, i, total, off_m, off_n, BLOCK_K, STAGES)

    acc = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)
    s1 = gl.zeros((BLOCK_M, BLOCK_N), gl.float32, acc_layout)  # the one-leaf subtree in registers (REG_SLOTS 1)
    for j in gl.static_range(LEAVES):
        for kk in range(ksteps):  # leaf j: k-steps in increasing k, a fresh accumulator at its first
            g = j * ksteps + kk
            stage = g % STAGES
            a = x_ring.index(stage)
            b = w_ring.index(stage)
            mbarrier.wait(ready.index(stage), (g // STAGES) & 1)
            acc = warpgroup_mma(a, b.permute((1, 0)), acc, use_acc=kk > 0, is_async=True)
            acc, a, b = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a, b))
            # k-step g - 1's MMA has read its stage: refill it with step g + STAGES - 1
            _fetch(x_desc, w_desc, x_ring, w_ring, ready, g + STAGES - 1, total, off_m, off_n, BLOCK_K, STAGES)
        t = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        # the binary counter (triton._count): t onto its waiting left siblings, oldest last, fp32 adds
        if j % 2 == 1:
            if REG_SLOTS == 1:
                t = s1 + t
            else:
                t = pend.index(0).load(acc_layout) + t
        if j % 4 == 3:
            t = pend.index(1 - REG_SLOTS).load(acc_layout) + t
        if j % 8 == 7:
            t = pend.index(2 - REG_SLOTS).load(acc_layout) + t
        if j < LEAVES - 1:  # t waits for its right sibling (the last leaf's t is the root)
            if (j + 1) % 4 == 0:
                pend.index(2 - REG_SLOTS).store(t)
            elif (j + 1) % 2 == 0:
                pend.index(1 - REG_SLOTS).store(t)
            elif REG_SLOTS == 1:
                s1 = t
            else:
                pend.index(0).store(t)
        acc = t
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))

    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    out = acc
    if FINISH:
        if HAS_BIAS:
            out = out + _f32(gl.load(b_ptr + cols, mask=cols < N, other=0.0))[None, :]
        out = _round(out, y_ptr)
    ptrs = y_ptr + rows[:, None].to(gl.int64) * stride_ym + cols[None, :] * stride_yn
    gl.store(ptrs, out, mask=(rows[:, None] < M) & (cols[None, :] < N))


def descriptors(x: torch.Tensor, weight: torch.Tensor, block_m: int, block_n: int, block_k: int):
    """The TMA descriptors of ``x [M, K]`` (box ``block_m x block_k``) and ``weight [N, K]`` (``block_n x block_k``),
    made on the host at launch (no device needed; the driver encodes them when the kernel is launched)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    el = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    xl = gl.NVMMASharedLayout.get_default_for([block_m, block_k], el)
    wl = gl.NVMMASharedLayout.get_default_for([block_n, block_k], el)
    return (TensorDescriptor(x, list(x.shape), list(x.stride()), [block_m, block_k], xl),
            TensorDescriptor(weight, list(weight.shape), list(weight.stride()), [block_n, block_k], wl))


def launch(p, x: torch.Tensor, weight: torch.Tensor, leaves: int, out: torch.Tensor, cfg: dict,
           bias: torch.Tensor | None = None, finish: bool = False) -> None:
    """``out [M, N]`` = the call's merged partial (or finished) by :func:`_linear_tp_smem_kernel`; ``cfg`` is
    :func:`rlk_core.ops.linear_tp.triton.config`'s for ``which="smem"``."""
    from rlk_core.ops._plan import JitPlan
    from rlk_core.ops.linear.triton import tma_compatible

    m, k = x.shape
    n = weight.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    check(x.dtype, k // leaves, bk)
    if not isinstance(p, JitPlan):
        raise ValueError("linear_tp variant 'smem': a Gluon kernel runs through the JIT plan (rlk.triton) only; the "
                         "AOT build (rlk.cuda) has no Gluon kernels")
    if x.device.type != "cuda" or torch.cuda.get_device_capability(x.device)[0] != 9:
        raise ValueError("linear_tp variant 'smem': needs an sm_90 GPU (TMA and wgmma)")
    if not tma_compatible(x, weight) or weight.dtype != x.dtype:
        raise ValueError("linear_tp variant 'smem': x and weight must be TMA-compatible (unit last stride, 16-byte "
                         "aligned base and row stride) and of one dtype")
    if leaves > MAX_LEAVES:
        raise ValueError(f"linear_tp variant 'smem': at most {MAX_LEAVES} leaves, got {leaves}")
    x_desc, w_desc = descriptors(x, weight, bm, bn, bk)
    has_bias = finish and bias is not None
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    p.launch(_linear_tp_smem_kernel, (tiles,), x_desc, w_desc, out, bias if has_bias else out, m, n, k // leaves,
             out.stride(0), out.stride(1), LEAVES=leaves, REG_SLOTS=cfg["REG_SLOTS"], FINISH=finish,
             HAS_BIAS=has_bias, GROUP_M=cfg["GROUP_M"], STAGES=cfg["STAGES"], num_warps=cfg["num_warps"])
