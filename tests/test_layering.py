"""The package's layering, read from its source with ``ast``: the import graph of ``rayvl/`` has no cycle, the data
plane flows one way, the parts that run every method name none of them, and functions stay short enough to read."""
import ast
import dataclasses
import fnmatch
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "rayvl"
CORE = ("data", "train", "eval", "config", "models", "losses", "checkpoints", "storage", "errors", "plugins",
        "session")
# (importer prefix, imported prefix): arrows that must not exist
FORBIDDEN = [("rayvl.data", "rayvl.models"), ("rayvl.data", "rayvl.train"), ("rayvl.data", "rayvl.eval"),
             ("rayvl.data", "rayvl.losses"), ("rayvl.eval", "rayvl.train"), ("rayvl.config", "rayvl.data"),
             ("rayvl.models", "rayvl.train"), ("rayvl.models", "rayvl.eval"), ("rayvl.checkpoints", "rayvl.train"),
             ("rayvl.checkpoints", "rayvl.eval"), ("rayvl.losses", "rayvl.data"),
             *(("rayvl.storage", f"rayvl.{m}") for m in ("config", "data", "models", "train", "eval", "checkpoints")),
             # the core never imports a method: the methods import the core and register in rayvl.plugins
             *((f"rayvl.{m}", "rayvl.methods") for m in CORE)]
MAX_FUNCTION_LINES = 60
# the data plane: what Ray Data's read tasks import or unpickle — rayvl.data (with the interfaces the methods' row
# transforms implement), the methods' row transforms and config checks (rayvl.config runs them), and the registry
# that names them (rayvl.plugins, rayvl.methods)
DATA_PLANE = ("rayvl.data", "rayvl.data.*", "rayvl.plugins", "rayvl.methods", "rayvl.methods.*.rows",
              "rayvl.methods.*.check")
HEAVY = ("rayvl.models", "rayvl.train", "rayvl.losses", "rayvl.eval")
# words that name a method whose code lives in rayvl/methods/ ([BoW] captions, memory bank and pseudo-labels; [TOnICS]
# and its ontology; [UniCL] and its image-label data) — not [Paraphrase]'s parts, which are the core's by design (its
# text strategies are text-tower options, its AO@k / JS@k an evaluation task beside zero-shot's class prompts)
METHOD_WORDS = ("bow", "tonics", "unicl", "image_label", "ontology", "pseudo", "memory_bank")
# the core that runs every method and names none of them: every module of these packages, and these modules — a
# docstring may cite a paper (the style asks for it), the code may not name a method, its settings or its data
METHOD_FREE_PACKAGES = ("rayvl.data", "rayvl.train", "rayvl.eval", "rayvl.sweeps")
METHOD_FREE_MODULES = ("rayvl.config", "rayvl.plugins", "rayvl.session", "rayvl.losses", "rayvl.export",
                       "rayvl.annotated", "rayvl.plots", "rayvl.checkpoints", "rayvl.storage", "rayvl.dry_run",
                       "rayvl.cli", "rayvl.cli.recipes")


@functools.lru_cache(maxsize=1)
def _modules() -> dict[str, ast.Module]:
    """Every module of rayvl/, parsed once a session (the trees are read, never changed)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.Module, modules: set[str], typing: bool = False) -> list[tuple[str, int, bool]]:
    """(imported rayvl module, line, inside a function) for every import outside ``if TYPE_CHECKING:`` blocks (and
    inside them too with ``typing``)."""
    found = []

    def visit(node, in_function: bool):
        if isinstance(node, ast.If) and _is_type_checking(node) and not typing:
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


def _graph(typing: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    return {m: {target for target, _, _ in _imports(t, names, typing) if target != m} for m, t in modules.items()}


def test_import_graph_has_no_cycle():
    """Not even through the imports made for type checkers only (the data pipeline and the methods' interface
    named each other that way)."""
    graph = _graph(typing=True)
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
    # a method reaches the wiring (the CLI's helpers, the dry run's lines) only from its own commands module
    wiring = ("rayvl.cli", "rayvl.dry_run")
    up = [f"{m} → {t}" for m, targets in _graph().items() if m.startswith("rayvl.methods.")
          and not fnmatch.fnmatchcase(m, "rayvl.methods.*.commands")
          for t in targets if any(t == w or t.startswith(w + ".") for w in wiring)]
    assert not up, "a method module other than its commands imports the wiring: " + ", ".join(sorted(up))


def test_data_plane_imports_no_torch_models_or_training():
    """The data plane runs in Ray Data's read and map tasks: it names none of rayvl's models, training or loss
    (read from the source, imports inside functions included), and importing all of it in a fresh interpreter loads
    neither torch nor any of those — transitive imports included, which the source's own lines do not show."""
    import subprocess
    import sys

    modules = _modules()
    data = sorted(name for name in modules if any(fnmatch.fnmatchcase(name, p) for p in DATA_PLANE))
    for name in data:
        imported = {t for t, _, _ in _imports(modules[name], set())}
        assert not {t for t in imported if t.startswith(HEAVY)}, name
    assert len(data) > 10
    assert {"rayvl.data.parts", "rayvl.plugins", "rayvl.methods", "rayvl.methods.tonics.rows",
            "rayvl.methods.bow.check"} <= set(data)
    code = (f"import importlib, sys\nfor name in {data!r}:\n    importlib.import_module(name)\n"
            f"print(sorted({{m for m in sys.modules if m.startswith({HEAVY!r})}} | ({{'torch'}} & set(sys.modules))))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=PACKAGE.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", f"importing the data plane loads {r.stdout.strip()}"


def _named(node: ast.AST) -> list[tuple[str, int]]:
    """(every identifier, attribute, argument, imported name and string constant under ``node`` — docstrings, the
    bare strings of a module, class or function body, left out — its line)."""
    docstrings = {id(n.value) for n in ast.walk(node) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
                  and isinstance(n.value.value, str)}
    out = []
    for n in ast.walk(node):
        if id(n) in docstrings:
            continue
        for word in (getattr(n, "id", None), getattr(n, "attr", None), getattr(n, "arg", None),
                     n.name if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.alias))
                     else None, n.asname if isinstance(n, ast.alias) else None,
                     n.module if isinstance(n, ast.ImportFrom) else None,
                     n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None):
            if word:
                out.append((word, getattr(n, "lineno", 0)))
    return out


