"""Atomic single files (``io.write_text``): the final path holds the old text or the new, never a half."""

from __future__ import annotations

import os

import pytest

from components.io import write_text


def test_write_text_makes_parents_replaces_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a" / "b.json"
    write_text(path, "first")
    write_text(path, "second")
    assert path.read_text() == "second"
    assert [p.name for p in path.parent.iterdir()] == ["b.json"]


def test_a_write_that_fails_before_the_rename_keeps_the_old_text(tmp_path, monkeypatch):
    path = tmp_path / "b.json"
    write_text(path, "old")

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        write_text(path, "new")
    assert path.read_text() == "old"
