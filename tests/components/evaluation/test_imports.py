"""components.evaluation's modules import each other without a circle (read off the source, no
imports run): each module's place is fixed, ``context`` below ``methods`` and ``vllm_peers``."""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import components.evaluation

PACKAGE = "components.evaluation"


def imports_within(package_dir: Path, package: str) -> dict[str, set[str]]:
    """module → the package's modules it imports (at the top or inside functions)."""
    modules = {p.stem: p for p in package_dir.glob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == package:  # `from package import x`
                names = [f"{package}.{a.name if a.name in modules else '__init__'}" for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            found |= {n.removeprefix(package + ".").split(".")[0] for n in names if n.startswith(package + ".")}
        graph[name] = found & set(modules) - {name}
    return graph


def test_no_import_circle_in_evaluation():
    graph = imports_within(Path(components.evaluation.__file__).parent, PACKAGE)
    del graph["__init__"]  # the package re-exports its modules; none of them imports it
    assert not any("__init__" in deps for deps in graph.values())
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as err:
        raise AssertionError(f"import circle in {PACKAGE}: {err.args[1]}") from None
    assert order.index("context") < min(order.index("methods"), order.index("vllm_peers"))
