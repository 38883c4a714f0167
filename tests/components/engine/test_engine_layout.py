"""The engine's layout: its modules import one another without a circle, every package's
docstring maps every module in it, and no file grows past what a reader takes in at once."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "components" / "engine"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_imports(path: Path) -> set[str]:
    """The ``components.engine`` modules ``path`` imports when it is imported (not under
    ``if TYPE_CHECKING``, not inside functions)."""
    found = set()
    for node in ast.parse(path.read_text()).body:
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
        found |= {n for n in names if n.startswith("components.engine")}
    return found


def test_no_import_circle():
    """Explicit imports only: a submodule importing from its own package's ``__init__`` (which
    imports the submodules) is a circle, and so found."""
    graph = {module_name(p): engine_imports(p) for p in ENGINE.rglob("*.py")}
    state: dict[str, str] = {}

    def visit(mod: str, path: list[str]) -> None:
        if state.get(mod) == "done":
            return
        assert state.get(mod) != "open", "import circle: " + " -> ".join(path + [mod])
        state[mod] = "open"
        for dep in sorted(graph.get(mod, ())):
            visit(dep, path + [mod])
        state[mod] = "done"

    for mod in sorted(graph):
        visit(mod, [])


def test_every_package_docstring_maps_its_modules():
    for init in ENGINE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        members = [p.stem for p in init.parent.glob("*.py") if p.stem != "__init__"]
        members += [p.name + "/" for p in init.parent.iterdir() if (p / "__init__.py").is_file()]
        missing = [m for m in members if f"``{m}``" not in doc]
        assert not missing, f"{init.relative_to(ROOT)} does not map {missing}"


def test_files_stay_readable():
    long = [f"{p.relative_to(ROOT)}: {n}" for p in ENGINE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500]
    assert not long, long