def method_names(tree: ast.Module) -> list[str]:
    """Where ``tree`` names a method: "line: word"."""
    return [f"{line}: {word!r}" for word, line in _named(tree) if any(m in word.lower() for m in METHOD_WORDS)]


def _method_free() -> list[str]:
    return sorted(name for name in _modules() if name in METHOD_FREE_MODULES
                  or any(name == p or name.startswith(p + ".") for p in METHOD_FREE_PACKAGES))


@pytest.mark.parametrize("module", _method_free())
def test_the_core_names_no_method(module):
    """The data plane, the training loop and step, the evaluation, the config, the registry and the session iterate
    over the enabled methods' parts and registrations (rayvl.plugins): a method's name, setting or data kind in their
    code means a missing interface."""
    found = method_names(_modules()[module])
    assert not found, f"{module} names a method: " + ", ".join(found)


def test_the_method_free_core_is_the_whole_core():
    names = _method_free()
    assert {"rayvl.data.pipeline", "rayvl.train.loop", "rayvl.train.step", "rayvl.eval.tasks", "rayvl.config",
            "rayvl.session", "rayvl.data.report", "rayvl.train.trainer"} <= set(names) and len(names) > 50, names


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
    named = ast.parse('def check(cfg):\n    """[TOnICS]\'s rows (a citation)."""\n    _helper(cfg.data)\n\n\n'
                      'def _helper(d):\n    return d.Ontology\n\n\ndef unused():\n    return "TOnICS"\n')
    assert method_names(named) == ["7: 'Ontology'", "11: 'TOnICS'"]
    assert method_names(ast.parse("from rayvl.methods.bow import rows\nx = f(memory_bank=1)\n")) == [
        "1: 'rayvl.methods.bow'", "2: 'memory_bank'"]


def test_every_module_name_string_resolves():
    """What rayvl names as "module:name" — the methods' data parts and training parts (rayvl.methods), the jobs'
    after-run hooks (each trial imports it by that name) — imports and is a callable: a rename that misses one fails
    here, not in a worker or a sweep's last trial."""
    import importlib.util
    import re

    from rayvl import plugins

    named = {m for path in [*PACKAGE.rglob("*.py"), *(PACKAGE.parent / "jobs").glob("*.py")]
             for m in re.findall(r"[\"'](rayvl(?:\.\w+)+:\w+)[\"']", path.read_text())}
    named |= {w for m in plugins.methods() for w in (m.data_part, m.train_part) if w}
    assert len(named) >= 10, sorted(named)
    for where in sorted(named):
        module, name = where.split(":")
        assert callable(getattr(importlib.import_module(module), name, None)), where
    # the after-run hooks a resumed sweep's trials may still name by their place in the core before a method took
    # them (rayvl.sweeps.trials.moved): each old name finds the method's module
    from rayvl.sweeps.trials import hook, moved

    for old, new in (("rayvl.eval.pseudo_captions", "rayvl.methods.bow.pseudo_captions"),
                     ("rayvl.eval.contextual", "rayvl.methods.tonics.contextual"),
                     ("rayvl.eval.class_split", "rayvl.methods.unicl.class_split")):
        assert importlib.util.find_spec(old) is None and moved(old) == new, old
        name = next(n for n, v in vars(importlib.import_module(new)).items()
                    if callable(v) and not n.startswith("_") and getattr(v, "__module__", "") == new)
        assert hook(f"{old}:{name}") is hook(f"{new}:{name}"), old
    with pytest.raises(ModuleNotFoundError):
        hook("rayvl.nowhere.module:f")
    # only a module of the old core, and only where one method holds its name
    assert moved("rayvl.eval.rows") == "rayvl.eval.rows" and moved("mine.contextual") == "mine.contextual"
    # a method's data-report module, named as a module: its statistics and its lines (rayvl.data.report)
    reports = [m.report for m in plugins.methods() if m.report]
    assert reports, [m.name for m in plugins.methods()]
    for module in reports:
        for name in ("statistics", "lines"):
            assert callable(getattr(importlib.import_module(module), name, None)), f"{module}:{name}"


