"""mindrlhf/ imports only downward: no import circle, and a model knows no layout (docs/design.md's module table).

Every ``import`` and ``from ... import`` counts: at module level, inside a function (a function-level import is how
a circle hides from the interpreter) and under ``if TYPE_CHECKING:`` (a type is a dependency too), relative imports
resolved. An edge goes to the module named, not to its parent packages: ``from mindrlhf.models.family import X``
depends on ``mindrlhf.models.family`` only.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, List, Set

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "mindrlhf"


def _module_files(package: Path) -> Dict[str, Path]:
    """Dotted module name -> file, for every module under ``package`` (a package is its ``__init__.py``)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _owner(name: str, modules: Dict[str, Path]) -> str:
    """The longest prefix of ``name`` that is one of ``modules`` ('' for a third-party or standard name)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


@functools.lru_cache(maxsize=None)
def import_graph(package: Path = PKG) -> Dict[str, Set[str]]:
    """Module -> the modules of ``package`` it imports anywhere in its file (each package parsed once)."""
    modules = _module_files(package)
    graph: Dict[str, Set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package[: len(package) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # ``from pkg import sub`` imports the submodule ``pkg.sub``; ``from mod import name`` imports ``mod``.
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            else:
                continue
            graph[name] |= {owner for owner in (_owner(t, modules) for t in targets) if owner and owner != name}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_checker_sees_function_level_relative_and_type_checking_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "from pkg import a\n",                          # the submodule pkg.a, not the package
        "a.py": "def f():\n    from .sub import b\n",                  # relative, inside a function
        "sub/__init__.py": "",
        "sub/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n",
        "c.py": "import os\nimport pkg.a as alias\n",                 # closes the circle a -> sub.b -> c -> a
    }
    for name, text in files.items():
        (pkg / name).write_text(text, encoding="utf-8")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.sub.b"}, "pkg.sub": set(), "pkg.sub.b": {"pkg.c"},
                     "pkg.c": {"pkg.a"}}
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    # On the real package: models/__init__.py imports checkpoint.hf_io inside load_model only.
    assert "mindrlhf.checkpoint.hf_io" in import_graph()["mindrlhf.models"]


def test_no_import_circle_in_mindrlhf():
    found = cycles(import_graph())
    assert not found, "import circles in mindrlhf/ (each line one strongly connected component):\n" + "\n".join(
        " <-> ".join(component) for component in found)


def test_no_model_imports_a_layout_or_a_tool():
    """design.md: models/ never imports parallel/ or tools/ (a model knows no layout; tools are command lines)."""
    crossed = {name: sorted(t for t in targets if t.startswith(("mindrlhf.parallel", "mindrlhf.tools")))
               for name, targets in import_graph().items() if name.split(".")[:2] == ["mindrlhf", "models"]}
    assert not {name: targets for name, targets in crossed.items() if targets}, {
        name: targets for name, targets in crossed.items() if targets}


def test_no_code_edits_sys_path():
    """docs/CONTRIBUTING.md: the package, examples, tools and bench import the installed package, and the tests'
    helpers come through ``pythonpath = tests``; a bench script's sibling is found because ``python bench/x.py``
    puts bench/ first on the module path."""
    edits = []
    for folder in ("mindrlhf", "bench", "examples", "tests", "scripts", ".ci"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if any(part.startswith(".") for part in path.relative_to(REPO / folder).parts):
                continue  # an environment or cache inside (bench/.venv-trl, which bench/README.md has one create)
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            edits += [f"{path.relative_to(REPO)}:{node.lineno}" for node in ast.walk(tree)
                      if isinstance(node, ast.Attribute) and node.attr == "path"
                      and isinstance(node.value, ast.Name) and node.value.id == "sys"]
    assert not edits, "sys.path used at " + ", ".join(edits)
