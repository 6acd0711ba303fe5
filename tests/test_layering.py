"""The layering: ``autopar.core`` is a leaf, ``passes`` and ``runtime`` import only it, ``autopar`` composes.

Every module's imports (module level and inside functions) are read with ``ast``;
an import that crosses the layering fails with the file, the line and the rule.
In passes and runtime a parameter named ``program`` or ``options`` has a type
(never ``Any``): what a function reads of them is visible in its signature.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"core": ROOT / "autopar" / "core", "passes": ROOT / "passes", "runtime": ROOT / "runtime"}
ALLOWED = {  # layer -> the autopar layers it may import
    "core": {"core"},
    "passes": {"core", "passes"},
    "runtime": {"core", "runtime"},
    "api": {"core", "passes", "runtime", "api"},
}
RULES = {
    "core": "autopar.core is a leaf: it imports only torch, the standard library, numpy, sympy and itself",
    "passes": "autopar.passes imports only autopar.core and itself (pass policy in as an argument)",
    "runtime": "autopar.runtime imports only autopar.core and itself (pass policy in as an argument)",
}
CORE_THIRD_PARTY = {"torch", "numpy", "sympy"}


def layer_of_file(path: Path) -> str:
    for layer, folder in FOLDERS.items():
        if folder in path.parents:
            return layer
    return "api"


def layer_of_module(module: str) -> str | None:
    """The autopar layer a dotted module name belongs to, ``None`` for anything outside autopar."""
    parts = module.split(".")
    if parts[0] in ("passes", "runtime"):
        return f"top-level {parts[0]}"  # the pre-namespace name: always wrong
    if parts[0] != "autopar":
        return None
    if len(parts) > 1 and parts[1] in ("core", "passes", "runtime"):
        return parts[1]
    return "api"


def package_of(path: Path) -> str:
    """The dotted package ``path`` is installed in (``passes/rules/x.py`` -> ``autopar.passes.rules``)."""
    rel = path.relative_to(ROOT).with_suffix("").parts[:-1]
    if rel and rel[0] in ("passes", "runtime"):
        rel = ("autopar", *rel)
    return ".".join(rel)


def imported_modules(path: Path, *, submodules: bool = False) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every import in ``path``; ``from autopar import b`` also yields ``autopar.b``
    (``b`` may be a module), so ``from autopar import runtime`` is caught; with ``submodules`` every
    ``from autopar.x import y`` also yields ``autopar.x.y``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = package_of(path).split(".")
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            out.append((node.lineno, base))
            if base == "autopar" or submodules and base.startswith("autopar."):
                out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def violations(path: Path) -> list[str]:
    layer = layer_of_file(path)
    found = []
    for line, module in imported_modules(path):
        where = f"{path.relative_to(ROOT)}:{line}: imports {module}"
        target = layer_of_module(module)
        if target is not None and target.startswith("top-level"):
            found.append(f"{where}: passes and runtime install as autopar.passes / autopar.runtime; import them so")
        elif target is not None and target not in ALLOWED[layer]:
            found.append(f"{where}: {RULES[layer]}")
        elif layer == "core" and target is None:
            top = module.split(".")[0]
            if top not in CORE_THIRD_PARTY and top not in sys.stdlib_module_names and top != "__future__":
                found.append(f"{where}: {RULES['core']}")
    return found


def sources() -> list[Path]:
    return sorted(p for folder in ("autopar", "passes", "runtime") for p in (ROOT / folder).rglob("*.py"))


def test_every_layer_has_modules() -> None:
    layers = {layer_of_file(p) for p in sources()}
    assert layers == {"core", "passes", "runtime", "api"}


@pytest.mark.parametrize("layer", ["core", "passes", "runtime"])
def test_layer_imports_only_what_it_may(layer: str) -> None:
    found = [v for p in sources() if layer_of_file(p) == layer for v in violations(p)]
    assert not found, "imports that break the layering:\n" + "\n".join(found)


def test_api_uses_the_installed_names() -> None:
    """Everything (the API, tests, benchmarks) imports ``autopar.passes`` / ``autopar.runtime``, never the folders."""
    paths = [*sources(), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]
    found = [f"{p.relative_to(ROOT)}:{line}: imports {m}" for p in paths for line, m in imported_modules(p)
             if m.split(".")[0] in ("passes", "runtime")]
    assert not found, "import autopar.passes / autopar.runtime instead:\n" + "\n".join(found)


def test_no_two_layers_share_a_module_name() -> None:
    """A module's name says its layer's role: ``passes/zero_graphs.py`` rewrites graphs, ``runtime/zero.py`` runs."""
    by_name: dict[str, list[str]] = {}
    for p in sources():
        if p.stem != "__init__":
            by_name.setdefault(p.stem, []).append(str(p.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"modules of one name in several places: {shared}"


def test_the_checker_catches_a_crossing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "runtime"
    folder.mkdir()
    bad = folder / "bad.py"
    bad.write_text("import torch\n\ndef f():\n    from autopar.passes.zero_graphs import insert_gathers\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setitem(FOLDERS, "runtime", folder)
    assert violations(bad) == [f"{Path('runtime/bad.py')}:4: imports autopar.passes.zero_graphs: {RULES['runtime']}"]


def test_every_package_is_installed() -> None:
    """pyproject lists every package folder, under the name it installs as (a wheel ships only those)."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {p.parent for folder in ("autopar", "passes", "runtime") for p in (ROOT / folder).rglob("__init__.py")}
    expected = {package_of(f / "__init__.py") for f in folders}
    assert set(config["packages"]) == expected
    assert config["package-dir"] == {"autopar.passes": "passes", "autopar.runtime": "runtime"}


