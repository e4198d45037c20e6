"""The kernel-trace gate (``kernel-trace.json``, rlk_validate.kernel_trace): the family classifier on kernel names as
CUDA traces spell them, and the gate of ``rlk-validate`` on run directories holding such traces. Torch-free."""

from __future__ import annotations

from pathlib import Path

import pytest
from validate_builders import PP, RR, build_run, mutate_json, write_json

from rlk_validate.kernel_trace import KERNEL_TRACE, KERNEL_TRACE_SCHEMA, classify, families

# kernel names as torch.profiler reports them on an H100/H200 (cuBLAS 12/13, FlashAttention 2/3, NCCL 2.2x, vLLM)
VENDOR = {
    "vendor_gemm": [
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNN",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
        "__5x_cublas",
        "ampere_bf16_s16816gemm_bf16_128x128_ldg8_f2f_stages_32x5_tn",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(Params)",
        "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>(...)",
        "void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>(...)",
        "aten::mm",
    ],
    "vendor_attention": [
        "void flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
        "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, false>(Params)",
        "void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, true, false>(Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>(Params)",
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<...>::Params)",
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0",
        "void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, __nv_bfloat16, 0>(...)",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ],
    "vendor_allreduce": [
        "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
        "void vllm::cross_device_reduce_1stage<__nv_bfloat16, 2>(vllm::RankData*, vllm::RankSignals, ...)",
        "c10d::allreduce_",
    ],
}
ALLOWED = [
    "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "ncclDevKernel_Broadcast_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
    "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
    "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >",
    "void at::native::(anonymous namespace)::indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>",
    "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, at::native::FusedAdamMathFunctor>",
    "Memcpy DtoD (Device -> Device)",
    "aten::add",
]
# rlk's Triton kernels (the @triton.jit names; the AOT cubins keep them) for one R/R round of both sides
RLK_ROLLOUT = ["_linear_fwd_kernel", "_rms_norm_fwd_kernel", "_rope_fwd_kernel", "_kv_cache_write_kernel",
               "_attention_fwd_kernel", "_swiglu_fwd_kernel", "_logp_block_fwd_kernel", "_merge_blocks_kernel"]
RLK_TRAIN = [*RLK_ROLLOUT, "_linear_bwd_kernel", "_rms_norm_bwd_kernel", "_rms_norm_bwd_dw_kernel",
             "_swiglu_bwd_kernel", "_attn_bwd_stats_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel",
             "_logp_grad_kernel", "_rope_bwd_kernel"]
