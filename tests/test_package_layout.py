"""The package's layout (CPU only): every folder of mok_rt is a regular package whose
``__init__.py`` a clean clone has, and no two modules import each other at module level, directly
or through others (the layers of docs/ARCHITECTURE.md import downwards only)."""
from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "mok_rt"


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for p in PKG.rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


def _imports(name: str, path: pathlib.Path, mods: dict[str, pathlib.Path]) -> set[str]:
    """The mok_rt modules that ``name`` imports at module level (not its own parent packages,
    which Python imports first anyway, and not imports inside functions)."""
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:
                t = t.rpartition(".")[0]
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_every_folder_is_a_package():
    folders = {p.parent for p in PKG.rglob("*.py") if "__pycache__" not in p.parts}
    assert [str(f) for f in sorted(folders) if not (f / "__init__.py").exists()] == []


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_every_package_init_is_tracked():
    out = subprocess.run(["git", "ls-files", "mok_rt"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("git ls-files failed")
    tracked = set(out.stdout.split())
    inits = {str(p.relative_to(ROOT)) for p in PKG.rglob("__init__.py")}
    assert sorted(inits - tracked) == [], "ignored or untracked __init__.py (a clean clone would lack it)"


def test_no_import_cycles():
    mods = _modules()
    graph = {m: _imports(m, p, mods) for m, p in mods.items()}
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []
