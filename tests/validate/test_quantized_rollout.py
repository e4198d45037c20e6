"""A quantized rollout (manifest ``rollout_quantization``, issue 38's FP8 rung) is a mismatch knob: with bitwise
equality required the run fails even when its log-probs happen to agree; otherwise the finding is information
only. The negative control: the same run without the field passes ``--require-bitwise``."""

from __future__ import annotations

from pathlib import Path

from validate_builders import PP, build_run, mutate_json

from rlk_validate import Options, validate_run


def test_fp8_rollout_never_passes_require_bitwise(tmp_path: Path) -> None:
    plain = build_run(tmp_path / "plain", PP, engine="frameworks", drift=0.0)  # agreeing bits, no quantization
    assert validate_run(plain, Options(require_bitwise=True)).verdict == "passed"
    for where in ("top", "config"):
        run = build_run(tmp_path / where, PP, engine="frameworks", drift=0.0)
        mutate_json(run / "manifest.json", (lambda m: m.update(rollout_quantization="fp8")) if where == "top"
                    else (lambda m: m.setdefault("config", {}).update(rollout_quantization="fp8")))
        strict = validate_run(run, Options(require_bitwise=True))
        assert strict.verdict == "failed", strict.findings
        assert [(f.code, f.severity) for f in strict.findings if f.code == "QUANTIZED_ROLLOUT"] == [
            ("QUANTIZED_ROLLOUT", "error")]
        loose = validate_run(run, Options())
        assert loose.verdict == "passed" and {f.code: f.severity for f in loose.findings}["QUANTIZED_ROLLOUT"] == "info"
    none = build_run(tmp_path / "none", PP, engine="frameworks", drift=0.0)
    mutate_json(none / "manifest.json", lambda m: m.update(rollout_quantization="none"))
    assert validate_run(none, Options(require_bitwise=True)).verdict == "passed"