def test_the_architecture_pages_test_map_names_every_test_file_and_only_those():
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text().split("## Tests by layer", 1)[1]
    import re

    named = set(re.findall(r"`(test_\w+)`", text))
    files = {p.stem for p in (PACKAGE.parent / "tests").glob("test_*.py")}
    assert named == files, (sorted(named - files), sorted(files - named))


def statistics(counts: dict) -> dict:  # a plug-in's report hook (the test below registers this module)
    return {"demo_share": counts.get("demo_rows", 0) / max(1, counts.get("samples_kept", 1))}


def lines(report: dict) -> list[str]:
    return [f"  demo: {report['counts']['demo_rows']} rows"] if "demo_rows" in report.get("counts", {}) else []


@dataclasses.dataclass
class DemoConfig:  # a plug-in's config section (the test below registers it)
    rate: float = 0.5
    """the demo's rate."""


def test_a_method_reaches_the_report_the_progress_line_the_dashboards_and_the_cpu_check_by_registering(monkeypatch):
    """What a method adds to a data report, a progress line, the dashboards' data group, the CPUs Ray Data needs, the
    config tree and the loss kinds comes from its registration alone (rayvl.plugins), so the core modules that show
    them name no method."""
    from rayvl import plugins
    from rayvl.config import ConfigError, load_config
    from rayvl.data.report import caption_stats, format_data_report
    from rayvl.session import check_resources
    from rayvl.train.progress import progress_line
    from rayvl.train.run_log import scalars

    plugins.methods()  # the real ones first, then this test's
    monkeypatch.setitem(plugins._registered, "demo", plugins.Method(
        "demo", report=__name__, progress=(("demo_rate", "rate {:.2f}"),), data_metrics=("demo_rows",),
        streams=lambda cfg: 2, loss_kinds=("demo_loss",), sections=(("demo", DemoConfig),)))
    counts = {"samples_seen": 10, "samples_kept": 8, "caption_words": 40, "demo_rows": 4}
    assert caption_stats(counts)["demo_share"] == 0.5 and "  demo: 4 rows" in format_data_report({"counts": counts})
    row = {"step": 1, "time": 1.0, "loss": 1.0, "lr": 1e-3, "logit_scale": 14.3, "samples_per_s": 10.0,
           "data_wait_share": 0.0, "demo_rate": 0.123, "demo_rows": 4}
    assert "rate 0.12" in progress_line(row, 10, 0.0, None, 1)
    assert scalars(row)["data/demo_rows"] == 4.0 and scalars(row)["train/demo_rate"] == 0.123
    cfg = load_config(None, ["train.num_workers=1", "train.cpus_per_worker=1", "data.read_cpus=0.5"])
    check_resources(cfg, fixed_size=True, node_cpus=[2.5])  # the training stream and 2 more: 3 read tasks of 0.5
    with pytest.raises(ConfigError, match="3 Ray Data pipeline"):
        check_resources(cfg, fixed_size=True, node_cpus=[2.0])
    # its config section: a typed part of the tree, its keys checked as the core's (the tree rayvl.config builds at
    # import is made the same way from the methods registered then)
    from rayvl import config
    tree = config._config_tree()
    assert config._build(tree, {"demo": {"rate": 0.25}, "bow": {"enabled": True}}).demo == DemoConfig(0.25)
    with pytest.raises(ConfigError, match=r"^demo\.rat: unknown key \(did you mean demo\.rate\?"):
        config._build(tree, {"demo": {"rat": 1}})
    with pytest.raises(ConfigError, match=r"^demo\.rate: expected a number"):
        config._build(tree, {"demo": {"rate": "fast"}})
    assert load_config(None, ["loss.kind=demo_loss"]).loss.kind == "demo_loss"  # its loss kind
    with pytest.raises(ConfigError, match=r"^loss\.kind: 'nope' is not one of \['clip', 'siglip', 'unicl', 'ce', "
                                          r"'demo_loss'\]"):
        load_config(None, ["loss.kind=nope"])
