"""``RLK_VALUE_CHECKS``: which range checks on index values run (each one syncs a GPU)."""

from __future__ import annotations

import pytest
import torch

from rlk_core.errors import RlkInputError
from rlk_core.ops import _checks as C
from rlk_core.ops import rope


@pytest.mark.parametrize("mode,cpu,meta", [("auto", True, False), ("always", True, False), ("never", False, False)])
def test_values_checked_modes(monkeypatch, mode, cpu, meta):
    monkeypatch.setenv("RLK_VALUE_CHECKS", mode)
    assert C.values_checked(torch.zeros(3, dtype=torch.int32), None) is cpu
    assert C.values_checked(torch.zeros(3, dtype=torch.int32, device="meta")) is meta


def test_auto_checks_cpu_values_and_never_skips_them(monkeypatch):
    x = torch.randn(2, 1, 8)
    bad = torch.tensor([0, -5])
    with pytest.raises(RlkInputError, match="positions has values in"):
        rope(x, bad, 10000.0)
    monkeypatch.setenv("RLK_VALUE_CHECKS", "never")
    C.in_range(bad, "rope", "positions", 0, 10)  # skipped: no error raised


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_values_checked_on_fake_and_meta_tensors_per_mode(monkeypatch, mode):
    """No values to read in a fake or meta tensor, whatever the mode; a plain CPU one per the mode."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setenv("RLK_VALUE_CHECKS", mode)
    plain = torch.zeros(3, dtype=torch.int32)
    with FakeTensorMode() as fake_mode:
        fake = fake_mode.from_tensor(plain)
    meta = plain.to("meta")
    assert C.values_checked(plain) is (mode != "never")
    assert C.values_checked(fake) is C.values_checked(meta) is C.values_checked(plain, fake) is False
    assert C.values_checked(None, plain, None) is C.values_checked(plain)


def test_never_and_off_cpu_answer_without_the_fake_tests(monkeypatch):
    """``never`` (and ``auto`` with a tensor off the CPU) is known from the mode and the device alone: the
    fake-tensor tests (Python calls on every op call) do not run."""
    def no_fake_test(t):
        raise AssertionError("the fake-tensor test ran")

    monkeypatch.setattr(C, "_is_fake", no_fake_test)
    monkeypatch.setenv("RLK_VALUE_CHECKS", "never")
    assert C.values_checked(torch.zeros(3, dtype=torch.int32)) is False
    C.in_range(torch.tensor([-1]), "rope", "positions", 0, 10)
    monkeypatch.setenv("RLK_VALUE_CHECKS", "auto")
    assert C.values_checked(torch.zeros(3, device="meta"), torch.zeros(3)) is False


def test_bad_mode_is_a_config_error(monkeypatch):
    from rlk_core.errors import RlkConfigError

    monkeypatch.setenv("RLK_VALUE_CHECKS", "sometimes")
    with pytest.raises(RlkConfigError, match="RLK_VALUE_CHECKS"):
        C.values_checked(torch.zeros(1))


def _outcome(fn, *args):
    try:
        fn(*args)
    except Exception as exc:  # compared by type and message
        return type(exc).__name__, str(exc)
    return None


def _cases():
    """Arguments of each op's checks: valid ones and every kind of invalid one the full checks name."""
    f, b, h = torch.randn(3, 8), torch.randn(3, 8).bfloat16(), torch.randn(2, 4, 8)
    i32, i64 = torch.arange(3, dtype=torch.int32), torch.arange(2)
    meta = torch.randn(3, 8, device="meta")
    w, wb, n = torch.randn(5, 8), torch.randn(5, 8).bfloat16(), torch.randn(5)
    yield "linear", [(f, w, None), (f, w, n), (h, w, None), (torch.randn(8), w, None), (b, wb, None),
                     (b, w, None), (f, wb, None), (f, w, n.bfloat16()), (f, w, torch.randn(4)),
                     (f, torch.randn(5, 7), None), (f, torch.randn(8), None), (torch.randn(()), w, None),
                     (i32, w, None), ("x", w, None),
                     (meta, w, None), (f, w, torch.randn(5, device="meta")), (f, w, "bias"), (f, "w", None)]
    yield "rms_norm", [(f, torch.randn(8), 1e-6), (b, torch.randn(8), 1e-6), (h, torch.randn(8).bfloat16(), 1e-6),
                       (f, torch.randn(7), 1e-6), (f, torch.randn(8), 0.0), (f, torch.randn(8), float("nan")),
                       (torch.randn(3, 0), torch.randn(0), 1e-6), (torch.randn(()), torch.randn(1), 1e-6),
                       (f, torch.randn(8, device="meta"), 1e-6), (i64, torch.randn(2), 1e-6), (f, i32, 1e-6),
                       ("x", torch.randn(8), 1e-6)]
    yield "swiglu", [(f,), (b,), (h,), (torch.randn(3, 7),), (torch.randn(3, 0),), (torch.randn(()),), (i32,),
                     ("x",), (torch.randn(8),)]
    x = torch.randn(2, 4, 8)
    yield "rope", [(x, i64, 1e4, 8), (x, i64.int(), 1e4, 4), (x, i64, 1e4, 6), (x, i64, 1e4, 10), (x, i64, 1e4, 0),
                   (x, i64, 1e4, 3), (x, i64, 0.0, 8), (x, i32, 1e4, 8), (x, torch.arange(2.0), 1e4, 8),
                   (x, i64.view(2, 1), 1e4, 8), (torch.randn(2, 8), i64, 1e4, 8), (x, i64, -1.0, 8),
                   (x, torch.tensor([0, -1]), 1e4, 8), (x, torch.tensor([0, 1 << 24]), 1e4, 8),
                   (x, i64.to("meta"), 1e4, 8), (x.bfloat16(), i64, 1e4, 8), (i64, i64, 1e4, 8)]


def test_each_ops_quick_checks_agree_with_its_full_checks():
    """An op's ``_check`` passes a call on a few attribute tests or runs ``_check_full``: for valid and invalid
    calls alike the outcome (pass, or the exception and its message) is the full checks' own."""
    import importlib

    seen_pass = seen_error = 0
    for op, cases in _cases():
        mod = importlib.import_module(f"rlk_core.ops.{op}")
        for args in cases:
            full = _outcome(mod._check_full, *args)
            assert _outcome(mod._check, *args) == full, (op, args)
            seen_pass += full is None
            seen_error += full is not None
    assert seen_pass >= 10 and seen_error >= 30
