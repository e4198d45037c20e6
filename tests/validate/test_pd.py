"""A run's Prefill/Decode layout against its readbacks (rlk_validate.pd, issue 37): the manifest's ``pd`` section as
``rlk-repro plan --pd`` writes it, with the readbacks of both engines listed; both must be there, have run, and
carry the run's contract digest. Torch-free."""

from __future__ import annotations

from pathlib import Path

from validate_builders import RR, build_run, mutate_json, read_json, readback, write_json

from rlk_validate.digest import DIGEST_SCHEMA, digest_of
from rlk_validate.evidence import PD_LAYOUT_SCHEMA

PREFILL, DECODE = "readbacks/vllm-rollout-3000.json", "readbacks/vllm-rollout-3001.json"
TRAIN = "readbacks/megatron-training-2000.json"


def _document(plan: dict[str, str], temperature: float = 1.0) -> dict:
    return {"schema": DIGEST_SCHEMA, "plan": dict(plan), "device_type": "cuda", "tp_invariant_leaves": 0,
            "modules": {m: {"case": c, "contracts": [f"rlk.{m}.v1"], "backends": ["rlk.reference"],
                            "builds": {f"rlk.{m}.v1": "sha256:" + "cd" * 32}} for m, c in plan.items()},
            "sampling": {"temperature": temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}}


def _record(document: dict) -> dict:
    d = digest_of(document)
    return {"digest": d, "document": document, "detail": {"side": "rollout"}, "checks": [{"at": "start", "digest": d}]}


def _layout(connector_lossless: bool = True) -> dict:
    def engine(kv_role: str, rb: str) -> dict:
        return {"kv_role": kv_role, "engine": "vllm", "tp": 1, "gpus": [0], "routes": {m: "R" for m in RR},
                "readbacks": [rb]}

    return {"schema": PD_LAYOUT_SCHEMA, "prefill": engine("kv_producer", PREFILL),
            "decode": engine("kv_consumer", DECODE),
            "connector": {"name": "rlk-shared-storage", "class": "RlkSharedStorageConnector",
                          "lossless_for_rlk_layout": connector_lossless},
            "placement": {"kind": "colocated", "gpus": [0]}}


def _run(tmp_path: Path) -> Path:
    """A valid R/R frameworks run with a P/D layout: the trainer, the prefill engine (pid 3000) and the decode
    engine (pid 3001), each readback carrying the run's digest."""
    run = build_run(tmp_path / "run", RR, engine="frameworks")
    run_id = read_json(run / "manifest.json")["run_id"]
    write_json(run / DECODE, readback("vllm", "rollout", 3001, RR, run_id))
    rec = _record(_document(RR))
    for rel in (TRAIN, PREFILL, DECODE):
        mutate_json(run / rel, lambda d: d.update(contract_digest=rec))
    mutate_json(run / "manifest.json", lambda m: m.update(pd=_layout(), contract_digest=rec["digest"]))
    return run


def _pd(r) -> list[str]:
    return [c for c in r.codes if c.startswith("PD_")]


def test_a_pd_run_whose_engines_carry_the_run_s_digest_passes(tmp_path: Path, cli) -> None:
    r = cli(_run(tmp_path), "--require-bitwise")
    assert r.code == 0 and not _pd(r), r.codes


def test_engines_with_different_digests_fail(tmp_path: Path, cli) -> None:
    run = _run(tmp_path)
    mutate_json(run / DECODE, lambda d: d.update(contract_digest=_record(_document(RR, temperature=0.7))))
    r = cli(run)
    assert r.code == 1 and _pd(r) == ["PD_DIGEST_DIFFERS"], r.codes


def test_a_missing_or_silent_or_undigested_engine_readback_fails(tmp_path: Path, cli) -> None:
    run = _run(tmp_path)
    (run / DECODE).unlink()
    r = cli(run)
    assert r.code != 0 and _pd(r) == ["PD_READBACK_MISSING"], r.codes
    run = _run(tmp_path / "b")
    mutate_json(run / PREFILL, lambda d: [r.update(call_count=0) for m in d["modules"].values()
                                          for r in (m, *m["ops"].values())])
    assert "PD_ENGINE_SILENT" in _pd(cli(run))
    run = _run(tmp_path / "c")
    mutate_json(run / DECODE, lambda d: d.pop("contract_digest"))
    assert "PD_DIGEST_MISSING" in _pd(cli(run))


def test_different_routes_or_a_lossy_connector_fail_an_exact_run(tmp_path: Path, cli) -> None:
    run = _run(tmp_path)
    mutate_json(run / "manifest.json", lambda m: m["pd"]["prefill"]["routes"].update(attention="P"))
    r = cli(run)
    assert r.code == 1 and _pd(r) == ["PD_ROUTES_DIFFER"], r.codes
    run = _run(tmp_path / "b")
    mutate_json(run / "manifest.json", lambda m: m["pd"].update(connector={"class": "ExampleConnector",
                                                                          "lossless_for_rlk_layout": False}))
    r = cli(run)
    assert r.code == 1 and _pd(r) == ["PD_CONNECTOR_LOSSY"], r.codes


def test_a_malformed_layout_fails(tmp_path: Path, cli) -> None:
    run = _run(tmp_path)
    mutate_json(run / "manifest.json", lambda m: m["pd"]["decode"].update(readbacks=[PREFILL]))
    assert "PD_LAYOUT_INVALID" in _pd(cli(run))
    run = _run(tmp_path / "b")
    mutate_json(run / "manifest.json", lambda m: m["pd"]["decode"].update(kv_role="kv_both"))
    assert "PD_LAYOUT_INVALID" in _pd(cli(run))
    run = _run(tmp_path / "c")
    mutate_json(run / "manifest.json", lambda m: m["pd"]["prefill"].update(readbacks=[TRAIN]))
    assert "PD_LAYOUT_INVALID" in _pd(cli(run))


def test_a_run_without_a_layout_is_not_checked_here(tmp_path: Path, cli) -> None:
    r = cli(build_run(tmp_path / "run", RR, engine="frameworks"))
    assert r.code == 0 and not _pd(r), r.codes
