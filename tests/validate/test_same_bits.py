"""A route may mix backends that launch the same binaries (``rlk.cuda`` runs ``rlk.triton``'s kernels
compiled ahead of time): the validator reads them as one; any other pair still diverges."""

from __future__ import annotations

from validate_builders import mutate_json
from validate_mutations import _module_and_ops, _rb

from rlk_validate import evidence


def _sides(run, train: str, rollout: str) -> None:
    mutate_json(_rb(run, "training"), _module_and_ops("ffn", backend_id=train))
    mutate_json(_rb(run, "rollout"), _module_and_ops("ffn", backend_id=rollout))


def test_cuda_and_triton_are_one_route(good_run, cli):
    _sides(good_run, "rlk.cuda", "rlk.triton")
    res = cli(good_run)
    assert res.doc["verdict"] == "passed", res.out
    assert not res.findings("BACKEND_DIVERGES")


def test_other_backends_still_diverge(good_run, cli):
    _sides(good_run, "rlk.cuda", "rlk.reference")  # negative control: different kernels, different bits
    res = cli(good_run)
    assert res.doc["verdict"] == "failed"
    assert any("rlk.reference" in f["message"] for f in res.findings("BACKEND_DIVERGES"))


def test_the_table_is_what_rlk_core_declares():
    assert evidence.bits_of("rlk.cuda") == "rlk.triton"
    assert evidence.bits_of("rlk.triton") == "rlk.triton"
    assert evidence.bits_of("rlk.reference") == "rlk.reference"
