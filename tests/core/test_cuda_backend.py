"""``rlk.cuda`` on the CPU: the manifest -> launch-table step, each op's variant lookup over every size (against
a manifest generated from the AOT enumeration), the registry's ``same_bits_as`` routing, availability without
the extension, and the build variables. The launches themselves are checked on the GPU
(``tests/gpu/test_cuda_backend_gpu.py``)."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

from rlk_core import envs
from rlk_core.aot import specs as S
from rlk_core.backends import Backend, BackendRegistry
from rlk_core.ops import _cuda_calls as cl
from rlk_core.ops import _cuda_common as cc
from rlk_core.ops import linear as _linear_op  # noqa: F401  (registers the backends)

ROOT = Path(__file__).resolve().parents[2]
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _cuda_cases as K  # noqa: E402
import _cuda_fakes as F  # noqa: E402


@pytest.fixture(scope="module")
def fake_manifest(tmp_path_factory):
    pytest.importorskip("triton")
    folder = tmp_path_factory.mktemp("aot")
    return folder, F.write_manifest(folder, S.enumerate_specs())


@pytest.fixture
def on_fake_device(fake_manifest, monkeypatch):
    """Lookups as on an sm_90 device with 132 SMs, handles being the cubin names."""
    monkeypatch.setenv("RLK_AOT_DIR", str(fake_manifest[0]))
    cc._manifest.cache_clear()
    monkeypatch.setattr(cc, "_device_target", lambda device: "cuda:90")
    monkeypatch.setattr(cc, "handle", lambda device, entry: entry["cubin"])
    yield fake_manifest[1]
    cc._manifest.cache_clear()
    for op in ("rms_norm", "swiglu", "rope"):  # their caches now hold fake handles
        importlib.import_module(f"rlk_core.ops.{op}.cuda")._variant.cache_clear()


def test_param_codes_of_pointer_and_descriptor_kernels():
    rms = next(s for s in S.rms_norm_specs(torch.bfloat16) if s.layout == "aligned")
    tma = S.linear_launch_specs(torch.bfloat16, 64, 12288, 4096, True)[0]
    ptr_aligned = S.linear_launch_specs(torch.bfloat16, 64, 12288, 4096, False)[0]
    ptr_generic = S.linear_launch_specs(torch.bfloat16, 64, 12288, 4096, False, layout="generic")[0]
    pytest.importorskip("triton")
    assert cc.param_codes(F.entry(rms)) == ("pppiiiif", [])
    codes, descs = cc.param_codes(F.entry(tma))
    assert codes == "DDDpiii" and [d[:2] for d in descs] == [[64, 64], [128, 64], [64, 128]]
    assert cc.param_codes(F.entry(ptr_aligned))[0] == "ppppiiiiii"  # unit strides are constexprs
    assert cc.param_codes(F.entry(ptr_generic))[0] == "ppppiiiiiiiii"


@needs_triton
def test_param_codes_refuse_a_parameter_list_they_do_not_produce():
    entry = F.entry(next(iter(S.swiglu_specs(torch.bfloat16))))
    entry["params"] = entry["params"][:-1]  # one scratch pointer missing
    with pytest.raises(ValueError, match="scratch"):
        cc.param_codes(entry)
    entry = F.entry(S.linear_launch_specs(torch.bfloat16, 64, 12288, 4096, True)[0])
    entry["tensordesc_meta"][0] = None  # a descriptor not lowered to TMA
    with pytest.raises(ValueError, match="not a plain TMA descriptor"):
        cc.param_codes(entry)


@needs_triton
def test_index_leaves_out_variants_the_launcher_cannot_run():
    specs = list(S.swiglu_specs(torch.bfloat16))[:3]
    entries = [F.entry(s) for s in specs]
    entries[1]["global_scratch_size"] = 64
    entries[2]["num_ctas"] = 2
    idx = cc.index({"kernels": entries})
    assert [e["cubin"] for e in idx.values()] == [entries[0]["cubin"]]


def test_rms_norm_swiglu_rope_find_a_variant_for_every_size(on_fake_device):
    rms = importlib.import_module("rlk_core.ops.rms_norm.cuda")
    sw = importlib.import_module("rlk_core.ops.swiglu.cuda")
    rp = importlib.import_module("rlk_core.ops.rope.cuda")
    for f in (rms._variant, sw._variant, rp._variant):
        f.cache_clear()
    found: set[str] = set()
    for dt in S.DTYPES:
        for h in sorted({*range(1, 65537, 7), *(1 << i for i in range(17))}):
            for w in {dt, torch.float32}:
                for layout in ("aligned", "generic") if h % 16 == 0 else ("generic",):
                    hit = rms._variant(0, dt, w, h, layout)
                    assert hit is not None, (dt, w, h, layout)
                    found.add(hit[0])
        for inter in sorted({*range(1, 5000, 3), *(1 << i for i in range(13))}):
            for layout in ("aligned", "generic") if inter % 16 == 0 else ("generic",):
                hit = sw._variant(0, dt, inter, layout)
                assert hit is not None, (dt, inter, layout)
                found.add(hit[0])
        for d, r in S.ROPE_SHAPES:
            for nh in range(1, 300):
                for pos in (torch.int32, torch.int64):
                    for layout in ("aligned", "generic") if nh % 16 == 0 else ("generic",):
                        hit = rp._variant(0, dt, pos, nh, d, r, layout)
                        assert hit is not None, (dt, d, r, nh, layout)
                        found.add(hit[0])
    assert rp._variant(0, torch.bfloat16, torch.int64, 8, 96, 96, "generic") is None  # a pair not built
    names = {e["cubin"] for e in on_fake_device["kernels"] if e["op"] in ("rms_norm", "swiglu")}
    assert names <= found  # every built row-wise variant is reachable by some size


def test_linear_plans_every_launch_of_the_rule(on_fake_device, monkeypatch):
    lin = importlib.import_module("rlk_core.ops.linear.cuda")
    monkeypatch.setattr(lin, "_num_sms", lambda index: 132)
    lin._plan.cache_clear()
    lin._manifest_sms.cache_clear()
    try:
        for dt in S.DTYPES:
            for m in (1, 16, 64, 100, 129, 1000, 4096, 8192):
                for n, k in ((12288, 4096), (4096, 12288), (3072, 1024), (151936, 1024), (3072, 1040)):
                    for bias in (False, True):
                        for tma in (False, True):
                            plan = lin._plan(0, dt, m, n, k, bias, tma, "aligned")
                            assert not isinstance(plan, str), (dt, m, n, k, bias, tma, plan)
                            assert plan[0][0] == 0 and plan[-1][1] == m
                            assert all(p[1] == q[0] for p, q in zip(plan, plan[1:]))  # contiguous row parts
        monkeypatch.setattr(lin, "_num_sms", lambda index: 114)  # an H100 PCIe: NUM_PROGRAMS differs
        lin._plan.cache_clear()
        assert "132 SMs" in lin._plan(0, torch.bfloat16, 64, 12288, 4096, False, True, "aligned")
    finally:
        lin._plan.cache_clear()
        lin._manifest_sms.cache_clear()


def _registry(peer_ok: bool = True, cuda_ok: bool = True, cuda_takes: bool = True) -> BackendRegistry:
    reg = BackendRegistry()
    reg._plugins_loaded = True
    reg.register(Backend("ref", "rms_norm", lambda *a: "ref", devices=("cpu",), builtin=True))
    reg.register(
        Backend(
            "jit",
            "rms_norm",
            lambda *a: "jit",
            devices=("cpu",),
            priority=10,
            builtin=True,
            available=lambda: (peer_ok, "" if peer_ok else "no triton"),
        )
    )
    reg.register(
        Backend(
            "aot",
            "rms_norm",
            lambda *a: "aot",
            devices=("cpu",),
            priority=20,
            builtin=True,
            same_bits_as="jit",
            available=lambda: (cuda_ok, "" if cuda_ok else "no _C"),
            supports=lambda *a: (cuda_takes, "" if cuda_takes else "H not a multiple of 16"),
        )
    )
    return reg


def test_a_bitwise_peer_taking_a_declined_call_is_no_fallback():
    sel = _registry(cuda_takes=False).select("rms_norm", "cpu", (), strict=True)
    assert sel.backend.id == "jit" and sel.fallback_reason is None and "H not a multiple" in sel.route_reason
    sel = _registry(cuda_ok=False).select("rms_norm", "cpu", (), strict=True)
    assert sel.backend.id == "jit" and sel.fallback_reason is None
    assert _registry().select("rms_norm", "cpu", (), strict=True).backend.id == "aot"


def test_a_route_past_the_peer_is_still_a_fallback():
    # negative control: when the peer cannot run either, the reference runs and that is a fallback
    sel = _registry(peer_ok=False, cuda_ok=False).select("rms_norm", "cpu", (), strict=True)
    assert sel.backend.id == "ref" and "unavailable" in sel.fallback_reason
    sel = _registry(peer_ok=False, cuda_takes=False).select("rms_norm", "cpu", (), strict=True)
    assert sel.backend.id == "ref" and "H not a multiple" in sel.fallback_reason
    # and without same_bits_as a declined call is a fallback, as before
    reg = _registry(cuda_takes=False)
    reg._backends["rms_norm"]["aot"].same_bits_as = None
    assert reg.select("rms_norm", "cpu", (), strict=True).fallback_reason is not None


def test_a_peer_that_cannot_decide_declines_and_others_still_raise():
    """A backend with ``same_bits_as`` whose ``supports`` raises on some inputs (newer torch errors on a fake
    tensor's data pointer) declines them: its peer runs, the reason is the route's, no fallback; without
    ``same_bits_as`` the error propagates (negative control); real inputs reach it again afterwards."""
    def supports(x):
        if x.is_meta:
            raise RuntimeError("Cannot access data pointer of a meta tensor")
        return True, ""

    reg = _registry()
    reg._backends["rms_norm"]["aot"].supports = supports
    real, meta = torch.ones(4, 16), torch.empty(4, 16, device="meta")
    assert reg.select("rms_norm", "cpu", (real,), strict=True).backend.id == "aot"
    sel = reg.select("rms_norm", "cpu", (meta,), strict=True)
    assert sel.backend.id == "jit" and sel.fallback_reason is None
    assert "cannot decide on these inputs (RuntimeError" in sel.route_reason
    assert reg.select("rms_norm", "cpu", (real,), strict=True).backend.id == "aot"
    reg._backends["rms_norm"]["aot"].same_bits_as = None
    reg.refresh()
    with pytest.raises(RuntimeError, match="data pointer"):
        reg.select("rms_norm", "cpu", (meta,), strict=True)


def test_cuda_supports_declines_traced_inputs():
    """rlk.cuda's ``supports`` never decides on fake or meta tensors (torch.compile tracing: a fake tensor's
    ``data_ptr()`` is 0 or an error, shapes may be symbolic) — it declines before reading an address; a
    plain tensor is not taken for a traced one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlk_core.ops.linear import cuda as lc
    from rlk_core.ops.rms_norm import cuda as rc
    from rlk_core.ops.rope import cuda as pc
    from rlk_core.ops.swiglu import cuda as sc

    x, w, pos = torch.ones(4, 64, dtype=torch.bfloat16), torch.ones(32, 64, dtype=torch.bfloat16), torch.arange(4)
    with FakeTensorMode() as mode:
        fx, fw, fpos = mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(pos)
        for said in (lc.supports(fx, fw, None), rc.supports(fx, fw[0], 1e-6), sc.supports(fx),
                     pc.supports(fx.view(4, 1, 64), fpos, 1e6, 64)):
            assert said == cc.NO_STORAGE
    assert rc.supports(x.to("meta"), w[0].to("meta"), 1e-6) == cc.NO_STORAGE
    assert not cc.without_storage(x, w, None, torch.nn.Parameter(w))


