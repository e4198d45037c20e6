"""No import circle in any rlk package: the imports of every module, module-level and inside functions alike, read
from the source (``ast``), form no cycle among the package's own modules; and no adapter or launcher imports a
private module of rlk-core (what they need is rlk-core's public API)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = sorted(p for p in (ROOT / "packages").glob("*/src/*") if (p / "__init__.py").is_file())


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, is_package: bool) -> set[str]:
    """Every module ``path`` imports, module-level or not, absolute names (relative imports resolved)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name.split(".") if is_package else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, *([base] if base else [])])
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # `from pkg import module`
    return out


def _graph(top: Path) -> dict[str, set[str]]:
    src = top.parent
    modules = {_module_name(p, src): p for p in top.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = _imports(path, name, path.name == "__init__.py")
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    color: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        color[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if color.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in color:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        color[n] = 2
        return None

    for n in sorted(graph):
        if n not in color:
            found = visit(n)
            if found:
                return found
    return None


def _without_parent_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A module importing a name from its own package's ``__init__`` re-exports is no circle of code (the package
    face imports its modules, they import each other): package faces are dropped as targets of their submodules."""
    return {n: {m for m in targets if not n.startswith(m + ".")} for n, targets in graph.items()}


@pytest.mark.parametrize("top", PACKAGES, ids=lambda p: p.name)
def test_no_import_circle(top):
    cycle = _cycle(_without_parent_packages(_graph(top)))
    assert cycle is None, " -> ".join(cycle)


def test_the_cycle_finder_finds_a_circle_negative_control(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("import pkg.a\n")
    assert _cycle(_without_parent_packages(_graph(pkg))) == ["pkg.a", "pkg.b", "pkg.a"]


def test_adapters_and_launchers_use_rlk_core_s_public_api_only():
    private = []
    for top in PACKAGES:
        if top.name == "rlk_core":
            continue
        for path in top.rglob("*.py"):
            for mod in _imports(path, _module_name(path, top.parent), path.name == "__init__.py"):
                parts = mod.split(".")
                if parts[0] == "rlk_core" and any(p.startswith("_") for p in parts[1:]):
                    private.append(f"{path.relative_to(ROOT)}: {mod}")
    assert not private, private
