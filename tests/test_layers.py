"""The layers import one way: kernels <- engine <- server <- (loadtest | clients), and the API process loads
neither the model nor the kernels."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_layer_imports_a_higher_one():
    out = subprocess.run([sys.executable, "-m", "importlinter.cli", "--config", str(ROOT / "pyproject.toml")],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


def test_the_api_process_loads_no_model_or_kernel_code():
    """What ``harpoon serve`` imports in the API process (the engine runs in its own): the message types, the
    request checks and the tokenizer's side, not the model, the runner, the scheduler or any kernel."""
    code = ("import sys, server.cli, server.api, server.engine_client\n"
            "heavy = ('engine.engine_core', 'engine.models', 'engine.model_runner', 'engine.scheduler', "
            "'engine.backends', 'engine.attention', 'kernels.')\n"
            "print(sorted(m for m in sys.modules if m.startswith(heavy)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


PACKAGES = ("kernels", "engine", "server", "loadtest", "clients")


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str, modules: set[str]) -> set[str]:
    """The project's modules that ``path`` (module ``name``) imports anywhere in it: at the top, inside a function
    or under ``TYPE_CHECKING`` alike, since each is a dependency a reader must follow. ``from a import b`` counts
    a.b where that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1 packages
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT) -> dict[str, list[str]]:
    """Each of the project's modules under ``root`` and the project's modules it imports."""
    paths = {_module_name(p, root): p for package in PACKAGES for p in (root / package).rglob("*.py")}
    return {name: sorted(_imports(path, name, set(paths))) for name, path in paths.items()}


def cycles(graph: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module in ``graph`` (Tarjan's algorithm)."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_no_module_imports_itself_through_others():
    """No cycle between the project's modules, counting imports inside functions and under ``TYPE_CHECKING``: each
    module can be read, and tested, with only what it imports. (A backend once typed its warm-up's argument as the
    engine core that made it; the engine now runs its own start-up and asks the backend.)"""
    assert cycles(import_graph()) == []


def test_the_checker_finds_cycles_of_any_length_and_imports_anywhere(tmp_path):
    assert cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"], "e": []}) == [["a", "b", "c"]]
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "__init__.py").write_text("")
    (tmp_path / "engine" / "core.py").write_text("from engine import backend\n")
    (tmp_path / "engine" / "backend.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.core import Core\n")
    assert cycles(import_graph(tmp_path)) == [["engine.backend", "engine.core"]]