def test_every_compiled_op_is_registered_beside_its_triton_backend():
    from rlk_core.backends import REGISTRY

    for op in ("linear", "rms_norm", "swiglu", "rope"):
        cuda, jit = REGISTRY.get(op, "rlk.cuda"), REGISTRY.get(op, "rlk.triton")
        assert cuda.contract_id == jit.contract_id and cuda.same_bits_as == "rlk.triton"
        assert cuda.priority > jit.priority and cuda.devices == ("cuda",)


def test_unavailable_without_a_gpu_or_without_the_extension(monkeypatch):
    ok, why = cc.available()
    if not torch.cuda.is_available():
        assert not ok and "no CUDA device" in why
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "rlk_core._C", None)  # import fails
    ok, why = cc.available()
    assert not ok and "rlk_core._C" in why


def test_build_variables_are_declared_and_setup_reads_no_other():
    names = {v.name for v in envs.ENV_VARS}
    read = set(re.findall(r"RLK_[A-Z_]+", (ROOT / "packages/rlk-core/setup.py").read_text()))
    assert read and read <= names, read - names
    assert envs.get("RLK_BUILD_TARGETS", {"RLK_BUILD_TARGETS": "cuda:90, cuda:100"}) == ("cuda:90", "cuda:100")
    assert envs.get("RLK_BUILD_JOBS", {"RLK_BUILD_JOBS": "16"}) == 16
    for var, bad in (("RLK_BUILD_JOBS", "0"), ("RLK_BUILD_TARGETS", "sm90"), ("RLK_BUILD_EXT", "yes")):
        with pytest.raises(Exception, match=var):
            envs.get(var, {var: bad})


