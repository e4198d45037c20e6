"""``python -m rlk_repro.vime record RUN_DIR``: the head node's environment at launch, for the manifest.

The launch script of ``rlk-repro plan --engine vime`` runs it before submitting the job: repository SHAs and
dirty state, package versions, GPUs and input hashes go into ``RUN_DIR/environment.json``
(``rlk.vime-environment.v1``), which ``rlk-validate import-vime`` turns into the run's manifest. No torch.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from rlk_validate.evidence import VIME_ENVIRONMENT_SCHEMA

ENVIRONMENT_FILE = "environment.json"  # in the run directory (rlk_repro.vime names the launch's other files)


def record_environment(run_dir: str, repos: Mapping[str, str], inputs: Mapping[str, str]) -> dict[str, Any]:
    """Repository SHAs and dirty state, package versions, GPUs and input hashes, for the manifest."""
    import hashlib
    import os
    import subprocess
    from importlib import metadata

    def git(path: str, *args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", path, *args], capture_output=True, text=True, check=True,
                                  timeout=60).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    def digest(path: str) -> str | None:
        files = [path] if os.path.isfile(path) else sorted(
            os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)
        if not files:
            return None
        outer = hashlib.sha256()
        for f in files:
            h = hashlib.sha256()
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 24), b""):
                    h.update(chunk)
            outer.update(f"{os.path.relpath(f, path) if f != path else ''}\0{h.hexdigest()}\n".encode())
        return "sha256:" + outer.hexdigest()

    out_repos = []
    for name, path in repos.items():
        sha, status = git(path, "rev-parse", "HEAD"), git(path, "status", "--porcelain")
        out_repos.append({"name": name, "path": path, "sha": sha.strip() if sha else None,
                          "dirty": bool(status.strip()) if status is not None else None,
                          **({} if sha else {"error": "not a git checkout"})})
    packages = {}
    for dist in ("rlk-core", "rlk-collectives", "rlk-vllm-plugin", "rlk-megatron-provider", "rlk-validate",
                 "rlk-repro", "torch", "vllm", "megatron-core", "transformer-engine", "ray"):
        try:
            packages[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, check=True, timeout=60).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        smi = []
    hardware = {"device": "cuda" if smi else "unknown", "name": smi[0].split(",")[0].strip() if smi else None,
                "driver": smi[0].split(",")[1].strip() if smi and "," in smi[0] else None, "count": len(smi)}
    return {"schema": VIME_ENVIRONMENT_SCHEMA, "repos": out_repos, "packages": packages, "hardware": hardware,
            "inputs": {k: digest(v) for k, v in inputs.items()}}


def _pairs(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k or not v:
            raise SystemExit(f"rlk_repro.vime record: --{what} {item!r} is not NAME=PATH")
        out[k] = v
    return out


def main(argv: Sequence[str] | None = None) -> int:
    import os
    import sys

    from rlk_validate.evidence import write_json_atomic

    p = argparse.ArgumentParser(prog="python -m rlk_repro.vime",
                                description="record RUN_DIR: write RUN_DIR/environment.json (run by the launch script)")
    p.add_argument("action", choices=("record",))
    p.add_argument("run_dir")
    p.add_argument("--repo", action="append", default=[], metavar="NAME=PATH")
    p.add_argument("--input", action="append", default=[], metavar="NAME=PATH")
    a = p.parse_args(argv)
    repos = {"rlk": os.path.dirname(os.path.abspath(__file__)), **_pairs(a.repo, "repo")}
    doc = record_environment(a.run_dir, repos, _pairs(a.input, "input"))
    write_json_atomic(os.path.join(a.run_dir, ENVIRONMENT_FILE), doc, indent=1)
    print(f"wrote {os.path.join(a.run_dir, ENVIRONMENT_FILE)}", file=sys.stderr)
    return 0
