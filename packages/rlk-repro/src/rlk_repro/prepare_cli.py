"""``rlk-repro prepare``'s options and command (the data and checkpoint preparation of :mod:`rlk_repro.prepare`)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub) -> None:
    pr = sub.add_parser("prepare", help="DAPO-Math-17k Parquet -> VIME JSONL (+ manifest) and a checkpoint, into a "
                        "workspace", description="Prepare a workspace: DAPO-Math-17k's Parquet file converted to "
                        "VIME prompt/label JSONL (deduplicated by extra_info.index) with its sibling manifest, "
                        "and/or a Hugging Face Qwen3 checkpoint converted with a round-trip check; the layout is "
                        "recorded in W/workspace.json, which `doctor --workspace W` checks.")
    pr.add_argument("--workspace", required=True, metavar="W", help="the workspace directory (created if needed)")
    src = pr.add_mutually_exclusive_group()
    src.add_argument("--source", metavar="PARQUET", type=Path, help="a local DAPO-Math-17k Parquet file")
    src.add_argument("--download-data", action="store_true",
                     help="fetch the official Parquet file into W/data/ (used as it is when already there)")
    pr.add_argument("--developer-fixture", action="store_true",
                    help="mark the data as a developer fixture whatever its size (no experiment or reward claim)")
    pr.add_argument("--model-path", metavar="HF_DIR", type=Path,
                    help="a Hugging Face Qwen3 directory (config.json, *.safetensors, tokenizer files)")
    pr.add_argument("--convert-checkpoint", action="store_true",
                    help="convert --model-path into W/models/<name>/ with a bitwise round trip of every tensor")
    pr.add_argument("--debug", action="store_true", help="show tracebacks")


def main(a: argparse.Namespace) -> int:
    from rlk_repro.prepare import prepare

    doc = prepare(Path(a.workspace), source=a.source, download_data=a.download_data, model_path=a.model_path,
                  convert=a.convert_checkpoint, forced_fixture=a.developer_fixture)
    data, model = doc.get("data"), doc.get("model")
    if data is not None:
        print(f"data: {a.workspace}/{data['output']}: {data['rows']} problems, {data['sha256']}, purpose "
              f"{data['purpose']} (manifest {data['manifest']})")
    if model is not None:
        print(f"model: {a.workspace}/{model['path']}: {model['tensors']} tensors, round trip {model['round_trip']}, "
              f"weights {model['weights_sha256']}")
    print(f"workspace: {a.workspace}/workspace.json")
    return 0
