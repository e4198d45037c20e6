"""Every relative link in the project's markdown points to a file that exists, and so does every repository path
written in backticks, unless its paragraph says the file is in git history."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
TICKED = re.compile(r"`((?:benchmarks|docs|tests|packages|scripts|csrc)/[^`\s]*)`")
PLACEHOLDER = re.compile(r"[*?{}<>$]|\.\.\.")


def _markdown() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout.strip():
        paths = [REPO / p for p in tracked.stdout.split()]
    else:  # not a git checkout (an unpacked archive): every markdown file outside the environments
        paths = [p for p in REPO.rglob("*.md") if not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
    # run directories carry what their engine wrote; the evidence docs of other projects are not ours to fix
    return sorted(p for p in paths if p.is_file() and "/data/" not in p.as_posix() and "examples/report-" not in
                  p.as_posix())


def _paragraphs(text: str):
    start = 1
    for block in re.split(r"\n\s*\n", text):
        yield start, block
        start += block.count("\n") + 2


def _exists(repo: Path, ref: str) -> bool:
    """``ref`` names a file or folder, a test (``file.py::name``) or a Python name in a module (``dir/mod.name``)."""
    path = ref.split("::")[0]
    return (repo / path).exists() or ("." in path and (repo / (path.rsplit(".", 1)[0] + ".py")).is_file())


def _dead(path: Path, repo: Path = REPO) -> list[str]:
    out = []
    for line, block in _paragraphs(path.read_text(encoding="utf-8")):
        for target in LINK.findall(block):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            rel = target.split("#")[0]
            if rel and not (path.parent / rel).exists():
                out.append(f"{path.relative_to(repo)}:{line}: link {target}")
        for ref in TICKED.findall(block):
            ref = ref.rstrip(".,;:")
            if PLACEHOLDER.search(ref) or _exists(repo, ref) or "git history" in block:
                continue
            out.append(f"{path.relative_to(repo)}:{line}: path `{ref}`")
    return out


def test_the_markdown_files_are_found():
    names = {p.relative_to(REPO).as_posix() for p in _markdown()}
    assert {"README.md", "docs/frameworks.md", "benchmarks/results/SUMMARY.md"} <= names


@pytest.mark.parametrize("path", _markdown(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_no_dead_relative_link_or_path(path):
    dead = _dead(path)
    assert not dead, "\n".join(dead)


def test_a_dead_link_is_found(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("See [the notes](missing/NOTES.md) and `benchmarks/NOTES.md`.\n\n"
                   "`benchmarks/NOTES.md` is in git history. [ok](doc.md), [web](https://example.org)\n")
    assert _dead(doc, tmp_path) == ["doc.md:1: link missing/NOTES.md", "doc.md:1: path `benchmarks/NOTES.md`"]