def test_extension_source_passes_what_the_manifest_names():
    """The C++ launcher's parameter codes are the ones :func:`param_codes` produces."""
    src = (ROOT / "csrc" / "rlk_cuda.cpp").read_text()
    assert all(f"case '{c}'" in src for c in "pilfD")
    assert "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION" in src
    assert "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES" in src


# -- the attention and log-prob ops ----------------------------------------------------------------------
FAMILY_OPS = ("attention_varlen", "attention_varlen_backward", "attention_paged_prefill", "attention_decode",
              "kv_cache_write", "token_logprobs", "token_logprobs_backward", "logp_partials", "merge_logp_partials",
              "linear_logprobs", "linear_logprobs_backward", "linear_logp_partials")


def test_attention_and_logp_ops_and_their_companions_have_an_rlk_cuda_backend():
    """Every attention and log-prob op, and every companion of one (a forced backend runs the companions too),
    has rlk.cuda beside rlk.triton under the same contract id, preferred, declaring rlk.triton's bits."""
    import rlk_core.ops  # noqa: F401  (registers every op's backends)
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import COMPANION_OF

    for op in FAMILY_OPS:
        cuda, jit = REGISTRY.get(op, "rlk.cuda"), REGISTRY.get(op, "rlk.triton")
        assert cuda.contract_id == jit.contract_id and cuda.same_bits_as == "rlk.triton", op
        assert cuda.priority > jit.priority and cuda.devices == ("cuda",), op
    for op, main in COMPANION_OF.items():
        if main in FAMILY_OPS:
            assert op in FAMILY_OPS, op


