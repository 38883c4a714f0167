"""The engine's layout: every package's docstring maps every module in it, and no file grows
past what a reader takes in at once (``tests/components/test_imports.py`` checks for circles)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "components" / "engine"


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
