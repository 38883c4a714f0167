"""Config paths made absolute once, where a config is built.

A config field that names a file or directory declares what kind of value it holds, with
:func:`path_field`; the config dataclasses call :func:`make_absolute` in their ``__post_init__``,
so every config object, whether loaded from YAML in the driver or built in code, holds absolute
paths from the moment it exists. Ray tasks, actors and Train workers run in directories of Ray's
own: a relative path read there would name the wrong place, and nothing downstream resolves a
config path again.

Relative paths are taken relative to the working directory at construction (where the command
was started); ``~`` is expanded. Making a value absolute twice changes nothing, so copies made
with ``dataclasses.replace`` (also in a worker) keep their values.

The kinds:

* ``PATH``: always a filesystem path.
* ``MODEL``: a built-in target name, a hub id, or a local directory; a path only when it looks
  like one (starts with ``.``, ``/`` or ``~``, or exists).
* ``SOURCE``: a prompt source: a built-in name, ``hf:<dataset dir or hub id>[:split]`` or a file.
* ``URI``: an MLflow tracking URI: a local path, ``file:`` or ``sqlite:///`` (made absolute) or a
  server's address (left as it is).

Knows dataclass fields and the filesystem; nothing about stages, Ray or what the paths hold.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

PATH, MODEL, SOURCE, URI = "path", "model", "source", "uri"
KINDS = (PATH, MODEL, SOURCE, URI)
_KEY = "path_kind"  # the dataclass field metadata key
# Values of MODEL and SOURCE fields that are names, never paths (built-in targets and sources).
NAMES = frozenset({"embedded", "tiny", "smollm2", "auto", "none", ""})
UNRESOLVED = "${"  # an interpolation a config built in code still carries (``${run_dir}/data``)


def path_field(default: str | None, kind: str = PATH) -> Any:
    """A dataclass field holding a path of ``kind`` (see the module docstring)."""
    assert kind in KINDS, kind
    return dataclasses.field(default=default, metadata={_KEY: kind})


def path_fields(obj: Any) -> dict[str, str]:
    """``{field name: kind}`` of ``obj``'s path fields (a dataclass instance or type)."""
    return {f.name: f.metadata[_KEY] for f in dataclasses.fields(obj) if _KEY in f.metadata}


def absolute(value: str | None, kind: str, base: Path | None = None) -> str | None:
    """``value`` with its path part absolute against ``base`` (default: the working directory)."""
    if value is None or value in NAMES or UNRESOLVED in value:
        return value
    base = Path.cwd() if base is None else base
    if kind == PATH:
        return _path(value, base)
    if kind == MODEL:
        return _path(value, base) if _looks_like_path(value, base) else value
    if kind == SOURCE:
        if value.startswith("hf:"):
            name, sep, split = value[3:].partition(":")
            return f"hf:{_path(name, base) if _looks_like_path(name, base) else name}{sep}{split}"
        return _path(value, base)
    return _uri(value, base)


def make_absolute(obj: Any, base: Path | None = None) -> None:
    """Sets every path field of the dataclass instance ``obj`` (under construction) absolute."""
    for name, kind in path_fields(obj).items():
        object.__setattr__(obj, name, absolute(getattr(obj, name), kind, base))


def unresolved(obj: Any, prefix: str = "") -> list[str]:
    """``key=value`` of every path field in the dataclass ``obj`` and its sections that is set and
    not absolute (or still interpolated): empty for a config made by :func:`make_absolute`."""
    found = [f"{prefix}{name}={value!r}" for name, kind in path_fields(obj).items()
             if (value := getattr(obj, name)) is not None
             and (UNRESOLVED in value or absolute(value, kind, Path("/nonexistent")) != value)]
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            found += unresolved(value, f"{prefix}{f.name}.")
    return found


def _path(value: str, base: Path) -> str:
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def _looks_like_path(value: str, base: Path) -> bool:
    return value.startswith((".", "/", "~")) or (base / value).exists()


def _uri(value: str, base: Path) -> str:
    for prefix in ("sqlite:///", "file://", "file:"):
        if value.startswith(prefix):
            rest = value[len(prefix):]
            if prefix == "file://" or rest.startswith("/"):  # file:///abs, sqlite:////abs
                return value
            return f"{prefix}{_path(rest, base)}" if prefix == "sqlite:///" else Path(_path(rest, base)).as_uri()
    if "://" in value:  # a server: http(s)://, databricks://, postgresql://...
        return value
    return _path(value, base)
