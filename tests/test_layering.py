"""The package's layering, read from its source with ``ast``: the import graph of ``rayvl/`` has no cycle, the data
plane flows one way, and functions stay short enough to read."""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rayvl"
# (importer prefix, imported prefix): arrows that must not exist
FORBIDDEN = [("rayvl.data", "rayvl.models"), ("rayvl.data", "rayvl.train"), ("rayvl.data", "rayvl.eval"),
             ("rayvl.data", "rayvl.losses"), ("rayvl.eval", "rayvl.train"), ("rayvl.config", "rayvl.data"),
             ("rayvl.models", "rayvl.train"), ("rayvl.models", "rayvl.eval"), ("rayvl.checkpoints", "rayvl.train"),
             ("rayvl.checkpoints", "rayvl.eval"), ("rayvl.losses", "rayvl.data"),
             *(("rayvl.storage", f"rayvl.{m}") for m in ("config", "data", "models", "train", "eval", "checkpoints"))]
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.Module, modules: set[str]) -> list[tuple[str, int, bool]]:
    """(imported rayvl module, line, inside a function) for every import outside ``if TYPE_CHECKING:`` blocks."""
    found = []

    def visit(node, in_function: bool):
        if isinstance(node, ast.If) and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.extend((a.name, node.lineno, in_function) for a in node.names if a.name.startswith("rayvl"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("rayvl"):
            for a in node.names:  # `from rayvl.data import bow` imports the module rayvl.data.bow
                sub = f"{node.module}.{a.name}"
                found.append((sub if sub in modules else node.module, node.lineno, in_function))
        inside = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            visit(child, inside)

    visit(tree, False)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    return {m: {target for target, _, _ in _imports(t, names) if target != m} for m, t in modules.items()}


def test_import_graph_has_no_cycle():
    graph = _graph()
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " → ".join(path[path.index(nxt):] + [node, nxt]))
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


def test_no_forbidden_arrows():
    bad = [f"{m} → {t}" for m, targets in _graph().items() for t in targets
           for src, dst in FORBIDDEN if (m == src or m.startswith(src + ".")) and (t == dst or t.startswith(dst + "."))]
    assert not bad, "layering broken: " + ", ".join(sorted(bad))


def test_data_plane_imports_no_torch_models_or_training():
    """The data plane runs in Ray Data's read and map tasks: it names none of rayvl's models, training or loss
    (read from the source, imports inside functions included), and importing all of it in a fresh interpreter loads
    neither torch nor any of those — transitive imports included, which the source's own lines do not show."""
    import subprocess
    import sys

    modules = _modules()
    for name, tree in modules.items():
        if name.startswith("rayvl.data"):
            imported = {t for t, _, _ in _imports(tree, set())}
            assert not {t for t in imported if t.startswith(("rayvl.models", "rayvl.train", "rayvl.losses"))}, name
    data = sorted(name for name in modules if name.startswith("rayvl.data"))
    assert len(data) > 10
    heavy = ("rayvl.models", "rayvl.train", "rayvl.losses", "rayvl.eval")
    code = (f"import importlib, sys\nfor name in {data!r}:\n    importlib.import_module(name)\n"
            f"print(sorted({{m for m in sys.modules if m.startswith({heavy!r})}} | ({{'torch'}} & set(sys.modules))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=PACKAGE.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"importing rayvl.data loads {r.stdout.strip()}"


def test_functions_are_short():
    long = []
    for name, tree in _modules().items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines} lines")
    assert not long, "functions over 60 lines: " + ", ".join(long)


def test_the_checker_sees_what_it_should(tmp_path):
    """The walker itself: a function-level import counts, a TYPE_CHECKING one does not."""
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rayvl.train import loop\n"
                     "def f():\n    from rayvl.models import towers\n")
    assert _imports(tree, {"rayvl.models.towers"}) == [("rayvl.models.towers", 5, True)]