def test_attention_and_logp_supports_decline_traced_inputs():
    """Fake and meta inputs (torch.compile tracing inside vLLM) are declined before any address is read: rlk.triton
    (the same bits) stands for rlk.cuda there."""
    import _cuda_cases as K
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlk_core.backends import REGISTRY

    seen: dict[str, tuple] = {}
    one = (torch.bfloat16,)
    families = {("attention_varlen", "attention_paged_prefill", "attention_decode"): K.attention_forward_cases,
                ("kv_cache_write",): K.kv_cache_write_cases, ("attention_varlen_backward",): K.attention_backward_cases,
                ("token_logprobs", "token_logprobs_backward", "logp_partials", "merge_logp_partials"): K.logprob_cases,
                ("linear_logprobs", "linear_logp_partials"): K.linear_logprob_cases,
                ("linear_logprobs_backward",): K.linear_logprobs_backward_cases}
    for ops, cases in families.items():  # the first call of each op (made outside the fake mode)
        for op, args, _ in cases("cpu", one):
            seen.setdefault(op, args)
            if all(o in seen for o in ops):
                break
    with FakeTensorMode() as mode:
        for op, args in seen.items():

            def fake(a):
                if isinstance(a, list):
                    return [fake(x) for x in a]
                return mode.from_tensor(a) if isinstance(a, torch.Tensor) else a

            said = REGISTRY.get(op, "rlk.cuda").supports(*[fake(a) for a in args])
            assert said == cc.NO_STORAGE, op
    assert set(seen) == set(FAMILY_OPS)
    for op in ("attention_decode", "kv_cache_write"):
        meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in seen[op]]
        assert REGISTRY.get(op, "rlk.cuda").supports(*meta) == cc.NO_STORAGE