# the transport of an rlk all-reduce: NCCL data movement and the fixed-order adds, inside its profiler range
COLLECTIVE = [["ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "rlk.collective.all_reduce", 8],
              ["void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
               "rlk.collective.all_reduce", 8]]


@pytest.mark.parametrize("family", sorted(VENDOR))
def test_vendor_kernels_are_classified_as_vendor(family: str) -> None:
    assert [classify(n) for n in VENDOR[family]] == [family] * len(VENDOR[family])


def test_allowed_kernels_are_no_gated_family() -> None:
    assert [classify(n) for n in ALLOWED] == ["other"] * len(ALLOWED)
    assert classify("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>") == "vendor_softmax"


def test_rlk_kernels_and_ops_by_family() -> None:
    got = families([[n, None, 1] for n in RLK_TRAIN])
    assert got == {"attention_bwd": 3, "attention_fwd": 2, "gemm": 2, "logp": 3, "rms_norm": 3, "rope": 2,
                   "swiglu": 2}
    assert classify("rlk::linear") == classify("linear_function") == "gemm"
    assert classify("attention_varlen_function") == "attention_fwd"
    assert classify("autograd::engine::evaluate_function: attention_varlen_functionBackward") == "attention_bwd"
    assert classify("rlk.collective.reduce_scatter") == "collective"
    assert classify("aten::linear") == "vendor_gemm" and classify("rlk::frobnicate") == "other"


def test_context_decides_only_for_names_of_no_family() -> None:
    """An NCCL AllGather inside an rlk collective is the collective's; a cuBLAS GEMM inside rlk::linear (a reference
    backend on a GPU) is still a vendor GEMM."""
    assert classify(COLLECTIVE[0][0], "rlk.collective.all_reduce") == "collective"
    assert classify(COLLECTIVE[0][0]) == "other"
    assert classify(VENDOR["vendor_gemm"][0], "rlk::linear") == "vendor_gemm"


def _units(names: list[str], context: str | None = None, count: int = 4) -> list[list]:
    return [[n, context, count] for n in names]


def _trace(rollout: list[list], train: list[list], tp: int = 2) -> dict:
    return {"schema": KERNEL_TRACE_SCHEMA, "source": "torch.profiler (recorded names)", "device": "cuda:0",
            "units": "kernels", "round": 0, "tp": tp,
            "sides": {"rollout": {"families": families(rollout), "units": rollout},
                      "train": {"families": families(train), "units": train}}}


def _rr_units() -> tuple[list[list], list[list]]:
    return (_units(RLK_ROLLOUT + ALLOWED) + COLLECTIVE, _units(RLK_TRAIN + ALLOWED) + COLLECTIVE)


def _traced_run(path: Path, doc: dict, plan: dict[str, str] = RR, asked: bool = True) -> Path:
    run = build_run(path, plan)
    write_json(run / KERNEL_TRACE, doc)
    if asked:
        mutate_json(run / "manifest.json", lambda m: m.setdefault("config", {}).update(trace=True))
    return run


def test_all_r_trace_with_every_family_and_no_vendor_kernel_passes(tmp_path: Path, cli) -> None:
    r = cli(_traced_run(tmp_path / "run", _trace(*_rr_units())))
    assert r.code == 0, r.codes
    (summary,) = r.findings("KERNEL_TRACE_SUMMARY")
    assert summary["details"]["families"]["train"]["attention_bwd"] == 12
    assert summary["details"]["families"]["rollout"]["collective"] == 16


@pytest.mark.parametrize("family", sorted(VENDOR))
@pytest.mark.parametrize("side", ["rollout", "train"])
def test_a_vendor_kernel_in_an_all_r_round_fails(tmp_path: Path, cli, family: str, side: str) -> None:
    roll, train = _rr_units()
    (roll if side == "rollout" else train).append([VENDOR[family][0], None, 1])
    r = cli(_traced_run(tmp_path / "run", _trace(roll, train)))
    assert r.code == 1 and r.codes.count("VENDOR_KERNEL_IN_R") == 1, r.codes
    (f,) = r.findings("VENDOR_KERNEL_IN_R")
    assert f["details"] == {"side": side, "families": {family: 1}}


@pytest.mark.parametrize("family,kernels", [("attention_bwd", ("_attn_bwd_stats_kernel", "_attn_bwd_dkdv_kernel",
                                                                "_attn_bwd_dq_kernel")),
                                             ("swiglu", ("_swiglu_fwd_kernel", "_swiglu_bwd_kernel")),
                                             ("collective", ())])
def test_an_all_r_round_lacking_an_rlk_family_fails(tmp_path: Path, cli, family: str, kernels: tuple) -> None:
    roll, train = _rr_units()
    keep = [u for u in roll + train if u[0] not in kernels and (family != "collective" or u[1] is None)]
    r = cli(_traced_run(tmp_path / "run", _trace([u for u in keep if u in roll], [u for u in keep if u in train])))
    assert r.code == 1 and r.codes.count("KERNEL_FAMILY_MISSING") == 1, r.codes
    assert r.findings("KERNEL_FAMILY_MISSING")[0]["details"]["families"] == [family]


def test_no_collective_is_required_at_tp_1(tmp_path: Path, cli) -> None:
    roll, train = ([u for u in side if u[1] is None] for side in _rr_units())
    assert cli(_traced_run(tmp_path / "run", _trace(roll, train, tp=1))).code == 0


def test_a_native_trace_is_reported_not_gated(tmp_path: Path, cli) -> None:
    names = [n for ns in VENDOR.values() for n in ns] + ALLOWED
    r = cli(_traced_run(tmp_path / "run", _trace(_units(names), _units(names)), plan=PP))
    assert "VENDOR_KERNEL_IN_R" not in r.codes and "KERNEL_FAMILY_MISSING" not in r.codes
    assert r.findings("KERNEL_TRACE_SUMMARY")[0]["details"]["families"]["train"]["vendor_gemm"] == 4 * 7


def test_families_that_are_not_those_of_the_units_fail(tmp_path: Path, cli) -> None:
    roll, train = _rr_units()
    doc = _trace(roll, train)
    doc["sides"]["train"]["families"]["vendor_gemm"] = 0  # a zero count is no claim
    doc["sides"]["rollout"]["families"]["gemm"] += 1
    r = cli(_traced_run(tmp_path / "run", doc))
    assert r.code == 1 and r.codes.count("KERNEL_TRACE_DISAGREES") == 1, r.codes


def test_trace_asked_for_but_absent_is_incomplete(tmp_path: Path, cli) -> None:
    run = _traced_run(tmp_path / "run", _trace(*_rr_units()))
    (run / KERNEL_TRACE).unlink()
    r = cli(run)
    assert r.code == 2 and r.codes == ["KERNEL_TRACE_MISSING"], r.codes
    (run / "manifest.json").write_text((run / "manifest.json").read_text().replace('"trace": true', '"trace": false'))
    assert cli(run).code == 0


@pytest.mark.parametrize("edit", [
    lambda d: d.update(tp=0),
    lambda d: d["sides"].pop("train"),
    lambda d: d["sides"]["rollout"]["units"].append(["x", None, 0]),
    lambda d: d["sides"]["rollout"]["units"].append(["x", 3, 1]),
    lambda d: d["sides"]["train"].update(families=[]),
], ids=["tp-0", "one-side", "zero-count", "context-not-a-string", "families-not-an-object"])
def test_invalid_trace_documents_fail(tmp_path: Path, cli, edit) -> None:
    doc = _trace(*_rr_units())
    edit(doc)
    r = cli(_traced_run(tmp_path / "run", doc))
    assert r.code == 1 and r.codes == ["KERNEL_TRACE_INVALID"], r.codes


def test_wrong_schema_is_unsupported(tmp_path: Path, cli) -> None:
    doc = _trace(*_rr_units())
    doc["schema"] = "rlk.kernel-trace.v9"
    assert cli(_traced_run(tmp_path / "run", doc)).codes == ["SCHEMA_UNSUPPORTED"]
