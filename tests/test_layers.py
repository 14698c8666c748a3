"""The layers import one way: kernels <- engine <- server <- (loadtest | clients), and the API process loads
neither the model nor the kernels."""

from __future__ import annotations

import ast
import re
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


MAX_PYTHON_LINES, MAX_C_LINES = 600, 1000
KERNELS_C = ROOT / "kernels" / "cpu"


def test_no_file_outgrows_its_reader():
    """No Python module outside tests/ over MAX_PYTHON_LINES lines, no C file over MAX_C_LINES: a file a newcomer
    can read whole, split by job before it grows past that."""
    limits = [(p, MAX_PYTHON_LINES) for package in PACKAGES for p in (ROOT / package).rglob("*.py")]
    limits += [(p, MAX_C_LINES) for p in (*KERNELS_C.rglob("*.c"), *KERNELS_C.rglob("*.h"))]
    too_long = [f"{p.relative_to(ROOT)}: {n}" for p, most in limits if (n := len(p.read_text().splitlines())) > most]
    assert too_long == []


ISA_MACROS = re.compile(r"^\s*#\s*(?:if|ifdef|ifndef|elif)\b.*\b__(?:AVX|AMX|F16C|FMA|SSE|x86_64|i386|aarch64|ARM)")


def test_instruction_set_tests_live_under_arch():
    """The C kernels test the instruction set only under kernels/cpu/arch/ (arch/simd.h's constants and the files
    named for one ISA); every other file reads those constants with a plain ``if``."""
    found = [f"{p.relative_to(ROOT)}:{i}" for p in (*KERNELS_C.rglob("*.c"), *KERNELS_C.rglob("*.h"))
             if "arch" not in p.relative_to(KERNELS_C).parts
             for i, line in enumerate(p.read_text().splitlines(), 1) if ISA_MACROS.match(line)]
    assert found == []


C_DEFINITION = re.compile(r"^[a-z][\w \*]*?\b(hp_\w+)\(", re.M)
C_CALL = re.compile(r"\b(hp_\w+)\(")


def c_call_graph(root: Path = KERNELS_C) -> dict[str, list[str]]:
    """Each C file under ``root`` and the files whose exported functions (``hp_*``, defined at the start of a line)
    it calls."""
    files = sorted(root.rglob("*.c"))
    defined_in = {name: f.relative_to(root).as_posix() for f in files for name in C_DEFINITION.findall(f.read_text())}
    graph = {}
    for f in files:
        here, text = f.relative_to(root).as_posix(), f.read_text()
        calls = {defined_in[name] for name in C_CALL.findall(text) if name in defined_in}
        graph[here] = sorted(calls - {here})
    return graph


def test_no_call_cycle_between_c_files():
    """The C files call one way (decoder.c -> linear.c -> linear_q8x.c -> arch/x86/amx_int8.c ...): none calls back
    into a file that calls it."""
    graph = c_call_graph()
    assert "linear.c" in graph["decoder.c"] and cycles(graph) == []