def test_extension_record_kinds_are_the_python_side_s():
    """The argument kinds ``_C.run`` / ``_C.run_program`` decode (the C++ enum) are the numbers
    ``_cuda_common`` packs, and the buffer element types it accepts are the codes it packs (c10::ScalarType's;
    the GPU suite allocates fp32, bf16 and fp16 buffers through them)."""
    src = (ROOT / "csrc" / "rlk_cuda.cpp").read_text()
    enum = dict(re.findall(r"\b(k\w+) = (\d+),", src[src.index("enum Kind"):src.index("};", src.index("enum Kind"))]))
    want = {"kInput": cc.T, "kInput2d": cc.V, "kOutput": cc.O, "kScalar": cc.S, "kConst": cc.C, "kConstF": cc.F,
            "kInputRows": cc.R, "kBuffer": cc.B, "kInputAt": cc.TA, "kBufferAt": cc.BA}
    assert {k: int(v) for k, v in enum.items()} == want
    program = src[src.index("py::object run_program"):]
    assert set(cl.SCALAR_TYPES.values()) == {int(x) for x in re.findall(r"\btype == (\d+)", program)}
    assert 'm.def("run_program"' in src and "n_alloc >= 0" in src


# -- the backward kernels of the row-wise ops and linear's stored-layout GEMMs --------------------------------------
BACKWARD_OPS = ("rms_norm_backward", "swiglu_backward", "rope_backward")


def test_row_wise_backward_ops_have_an_rlk_cuda_backend():
    """rms_norm / swiglu / rope backward (companion ops: forced with their forward) have rlk.cuda beside rlk.triton
    under the same contract id, preferred, declaring rlk.triton's bits."""
    import rlk_core.ops  # noqa: F401
    from rlk_core.backends import REGISTRY
    from rlk_core.contracts import COMPANION_OF

    for op in BACKWARD_OPS:
        cuda, jit = REGISTRY.get(op, "rlk.cuda"), REGISTRY.get(op, "rlk.triton")
        assert cuda.contract_id == jit.contract_id and cuda.same_bits_as == "rlk.triton", op
        assert cuda.priority > jit.priority and cuda.devices == ("cuda",), op
        assert REGISTRY.get(COMPANION_OF[op], "rlk.cuda").id == "rlk.cuda"


@needs_triton
def test_backward_param_codes_and_index(fake_manifest):
    """The manifest -> launch-table step takes every backward variant's parameter list (none left out of the index):
    the TMA GEMM's three descriptors, the unit integers dropped, eps an fp32."""
    from rlk_core.aot import specs_backward as BW

    _, doc = fake_manifest
    entries = [e for e in doc["kernels"] if e["op"] in (*BACKWARD_OPS, "linear_backward")]
    assert len(entries) == len(S.enumerate_specs(BW.OPS))
    idx = cc.index({"kernels": entries})
    assert len(idx) == len(entries)
    codes = {e["kernel"]: set() for e in entries}
    for e in idx.values():
        codes[e["kernel"]].add(e["codes"])
    assert codes["_rms_norm_bwd_kernel"] == {"pppppiiiiiiiif"} and codes["_rms_norm_bwd_dw_kernel"] == {"ppii"}
    assert codes["_swiglu_bwd_kernel"] == {"pppiiiii"}
    assert codes["_rope_bwd_kernel"] == {"pppppiiiiiii", "pppppiiiiii"}  # NH passed, or the constant 1
    assert codes["_linear_bwd_tma_kernel"] == {"DDDpiiii"}
    assert codes["_linear_bwd_kernel"] == {"pppiiiiii", "pppiiii"}  # dx / dW (3 unit strides), db (N too)


