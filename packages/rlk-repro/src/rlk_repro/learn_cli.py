"""``rlk-repro synthetic-math`` and ``rlk-repro warmstart``: the synthetic learning run's data, model and warm start,
into a workspace (issue 37, "a model that learns"; docs/prepare.md, "A model that learns").

``synthetic-math --workspace W`` writes the three splits (:mod:`rlk_repro.synthmath`) into ``W/data/``, trains the
tokenizer and writes a random checkpoint (:mod:`rlk_repro.synthmodel`) into ``W/models/<shape>-init/``, and records
in ``W/workspace.json`` the ``rl`` split as the workspace's data and the checkpoint as its model. ``warmstart
--workspace W`` trains that model on the ``sft`` split (:mod:`rlk_repro.warmstart`), writes ``W/models/<shape>-warm/``
and makes it the workspace's model, so that ``rlk-repro run --workspace W --apply-chat-template ...`` runs GRPO from
the warm start on the ``rl`` split.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError


def _families(text: str) -> tuple[str, ...]:
    from rlk_repro.synthmath import FAMILIES

    names = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [n for n in names if n not in FAMILIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{(bad or [''])[0]!r} is not one of {', '.join(FAMILIES)}")
    return names


def add_parser(sub) -> None:
    from rlk_repro._args import positive_int
    from rlk_repro.synthmodel import SHAPES

    sm = sub.add_parser("synthetic-math", help="a synthetic math set (DAPO's prompt/label layout, purpose synthetic), "
                        "a tokenizer and a random Qwen3-shaped checkpoint, into a workspace",
                        description="Generate the synthetic arithmetic / algebra splits sft, rl and heldout (VIME "
                        "JSONL with manifests, purpose synthetic: never a DAPO claim), train a BPE tokenizer on them "
                        "and write a randomly initialised Qwen3-shaped model directory; the rl split becomes the "
                        "workspace's data, the checkpoint its model.")
    sm.add_argument("--workspace", required=True, metavar="W", help="the workspace directory (created if needed)")
    sm.add_argument("--sft-rows", type=positive_int, default=50_000, help="rows of the warm start's split (50000)")
    sm.add_argument("--rl-rows", type=positive_int, default=5_000, help="rows of GRPO's prompt split (5000)")
    sm.add_argument("--heldout-rows", type=positive_int, default=512, help="rows of the held-out split (512)")
    sm.add_argument("--families", type=_families, default=None,
                    help="comma-separated problem families (default: all of rlk_repro.synthmath.FAMILIES)")
    sm.add_argument("--seed", type=int, default=1234, help="the generator's and the initialisation's seed (1234)")
    sm.add_argument("--shape", choices=sorted(SHAPES), default="synth-190m", help="model shape (synth-190m)")
    sm.add_argument("--vocab-size", type=positive_int, default=2048, help="the tokenizer's size at most (2048)")
    sm.add_argument("--tokenizer-rows", type=positive_int, default=20_000,
                    help="sft rows the tokenizer is trained on (20000)")
    sm.add_argument("--debug", action="store_true", help="show tracebacks")
    sm.set_defaults(main=main_synthetic)

    ws = sub.add_parser("warmstart", help="supervised warm start (teacher-forced cross-entropy) of the workspace's "
                        "model on the synthetic sft split, held-out accuracy before / after",
                        description="Train the workspace's model on its synthetic sft split (prompt -> worked "
                        "solution, AdamW, warm-up + cosine), report the held-out loss and the deepscaler-rule "
                        "accuracy of greedy answers before and after, write a new model directory and make it the "
                        "workspace's model.")
    ws.add_argument("--workspace", required=True, metavar="W", help="a workspace made by `rlk-repro synthetic-math`")
    ws.add_argument("--model-path", type=Path, default=None, help="the model to start from (default: the workspace's)")
    ws.add_argument("--output-name", default=None, help="the new directory under W/models (default: <shape>-warm)")
    ws.add_argument("--steps", type=positive_int, default=300, help="optimizer steps (300)")
    ws.add_argument("--batch-size", type=positive_int, default=64, help="rows per step (64)")
    ws.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (5e-4)")
    ws.add_argument("--warmup", type=int, default=30, help="linear warm-up steps (30)")
    ws.add_argument("--seed", type=int, default=1234, help="the batches' seed (1234)")
    ws.add_argument("--device", default=None, help="cpu or cuda[:N] (default: cuda when available)")
    ws.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                    help="compute dtype (default: float32 on cpu, bfloat16 on cuda)")
    ws.add_argument("--eval-rows", type=positive_int, default=256, help="held-out rows evaluated (256)")
    ws.add_argument("--eval-max-new-tokens", type=positive_int, default=48, help="greedy answer length limit (48)")
    ws.add_argument("--eval-every", type=int, default=0, help="also evaluate every N steps (0: before and after)")
    ws.add_argument("--log-every", type=positive_int, default=25, help="print the loss every N steps (25)")
    ws.add_argument("--debug", action="store_true", help="show tracebacks")
    ws.set_defaults(main=main_warmstart)


def _workspace_doc(w: Path) -> dict[str, Any]:
    from rlk_repro import lifecycle
    from rlk_repro import workspace as ws

    if ws.paths(w)["doc"].is_file():
        return ws.read(w)
    return {"schema": ws.WORKSPACE_SCHEMA, "created_at": lifecycle.utc_now(), "layout": dict(ws.LAYOUT)}


def _record_model(doc: dict[str, Any], w: Path, dest: Path, record: dict[str, Any]) -> None:
    doc["model"] = {"path": str(dest.relative_to(w)), "weights_sha256": record["weights_sha256"],
                    "tensors": record["tensors"], "round_trip": record["round_trip"], "kind": record["kind"]}


def main_synthetic(a: argparse.Namespace) -> int:
    from rlk_repro import lifecycle, runs, synthmath, synthmodel
    from rlk_repro import workspace as ws

    w = Path(a.workspace)
    lifecycle.refuse_inside_run_dir(w, "--workspace")
    doc = _workspace_doc(w)
    recorded = (doc.get("data") or {}).get("output")
    if recorded and not Path(recorded).name.startswith("synthetic-math."):
        raise RlkConfigError(f"{w} records prepared data {recorded}; the synthetic set goes into a workspace of its "
                             "own (it would replace that record)")
    p = ws.paths(w)
    for key in ws.LAYOUT:
        p[key].mkdir(parents=True, exist_ok=True)
    counts = {"sft": a.sft_rows, "rl": a.rl_rows, "heldout": a.heldout_rows}
    manifests = synthmath.write(p["data"], counts, a.seed, a.families)
    for split, man in manifests.items():
        print(f"data: {p['data'] / man['output']['name']}: {man['output']['rows']} problems ({split}), "
              f"{man['output']['sha256']}, purpose {man['purpose']}")
    rows = synthmath.read_rows(p["data"] / synthmath.file_name("sft"))[:a.tokenizer_rows]
    dest = p["models"] / f"{a.shape}-init"
    record = synthmodel.write_model(dest, rows, a.shape, a.seed, a.vocab_size)
    record["path"] = str(dest.relative_to(w))
    runs.write_json_atomic(dest / synthmodel.CHECKPOINT_RECORD, record)
    print(f"model: {dest}: {record['parameters'] / 1e6:.1f}M parameters, vocabulary "
          f"{record['model_config']['vocab_size']} (tokenizer {record['tokenizer_vocab']}), weights "
          f"{record['weights_sha256']}")
    rl = p["data"] / synthmath.file_name("rl")
    doc["data"] = {"output": str(rl.relative_to(w)), "manifest": str(ws.manifest_path(rl).relative_to(w)),
                   "sha256": manifests["rl"]["output"]["sha256"], "rows": manifests["rl"]["output"]["rows"],
                   "purpose": manifests["rl"]["purpose"]}
    doc["synthetic"] = {"generator": synthmath.GENERATOR, "seed": a.seed,
                        "splits": {s: str((p["data"] / synthmath.file_name(s)).relative_to(w)) for s in counts}}
    _record_model(doc, w, dest, record)
    doc["updated_at"] = lifecycle.utc_now()
    runs.write_json_atomic(p["doc"], doc)
    print(f"workspace: {w}/workspace.json (data: the rl split; model: {record['path']})")
    return 0


def main_warmstart(a: argparse.Namespace) -> int:
    import torch

    from rlk_repro import lifecycle, runs, synthmath
    from rlk_repro import workspace as ws
    from rlk_repro.warmstart import WarmStartConfig, warm_start

    w = Path(a.workspace)
    doc = ws.read(w)
    splits = (doc.get("synthetic") or {}).get("splits")
    if not splits:
        raise RlkConfigError(f"{w}: no synthetic splits recorded; run `rlk-repro synthetic-math --workspace {w}` first")
    model = a.model_path or ws.model_path(w)
    if model is None:
        raise RlkConfigError(f"{w}: no model recorded; give --model-path")
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    name = a.output_name or (Path(model).name.removesuffix("-init") + "-warm")
    dest = ws.paths(w)["models"] / name
    cfg = WarmStartConfig(steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup=a.warmup, seed=a.seed,
                          device=device, dtype=dtype, eval_rows=a.eval_rows,
                          eval_max_new_tokens=a.eval_max_new_tokens, eval_every=a.eval_every, log_every=a.log_every)
    result = warm_start(Path(model), w / splits["sft"], w / splits["heldout"], dest, cfg,
                        log=lambda line: print(line, flush=True))
    record = json.loads((dest / "rlk-checkpoint.json").read_text(encoding="utf-8"))
    record["path"] = str(dest.relative_to(w))
    runs.write_json_atomic(dest / "rlk-checkpoint.json", record)
    _record_model(doc, w, dest, record)
    doc["updated_at"] = lifecycle.utc_now()
    runs.write_json_atomic(ws.paths(w)["doc"], doc)
    b, f = result["before"], result["after"]
    print(f"warm start: {dest}: held-out loss {b['heldout_loss']:.4f} -> {f['heldout_loss']:.4f}, accuracy "
          f"{b['accuracy']:.3f} -> {f['accuracy']:.3f} (deepscaler rule, greedy, {f['rows']} held-out problems), "
          f"readable {b['readable']:.3f} -> {f['readable']:.3f}; {result['train_seconds']:.0f} s")
    print(f"workspace: {w}/workspace.json (model: {record['path']}; data stays the {synthmath.file_name('rl')} split)")
    return 0