TYPED = ("program", "options")  # parameters passes and runtime must type (never Any, never unannotated)


def untyped_parameters(path: Path) -> list[str]:
    """``file:line: parameter`` for each parameter named in ``TYPED`` that is unannotated or typed ``Any``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = fn.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]:
            if arg.arg in TYPED and (arg.annotation is None or _mentions_any(arg.annotation)):
                typed = "unannotated" if arg.annotation is None else f"typed {ast.unparse(arg.annotation)}"
                found.append(f"{path.relative_to(ROOT)}:{arg.lineno}: {fn.name}({arg.arg}) is {typed}; give it "
                             f"the record it reads (a Program, or the fields of Options it needs)")
    return found


def _mentions_any(annotation: ast.expr) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        annotation = ast.parse(annotation.value, mode="eval").body
    return any(isinstance(n, ast.Name) and n.id == "Any" or isinstance(n, ast.Attribute) and n.attr == "Any"
               for n in ast.walk(annotation))


@pytest.mark.parametrize("layer", ["passes", "runtime"])
def test_program_and_options_are_typed(layer: str) -> None:
    found = [v for p in sources() if layer_of_file(p) == layer for v in untyped_parameters(p)]
    assert not found, "parameters read through Any:\n" + "\n".join(found)


def test_the_typing_check_catches_any(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from typing import Any\n\ndef f(x: int, program: Any) -> None: ...\n\n"
                   "def g(*, options) -> None: ...\n\ndef h(options: 'Any | None', program: int) -> None: ...\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [v.split(" is ")[0] for v in untyped_parameters(bad)] == ["bad.py:3: f(program)", "bad.py:5: g(options)",
                                                                     "bad.py:7: h(options)"]


def module_of(path: Path) -> str:
    return package_of(path) if path.stem == "__init__" else f"{package_of(path)}.{path.stem}"


def runtime_imports(path: Path, modules: set[str], *, annotations: bool = False) -> set[str]:
    """The autopar modules ``path`` imports when it runs: at module level or inside functions, and those under
    ``if TYPE_CHECKING:`` (annotations only) when ``annotations``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                   and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
                   for stmt in block.body for n in ast.walk(stmt)} if not annotations else set()
    lines = {n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in typing_only}
    by_line: dict[int, set[str]] = {}
    for line, module in imported_modules(path, submodules=True):
        while module and module not in modules:
            module = module.rpartition(".")[0]
        if line in lines and module:
            by_line.setdefault(line, set()).add(module)
    # ``from autopar.planner import recompute_cost`` imports the submodule, not the package's names
    return {m for found in by_line.values() for m in found if not any(o.startswith(m + ".") for o in found)}


def import_cycles(paths: list[Path], *, annotations: bool = False) -> list[list[str]]:
    """Each cycle of modules (a package's ``__init__`` one of them) that import one another (depth-first search
    over ``runtime_imports``)."""
    by_name = {module_of(p): p for p in paths}
    graph = {m: runtime_imports(p, set(by_name), annotations=annotations) - {m} for m, p in by_name.items()}
    cycles, state = [], {}  # state: 1 on the current path, 2 done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(path[path.index(d):] + [d])
            elif d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_module_imports_back_up() -> None:
    """No circle of imports, counting those hidden inside functions: a generator table or a module of shared
    types breaks a circle, a function-level import only hides it."""
    cycles = import_cycles(sources())
    assert not cycles, "modules that import one another:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_circle_through_annotations() -> None:
    """Nor through imports for annotations only (``if TYPE_CHECKING:``): a reader follows those too; the types
    two modules share live in a module below both (``planner/result.py``, ``compiler/precision.py``)."""
    cycles = import_cycles(sources(), annotations=True)
    assert not cycles, "modules whose annotations import one another:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_checker_sees_an_import_inside_a_function(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "autopar" / "core"
    folder.mkdir(parents=True)
    (folder / "a.py").write_text("from autopar.core.b import g\n")
    (folder / "b.py").write_text("def g():\n    from autopar.core.a import f\n")
    (folder / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autopar.core.a import f\n")
    (folder / "d.py").write_text("from autopar.core.c import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert import_cycles(sorted(folder.glob("*.py"))) == [["autopar.core.a", "autopar.core.b", "autopar.core.a"]]
    (folder / "a.py").write_text("from autopar.core.d import y\n")
    assert import_cycles(sorted(folder.glob("*.py"))) == []
    assert import_cycles(sorted(folder.glob("*.py")), annotations=True) == [
        ["autopar.core.a", "autopar.core.d", "autopar.core.c", "autopar.core.a"]]