BACKWARD_FAMILIES = {"rms_norm_backward": K.rms_norm_backward_cases, "swiglu_backward": K.swiglu_backward_cases,
                     "rope_backward": K.rope_backward_cases, "linear_backward": K.linear_backward_cases}


@pytest.fixture
def fake_device(fake_manifest, monkeypatch):
    """Lookups as on an sm_90 device with 132 SMs and TMA (rlk.cuda and rlk.triton alike); ``_C`` records."""
    lin, rms, sw, rp = (importlib.import_module(f"rlk_core.ops.{op}.cuda") for op in ("linear", "rms_norm", "swiglu",
                                                                                        "rope"))
    monkeypatch.setattr(lin, "_num_sms", lambda index: 132)
    monkeypatch.setattr(lin, "has_tma", lambda index: True)
    K.triton_as_on_sm90(monkeypatch)
    with F.fake_device(monkeypatch, fake_manifest[0], lin, rms, sw, rp) as (ext, entries):
        yield ext, entries


@needs_triton
@pytest.mark.parametrize("family", sorted(BACKWARD_FAMILIES))
def test_backward_launches_are_triton_s(fake_device, family):
    """Every call of the family's sweep (tests/core/_cuda_cases.py): ``supports`` takes exactly the calls meant to be
    served and declines the others with a reason; a served call launches what rlk.triton launches on an sm_90 device
    — the same kernels in order, each the variant the JIT compiles for rlk.triton's launch (by Triton's compile key),
    the same grids and arguments (pointers by where they point) — when its signature is first decided and again from
    the kept program or record, by one ``_C.run_program`` / ``_C.run``; the outputs have rlk.triton's shapes, dtypes
    and strides."""
    ext, entries = fake_device

    def via(op, args, used):
        return used == ({"run"} if op == "linear" else {"run_program"})

    served = F.check_served_like_triton(BACKWARD_FAMILIES[family]("cpu"), ext, entries, via, K.as_on_sm90)
    assert served > 20


@needs_triton
def test_linear_logprobs_backward_launches_are_triton_s(fake_device, monkeypatch):
    """``linear_logprobs_backward`` (tests/core/_cuda_cases.py's sweep, chunks of one leaf block): served calls make
    rlk.triton's launches on an sm_90 device — per chunk the gradient kernel over the recomputed logits, the dhidden
    product (fp32 output) and the dW product, each the variant the JIT compiles (by Triton's compile key) with the
    same grid and arguments — from Python, first when decided and again from the kept decision; the declined ones
    (no tokens, a hidden size not a multiple of 16) say why."""
    from rlk_core.ops.linear_logprobs import triton as llt

    ext, entries = fake_device
    monkeypatch.setattr(llt, "CHUNK_BYTES", K.linear_chunk_bytes())
    served = F.check_served_like_triton(K.linear_logprobs_backward_cases("cpu"), ext, entries,
                                        lambda op, args, used: used == {"launch"}, K.as_on_sm90)
    assert served == 12  # 3 dtypes x 2 shapes x 1 or 2 shards
    kernels = {e["variant"] for e in entries}  # every variant a launch has used
    assert any("Y_TMA=False" in v and "->fp32" in v for v in kernels), kernels  # the dhidden product's own variant


@needs_triton
def test_linear_logprobs_backward_declined_runs_on_triton_or_fails_when_forced(fake_device, clean_registry,
                                                                               monkeypatch):
    """A call rlk.cuda declines (hidden 40: the GEMMs' unaligned variant) goes to rlk.triton with rlk.cuda's reason
    (not a fallback); forced for linear_logprobs (RLK_BACKENDS forces the companions) it fails naming the reason."""
    from rlk_core.errors import RlkBackendError

    reg = clean_registry
    op, args, want = list(K.linear_logprobs_backward_cases("cpu", (torch.bfloat16,)))[-1]
    assert op == "linear_logprobs_backward" and not want
    said = reg.get(op, "rlk.cuda").supports(*args)
    assert not said[0] and "no AOT variant _linear_bwd_tma_kernel" in said[1], said
    for bid in ("rlk.cuda", "rlk.triton"):
        reg._available[(op, bid)] = (True, "")  # as on an H200 with the extension
    sel = reg.select(op, "cuda", args, strict=True)
    assert sel.backend.id == "rlk.triton" and sel.fallback_reason is None and said[1] in sel.route_reason
    monkeypatch.setenv("RLK_BACKENDS", "linear_logprobs=rlk.cuda")
    reg.refresh()
    reg._available[(op, "rlk.cuda")] = (True, "")
    with pytest.raises(RlkBackendError, match="no AOT variant"):
        reg.select(op, "cuda", args, strict=True)


