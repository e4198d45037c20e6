"""``rlk-repro attribute`` and ``rlk-repro abtest``: their options and commands (:mod:`rlk_repro.attribute`,
:mod:`rlk_repro.abtest`).

Two subcommands, not one with a mode: ``attribute`` reads a run directory and needs its engine; ``abtest`` needs
no run at all (generated tensors, or the ``ab-tensors.safetensors`` an attribution captured) and is the gate a
kernel author runs on a new backend. ``attribute`` runs the same harness as its probe 7.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _frameworks(text: str) -> tuple[str, ...]:
    from rlk_repro.abtest import FRAMEWORK_IMPLS

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in FRAMEWORK_IMPLS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(FRAMEWORK_IMPLS)}")
    return names


def add_parser(sub) -> None:
    at = sub.add_parser("attribute", help="localise train/rollout drift of a run to the first operator where the "
                        "bits part (probes 1-7 and a per-layer comparison)",
                        description="Replay one round of a run directory on both sides with an operator tap and "
                        "write an attribution report: the seeds' probes in order (sample identity, model state, "
                        "logits, log-sum-exp, TP reduce, kept sets, native vs rlk on fixed tokens), then the first "
                        "layer and operator where the bits part; no operator is blamed while probe 0, 1, 2 or 6 "
                        "fails. docs/attribution.md.")
    at.add_argument("run_dir", metavar="RUN_DIR", type=Path, nargs="?", default=None,
                    help="a run directory (the local engine; a TP-1 frameworks run is replayed on its GPU)")
    at.add_argument("--dumps", nargs=2, type=Path, default=None, metavar=("TRAIN", "ROLLOUT"),
                    help="instead of RUN_DIR: compare two rlk.attribution-dump.v1 files an engine wrote itself "
                    "(the per-layer walk only; the first difference is not attributed)")
    at.add_argument("--round", type=int, default=0, help="the round to replay (default 0; others need their "
                    "starting weights: a static-weights run, or the round a saved round state names)")
    at.add_argument("--sequences", type=_ints, default=None, metavar="I,J,...",
                    help="train-data rows to compare (default: the first --max-sequences)")
    at.add_argument("--max-sequences", type=int, default=4, metavar="N",
                    help="how many sequences of the round to compare without --sequences (default 4)")
    at.add_argument("--inject", default=None, metavar="SIDE:LAYER:POINT",
                    help="positive control: perturb one point on one side by one ulp (e.g. train:1:ffn.swiglu); "
                    "the report must name it")
    at.add_argument("--with", dest="frameworks", type=_frameworks, default=(), metavar="vllm,megatron",
                    help="also run these native implementations in probe 7")
    at.add_argument("--repeats", type=int, default=3, help="timing repeats of probe 7 (default 3)")
    at.add_argument("--output", type=Path, default=None,
                    help="where to write (default <RUN_DIR>.attribution-r<round> beside the run; must not exist)")
    at.add_argument("--json", action="store_true", help="print the report's JSON instead of its markdown")
    at.add_argument("--debug", action="store_true", help="show tracebacks")
    at.set_defaults(main=main_attribute)

    ab = sub.add_parser("abtest", help="operator A/B harness: fixed log-prob tensors through native, rlk and every "
                        "registered backend; one table", description="Selected log-prob error against fp64, "
                        "bitwise agreement between implementations, backward parity, throughput and memory, on "
                        "fixed tensors: generated, or captured by `rlk-repro attribute` (ab-tensors.safetensors). "
                        "docs/attribution.md#the-operator-ab-harness.")
    src = ab.add_mutually_exclusive_group()
    src.add_argument("--tensors", type=Path, default=None, metavar="FILE", help="an rlk.ab-tensors.v1 file")
    src.add_argument("--shape", type=_ints, default=[64, 128, 1000], metavar="T,H,V",
                     help="generated tensors of this shape (default 64,128,1000)")
    ab.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="bfloat16",
                    help="the generated hidden states' and weight's dtype (default bfloat16)")
    ab.add_argument("--seed", type=int, default=0, help="seed of the generated tensors and of the backward's "
                    "upstream gradient (default 0)")
    ab.add_argument("--temperature", type=float, default=1.0, help="generated: the temperature (default 1)")
    ab.add_argument("--top-p", type=float, default=1.0, help="generated: top-p of the kept set (default 1: off)")
    ab.add_argument("--top-k", type=int, default=0, help="generated: top-k of the kept set (default 0: off)")
    ab.add_argument("--device", default="cpu", help="the torch device to run on (default cpu)")
    ab.add_argument("--with", dest="frameworks", type=_frameworks, default=(), metavar="vllm,megatron",
                    help="also run vLLM's and/or megatron-core's native path (where they import)")
    ab.add_argument("--repeats", type=int, default=5, help="timing repeats per implementation (default 5)")
    ab.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's setting)")
    ab.add_argument("--output", type=Path, default=None, help="write ab-report.json and ab-report.md here")
    ab.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    ab.add_argument("--debug", action="store_true", help="show tracebacks")
    ab.set_defaults(main=main_abtest)


def main_attribute(a: argparse.Namespace) -> int:
    from rlk_core.errors import RlkConfigError
    from rlk_repro import attribute as at
    from rlk_repro.attribute_local import Injection

    if (a.run_dir is None) == (a.dumps is None):
        raise RlkConfigError("give RUN_DIR or --dumps TRAIN ROLLOUT (one of them)")
    if a.dumps is not None:
        doc = at._jsonable(at.attribute_dumps(*a.dumps))
        if a.output is not None:
            a.output.mkdir(parents=True, exist_ok=False)
            from rlk_validate import evidence

            evidence.write_json_atomic(a.output / "attribution.json", doc)
        print(json.dumps(doc, indent=1) if a.json else f"{doc['verdict']['kind']}: {doc['verdict']['summary']}")
        return 0
    out = a.output or at.default_output(a.run_dir, a.round)
    at.check_output(out, a.run_dir)
    injection = Injection.parse(a.inject) if a.inject else None
    doc, replay, inputs = at.attribute(a.run_dir, a.round, a.sequences, injection, a.frameworks, a.repeats,
                                       a.max_sequences)
    at.write(doc, replay, inputs, out)
    print(json.dumps(at._jsonable(doc), indent=1) if a.json else at.markdown(doc))
    print(f"attribution: {out}/attribution.json", file=sys.stderr)
    return 0


def main_abtest(a: argparse.Namespace) -> int:
    from rlk_core.errors import RlkConfigError
    from rlk_repro import abtest
    from rlk_validate import evidence

    if a.tensors is not None:
        try:
            inputs = abtest.load_inputs(a.tensors)
        except (OSError, ValueError) as exc:
            raise RlkConfigError(f"--tensors {a.tensors}: {exc}") from None
    else:
        if len(a.shape) != 3 or min(a.shape) < 1:
            raise RlkConfigError(f"--shape needs three positive integers T,H,V, got {a.shape}")
        t, h, v = a.shape
        inputs = abtest.generate_inputs(t, h, v, a.dtype, a.seed, a.temperature, a.top_k, a.top_p)
    if a.threads is not None:
        if a.threads < 1:
            raise RlkConfigError(f"--threads must be >= 1, got {a.threads}")
        import torch

        torch.set_num_threads(a.threads)
    report = abtest.run_ab(inputs, frameworks=a.frameworks, repeats=a.repeats, device=a.device, seed=a.seed)
    if a.output is not None:
        a.output.mkdir(parents=True, exist_ok=True)
        evidence.write_json_atomic(a.output / "ab-report.json", _finite(report))
        (a.output / "ab-report.md").write_text(abtest.markdown(report), encoding="utf-8")
    print(json.dumps(_finite(report), indent=1) if a.json else abtest.markdown(report))
    return 0


def _finite(x):
    from rlk_repro.attribute import _jsonable

    return _jsonable(x)
