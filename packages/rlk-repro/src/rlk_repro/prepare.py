"""``rlk-repro prepare``: DAPO-Math-17k Parquet -> VIME prompt/label JSONL, a checkpoint, the workspace record.

The data (the seeds' ``prepare_dapo_data.py``): the official Parquet file (columns ``data_source``, ``prompt`` — a
chat list of ``{role, content}`` —, ``ability``, ``reward_model {ground_truth, style}``, ``extra_info {index}``;
1.79M rows, each problem repeated) is read with pyarrow, deduplicated by ``extra_info.index`` (the first row of
an index is kept; a repeat whose prompt or answer differs from it stops the conversion) and written as VIME's
JSONL, one ``{"prompt": [...messages], "label": ground_truth, "metadata": {...}}`` per problem, read by VIME /
slime with ``--input-key prompt --label-key label --apply-chat-template``. A sibling manifest
(``rlk.prepare-data.v1``) records the source's and the output's sha256, sizes and row counts, the dedup, and the
data's *purpose*:

- ``experiment``: at least :data:`MIN_EXPERIMENT_ROWS` distinct problems (the official set has about 17.4k);
- ``developer-fixture``: anything smaller, or ``--developer-fixture``. A fixture never backs an experiment or a
  reward claim: a run on it records ``claims.experiment = false`` with the reason, and ``report`` says so on
  every summary (:func:`claims`).

The checkpoint (``--model-path HF_DIR --convert-checkpoint``): the Hugging Face Qwen3 directory is read into
the engines' fused layout (:func:`rlk_repro.model.weights.from_hf`), written back in the Hugging Face layout
under ``W/models/<name>/`` (what the local and frameworks engines load) with the tokenizer files, and every
tensor of the written file is compared bit for bit with the source's (``round_trip``). VIME's ``torch_dist``
layout is not written here.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rlk_core.errors import RlkConfigError
from rlk_repro import workspace as ws

DATA_SCHEMA = ws.DATA_SCHEMA
CHECKPOINT_SCHEMA = "rlk.checkpoint.v1"
DAPO_URL = "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k/resolve/main/data/dapo-math-17k.parquet"
#: fewer distinct problems than this is a developer fixture (the official set deduplicates to about 17.4k)
MIN_EXPERIMENT_ROWS = 17_000
#: files of a Hugging Face model directory that travel with the weights
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def _pyarrow():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RlkConfigError("reading Parquet needs pyarrow: pip install 'rlk-repro[prepare]'") from None
    return pq


def _column(table_columns: list[str], name: str, path: Path) -> None:
    if name not in table_columns:
        raise RlkConfigError(f"{path}: no column {name!r} (columns: {', '.join(table_columns)}); expected "
                             "DAPO-Math-17k's layout (prompt, reward_model.ground_truth, extra_info.index)")


def _messages(prompt: Any, where: str) -> Any:
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise RlkConfigError(f"{where}: prompt must be a chat list of {{role, content}} or a string, got "
                             f"{type(prompt).__name__}")
    out = []
    for m in prompt:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RlkConfigError(f"{where}: a prompt message must have string role and content, got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def convert_parquet(source: Path, output: Path) -> dict[str, Any]:
    """DAPO-Math-17k Parquet -> VIME JSONL at ``output`` (atomically); returns the row counts and dedup facts."""
    pq = _pyarrow()
    try:
        pf = pq.ParquetFile(source)
    except Exception as exc:  # pyarrow raises its own error types for a file that is not Parquet
        raise RlkConfigError(f"{source} is not a readable Parquet file: {exc}") from None
    columns = list(pf.schema_arrow.names)
    for name in ("prompt", "reward_model", "extra_info"):
        _column(columns, name, source)
    wanted = [c for c in ("data_source", "prompt", "ability", "reward_model", "extra_info") if c in columns]
    seen: dict[str, tuple[str, str]] = {}
    rows_in = duplicates = 0
    tmp = output.with_name(output.name + ".part")
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w", encoding="utf-8", newline="\n") as fh:
        for batch in pf.iter_batches(batch_size=65536, columns=wanted):
            for row in batch.to_pylist():
                where = f"{source} row {rows_in}"
                rows_in += 1
                extra, rm = row.get("extra_info") or {}, row.get("reward_model") or {}
                if extra.get("index") is None:
                    raise RlkConfigError(f"{where}: extra_info.index is missing (the dedup key)")
                if not isinstance(rm.get("ground_truth"), str):
                    raise RlkConfigError(f"{where}: reward_model.ground_truth must be a string, got "
                                         f"{rm.get('ground_truth')!r}")
                index = str(extra["index"])
                prompt = _messages(row.get("prompt"), where)
                key = (json.dumps(prompt, ensure_ascii=False), rm["ground_truth"])
                if index in seen:
                    duplicates += 1
                    if seen[index] != key:
                        raise RlkConfigError(f"{where}: extra_info.index {index} repeats with a different prompt or "
                                             "ground truth; deduplicating by index would drop a different problem")
                    continue
                seen[index] = key
                meta = {"index": index, **{k: row[k] for k in ("data_source", "ability") if row.get(k) is not None}}
                fh.write(json.dumps({"prompt": prompt, "label": rm["ground_truth"], "metadata": meta},
                                    ensure_ascii=False) + "\n")
    if not seen:
        tmp.unlink()
        raise RlkConfigError(f"{source} has no rows")
    os.replace(tmp, output)
    return {"rows_in": rows_in, "rows_out": len(seen), "duplicates_dropped": duplicates, "columns": columns}


def download(dest: Path, url: str | None = None, timeout: float = 30.0) -> None:
    """Fetch the official Parquet file (:data:`DAPO_URL`) to ``dest``; without network, one line naming the file
    and where to put it."""
    url = url or DAPO_URL
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp, open(tmp, "wb") as fh:
            shutil.copyfileobj(resp, fh, 1 << 20)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        tmp.unlink(missing_ok=True)
        reason = getattr(exc, "reason", None) or exc
        raise RlkConfigError(f"--download-data: cannot fetch {url} ({reason}); download that file on a machine "
                             f"with network and put it at {dest} (or pass --source FILE.parquet)") from None
    os.replace(tmp, dest)


def purpose_of(rows_out: int, forced_fixture: bool) -> tuple[str, str]:
    if forced_fixture:
        return "developer-fixture", "--developer-fixture was given"
    if rows_out < MIN_EXPERIMENT_ROWS:
        return "developer-fixture", (f"{rows_out} distinct problems, fewer than {MIN_EXPERIMENT_ROWS} (the official "
                                     "DAPO-Math-17k has about 17.4k)")
    return "experiment", f"{rows_out} distinct problems (>= {MIN_EXPERIMENT_ROWS})"


def prepare_data(source: Path, output: Path, *, url: str | None = None, forced_fixture: bool = False) -> dict:
    """Convert ``source`` into ``output`` and write the sibling manifest; returns the manifest."""
    from rlk_repro import lifecycle, runs

    facts = convert_parquet(source, output)
    purpose, reason = purpose_of(facts["rows_out"], forced_fixture)
    doc = {
        "schema": DATA_SCHEMA, "created_at": lifecycle.utc_now(), "tool": _tool(),
        "source": {"path": str(source.resolve()), "name": source.name, "url": url, "sha256": runs.file_sha256(source),
                   "bytes": source.stat().st_size, "rows": facts["rows_in"], "columns": facts["columns"]},
        "output": {"name": output.name, "sha256": runs.file_sha256(output), "bytes": output.stat().st_size,
                   "rows": facts["rows_out"], "format": "vime-jsonl", "input_key": "prompt", "label_key": "label",
                   "metadata_key": "metadata"},
        "dedup": {"key": "extra_info.index", "kept": "first", "duplicates_dropped": facts["duplicates_dropped"]},
        "purpose": purpose, "purpose_reason": reason,
    }
    runs.write_json_atomic(ws.manifest_path(output), doc)
    return doc


def _tool() -> dict[str, Any]:
    from rlk_repro import __version__, runs

    return {"name": "rlk-repro", "version": __version__,
            "repo": runs.repo_state(Path(__file__).resolve().parent)}


def convert_checkpoint(model_path: Path, dest: Path) -> dict[str, Any]:
    """HF Qwen3 directory -> ``dest`` (HF layout, tokenizer files copied), every tensor round-tripped bit for bit
    through the engines' fused layout; returns the checkpoint record."""
    import torch
    from safetensors import safe_open

    from rlk_repro import runs
    from rlk_repro.model.weights import load_checkpoint, save_checkpoint, to_hf, weights_sha256

    cfg, weights = load_checkpoint(model_path)
    if dest.exists():
        shutil.rmtree(dest)
    save_checkpoint(dest, cfg, weights)
    for name in TOKENIZER_FILES:
        if (model_path / name).is_file():
            shutil.copy2(model_path / name, dest / name)
    expected = to_hf(cfg, weights)
    source: dict[str, torch.Tensor] = {}
    for f in sorted(p for p in os.listdir(model_path) if p.endswith(".safetensors")):
        with safe_open(str(model_path / f), framework="pt") as fh:
            source.update({k: fh.get_tensor(k) for k in fh.keys()})
    with safe_open(str(dest / "model.safetensors"), framework="pt") as fh:
        written = {k: fh.get_tensor(k) for k in fh.keys()}
    if cfg.tie_word_embeddings:
        source.pop("lm_head.weight", None)
    bad = sorted(k for k in set(source) | set(written) if k not in source or k not in written
                 or source[k].dtype != written[k].dtype or not torch.equal(source[k], written[k])
                 or not torch.equal(expected[k], written[k]))
    if bad:
        raise RlkConfigError(f"--convert-checkpoint: {len(bad)} tensors differ after the round trip through the "
                             f"fused layout (first: {bad[0]})")
    return {"schema": CHECKPOINT_SCHEMA, "source": str(model_path.resolve()), "path": None,
            "tensors": len(written), "round_trip": "bitwise", "weights_sha256": weights_sha256(weights),
            "model_safetensors_sha256": runs.file_sha256(dest / "model.safetensors"),
            "tokenizer_files": [n for n in TOKENIZER_FILES if (dest / n).is_file()],
            "torch_dist": "not written (VIME's torch_dist layout is not produced by this prepare)"}


