import importlib
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import rlk_core.ops as ops
from rlk_core.backends import REGISTRY, Backend
from rlk_core.errors import RlkBackendError, RlkPolicyError
from rlk_core.plan import RoutePlan
from rlk_core.readback import ReadbackRecorder
from rlk_core.testing import assert_bitwise_equal


def _reference_linear(x, w, b):
    return REGISTRY.get("linear", "rlk.reference").fn(x, w, b)


class GoodPlugin:
    """A third-party package that re-implements the contract correctly (here: by delegation)."""

    def rlk_register_backends(self, registry):
        registry.register(Backend("acme.good", "linear", _reference_linear, devices=("cpu",), priority=50,
                                  origin="acme-kernels"))


class BadPlugin:
    """Claims the GEMM contract with a BLAS matmul that is not batch-invariant on this CPU."""

    def rlk_register_backends(self, registry):
        registry.register(Backend("acme.bad", "linear", lambda x, w, b: F.linear(x, w, b), devices=("cpu",),
                                  priority=60, origin="acme-kernels"))


def test_builtin_reference_is_selected_on_cpu():
    sel = REGISTRY.select("linear", "cpu", (), strict=True)
    assert sel.backend.id == "rlk.reference" and sel.fallback_reason is None
    assert sel.backend.contract_id == "rlk.gemm.bi.v1"


def test_a_plugin_that_keeps_the_contract_is_qualified_and_preferred(clean_registry):
    clean_registry.add_plugin(GoodPlugin(), name="good")
    x, w = torch.randn(5, 64), torch.randn(7, 64)
    rec = ReadbackRecorder("local", "train", RoutePlan("R/R", "R/R", "R/R"))
    with rec.scope("ffn"):
        y = ops.linear(x, w)
    assert_bitwise_equal(y, _reference_linear(x, w, None))
    assert rec.to_dict()["modules"]["ffn"]["backend_id"] == "acme.good"
    ok, why = clean_registry.qualify(clean_registry.get("linear", "acme.good"), "cpu")
    assert ok, why


def test_a_plugin_that_breaks_batch_invariance_is_refused_in_strict_mode(clean_registry, monkeypatch):
    clean_registry.add_plugin(BadPlugin(), name="bad")
    x, w = torch.randn(5, 256), torch.randn(7, 256)
    with pytest.raises(RlkBackendError, match="acme.bad.*failed its invariance checks.*batch.invariance"):
        ops.linear(x, w)
    # audit: the bad backend is skipped, the reference runs, and the skip is recorded as a fallback
    rec = ReadbackRecorder("local", "train", RoutePlan("R/R", "R/R", "R/R"), mode="audit")
    with rec.scope("ffn"):
        ops.linear(x, w)
    ffn = rec.to_dict()["modules"]["ffn"]
    assert ffn["backend_id"] == "rlk.reference" and ffn["fallback"] is True
    assert "acme.bad: not qualified" in ffn["fallback_reason"]


def test_per_call_unsupported_inputs_fall_back_and_strict_mode_raises(clean_registry):
    reference = REGISTRY.get("swiglu", "rlk.reference").fn
    clean_registry.register(Backend("rlk.fast", "swiglu", reference, devices=("cpu",), priority=5,
                                    supports=lambda x: (x.dtype == torch.bfloat16, "bf16 only"), builtin=True))
    with pytest.raises(RlkPolicyError, match="rlk.fast: bf16 only"):
        ops.swiglu(torch.randn(2, 8))
    ops.swiglu(torch.randn(2, 8, dtype=torch.bfloat16))


def test_forced_backend_for_ab_tests(clean_registry, monkeypatch):
    clean_registry.add_plugin(GoodPlugin(), name="good")
    monkeypatch.setenv("RLK_BACKENDS", "linear=rlk.reference")
    REGISTRY.refresh()  # RLK_BACKENDS is read once per process
    assert REGISTRY.select("linear", "cpu", (), strict=True).backend.id == "rlk.reference"
    monkeypatch.setenv("RLK_BACKENDS", "linear=acme.missing")
    REGISTRY.refresh()
    with pytest.raises(RlkBackendError, match="no backend 'acme.missing'.*registered: "):
        ops.linear(torch.randn(2, 4), torch.randn(3, 4))


def test_entry_point_plugins_are_discovered_without_editing_rlk_core(clean_registry, tmp_path, monkeypatch):
    pkg = tmp_path / "acme_rlk_kernels.py"
    pkg.write_text(textwrap.dedent("""
        from rlk_core.backends import Backend, REGISTRY

        def rlk_register_backends(registry):
            ref = REGISTRY.get("rms_norm", "rlk.reference").fn
            registry.register(Backend("acme.rms", "rms_norm", ref, devices=("cpu",), priority=9,
                                      origin="acme-rlk-kernels"))
    """))
    dist = tmp_path / "acme_rlk_kernels-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-rlk-kernels\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[rlk.backends]\nacme = acme_rlk_kernels\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    loaded = clean_registry.load_plugins(force=True)
    try:
        assert "acme" in loaded
        assert clean_registry.candidates("rms_norm", "cpu")[0].id == "acme.rms"
        y = ops.rms_norm(torch.randn(3, 16), torch.ones(16))
        assert y.shape == (3, 16)
    finally:
        sys.modules.pop("acme_rlk_kernels", None)


def test_registration_errors_are_clear(clean_registry):
    with pytest.raises(RlkBackendError, match="unknown op 'conv'"):
        Backend("acme.x", "conv", lambda: None, devices=("cpu",))
    with pytest.raises(RlkBackendError, match="already registered"):
        clean_registry.register(Backend("rlk.reference", "linear", _reference_linear, devices=("cpu",)))
    bad_probe = Backend("acme.cuda", "linear", _reference_linear, devices=("cpu",), available=lambda: 1 / 0)
    assert clean_registry.is_available(bad_probe, "cpu")[1].startswith("probe raised ZeroDivisionError")