@needs_triton
def test_backward_calls_that_copy_run_the_same_launches_from_python(fake_device):
    """A call whose launch reads a copy of an input (a transposed gradient: rows_view / _rows copy it) is served by
    the same launches made from Python (``_C.launch``), as rlk.triton makes them; the empty calls launch nothing."""
    from rlk_core.backends import REGISTRY

    ext, entries = fake_device
    x = torch.randn(16, 64).to(torch.bfloat16)
    g = torch.randn(64, 16).to(torch.bfloat16).t()  # rows of stride 1 along H... copied by both backends
    w = torch.randn(64).to(torch.bfloat16)
    xs = torch.randn(16, 64).to(torch.bfloat16)
    for op, args in (("rms_norm_backward", (g, x, w, 1e-6)), ("swiglu_backward", (g[:, :32], xs))):
        cuda, triton = REGISTRY.get(op, "rlk.cuda"), REGISTRY.get(op, "rlk.triton")
        assert cuda.supports(*args)[0], op
        with F.TritonLaunches() as cap:
            ref = triton.fn(*args)
        ext.clear()
        out = cuda.fn(*args)
        assert set(ext.via) == {"launch"}, ext.via
        roots = [(f"arg{i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        assert [k.__name__ for k, *_ in cap.launches] == [entries[h]["kernel"] for h, *_ in ext.calls]
        outs = ref if isinstance(ref, tuple) else (ref,)
        assert all(a.shape == b.shape for a, b in zip(outs, out if isinstance(out, tuple) else (out,)))
        assert len(roots) >= 2
    for op, args in (("rms_norm_backward", (x[:0], x[:0], w, 1e-6)), ("swiglu_backward", (xs[:0, :32], xs[:0]))):
        ext.clear()
        out = REGISTRY.get(op, "rlk.cuda").fn(*args)
        assert ext.calls == [] and (out[0] if isinstance(out, tuple) else out).shape[0] == 0


def test_backward_supports_decline_traced_inputs():
    """Fake and meta inputs are declined before any address is read (rlk.triton, the same bits, stands for it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlk_core.ops.linear import cuda as lc
    from rlk_core.ops.rms_norm import cuda as rc
    from rlk_core.ops.rope import cuda as pc
    from rlk_core.ops.swiglu import cuda as sc

    x, w = torch.ones(4, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fx, fw, fpos = mode.from_tensor(x), mode.from_tensor(w), mode.from_tensor(torch.arange(4))
        for said in (rc.supports_backward(fx, fx, fw, 1e-6), sc.supports_backward(fx[:, :32], fx),
                     pc.supports_backward(fx.view(4, 1, 64), fpos, 1e6, 64), lc.supports(fx.t(), fx.t(), None)):
            assert said == cc.NO_STORAGE


def test_the_gpu_sweeps_hand_backends_only_calls_the_public_ops_accept():
    """The GPU suite calls the backends directly, past the ops' checks: every attention / kv_cache_write call its
    sweeps make must be one the public op would take (a slot_mapping shorter than its tokens once made the sweep
    read past the tensor's end on the H200 — an illegal address, in rlk.triton's kernel as much as rlk.cuda's)."""
    from rlk_core.ops.attention import _validate as V

    checks = {"attention_varlen": V.check_varlen, "attention_paged_prefill": V.check_paged_prefill,
              "attention_decode": V.check_decode, "kv_cache_write": V.check_kv_cache_write}
    n = 0
    for sweep in (K.attention_forward_cases, K.kv_cache_write_cases):
        for op, args, served in sweep("cpu", (torch.bfloat16,)):
            if served:
                checks[op](*args)
                n += 1
    assert n > 100