def prepare(workspace: Path, *, source: Path | None, download_data: bool, model_path: Path | None,
            convert: bool, forced_fixture: bool = False) -> dict[str, Any]:
    """The whole ``prepare``: data and/or checkpoint into the workspace, then ``workspace.json``."""
    from rlk_repro import lifecycle, runs

    if source is not None and download_data:
        raise RlkConfigError("--source and --download-data are exclusive (one source of the Parquet file)")
    if convert and model_path is None:
        raise RlkConfigError("--convert-checkpoint needs --model-path HF_DIR")
    if model_path is not None and not convert:
        raise RlkConfigError("--model-path is read by prepare only with --convert-checkpoint")
    if source is None and not download_data and model_path is None:
        raise RlkConfigError("nothing to prepare: give --source FILE.parquet or --download-data, and/or "
                             "--model-path HF_DIR --convert-checkpoint")
    if source is not None and not source.is_file():
        raise RlkConfigError(f"--source {source}: no such file")
    p = ws.paths(workspace)
    lifecycle.refuse_inside_run_dir(workspace, "--workspace")
    doc: dict[str, Any] = ws.read(workspace) if p["doc"].is_file() else {
        "schema": ws.WORKSPACE_SCHEMA, "created_at": lifecycle.utc_now(), "layout": dict(ws.LAYOUT)}
    for key in ws.LAYOUT:
        p[key].mkdir(parents=True, exist_ok=True)
    if source is not None or download_data:
        url = None
        if download_data:
            source = p["source"]
            if not source.is_file():
                download(source)
                url = DAPO_URL
        manifest = prepare_data(source, p["output"], url=url, forced_fixture=forced_fixture)
        doc["data"] = {"output": str(p["output"].relative_to(workspace)),
                       "manifest": str(p["data_manifest"].relative_to(workspace)),
                       "sha256": manifest["output"]["sha256"], "rows": manifest["output"]["rows"],
                       "purpose": manifest["purpose"]}
    if convert:
        dest = p["models"] / model_path.resolve().name
        record = convert_checkpoint(model_path, dest)
        record["path"] = str(dest.relative_to(workspace))
        runs.write_json_atomic(dest / "rlk-checkpoint.json", record)
        doc["model"] = {"path": record["path"], "weights_sha256": record["weights_sha256"],
                        "tensors": record["tensors"], "round_trip": record["round_trip"]}
    doc["updated_at"] = lifecycle.utc_now()
    runs.write_json_atomic(p["doc"], doc)
    return doc
