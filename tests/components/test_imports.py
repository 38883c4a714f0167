"""No import circle anywhere in ``components/``, read off the source (no imports run).

An edge is ``module → the components module it imports``, at the top of a file or inside a
function; imports under ``if TYPE_CHECKING:`` are annotations only and followed by one test
only, which holds them to the same rule (a type is imported from where it lives). ``from
package import name`` points at the submodule ``name`` when there is one, else at the package's
``__init__``. A package's ``__init__`` may re-export its modules; a module that imports its own
package's ``__init__`` would close a circle and is reported like any other."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import components

ROOT = Path(components.__file__).parent


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_imports(tree: ast.AST) -> list[ast.AST]:
    """Import nodes outside ``if TYPE_CHECKING:`` blocks."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in skip]


def all_imports(tree: ast.AST) -> list[ast.AST]:
    """Every import node, those under ``if TYPE_CHECKING:`` too."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_graph(imports=runtime_imports) -> dict[str, set[str]]:
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif node.module:
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def test_the_graph_sees_the_engine():
    graph = import_graph()
    assert graph.get("components.engine.chain")


def test_no_import_circle_in_components():
    try:
        list(TopologicalSorter(import_graph()).static_order())
    except CycleError as err:
        raise AssertionError(f"import circle in components/: {' -> '.join(err.args[1])}") from None


def test_no_import_circle_even_through_type_only_imports():
    """Annotations import from where a type lives, never from a module that imports them back."""
    try:
        list(TopologicalSorter(import_graph(all_imports)).static_order())
    except CycleError as err:
        raise AssertionError(f"type-only import circle in components/: {' -> '.join(err.args[1])}") from None


def test_components_never_import_the_stages():
    """``pipelines/`` builds on ``components/``, never the other way (Ray workers ship components only)."""
    upward = [f"{path.relative_to(ROOT.parent)}:{node.lineno}" for path in ROOT.rglob("*.py")
              for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "pipelines" for a in node.names)
              or isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pipelines"]
    assert upward == []
