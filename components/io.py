"""Atomic artifacts: write everything into a temporary sibling, then rename.

A crash (or Ctrl-C) while writing never leaves a half-written file or directory at the final
path, and an existing one is replaced only once the new one is complete. Knows files, JSON and
safetensors; nothing about what the tensors mean.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

WEIGHTS = "model.safetensors"


def replace_dir(tmp: Path, path: Path) -> None:
    """Moves the finished ``tmp`` to ``path``; a previous ``path`` is set aside, then removed."""
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)


def write_text(path: Path, text: str) -> None:
    """``text`` at ``path`` (parents made), written to a temporary sibling and renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_checkpoint_dir(path: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                         weights_name: str = WEIGHTS) -> Path:
    """``config.json`` + safetensors weights at ``path``, written atomically; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / weights_name),
                  metadata={"format": "pt", "producer": "specline"})
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
