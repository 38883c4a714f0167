"""Command-line plumbing shared by every ``python -m pipelines.<stage>`` entry point.

Parses ``conf=<file> key=value ...``, turns the known user errors into one clear line on
stderr (exit status 2) instead of a traceback, and prints the stage's result as JSON.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from components.config import ConfigError, SpeclineConfig, load_cli
from components.target.corpus import CorpusError
from components.target.hf import TargetError
from components.target.smollm2 import ConversionError
from components.tracking import Tracker

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, TargetError, CorpusError, ConversionError)

StageFn = Callable[[SpeclineConfig, Tracker, dict[str, Any]], dict[str, Any]]


def main(stage: StageFn, name: str, argv: Sequence[str] | None = None) -> int:
    """Runs ``stage`` as a top-level MLflow run; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_cli(argv)
        tracker = Tracker(cfg)
        with tracker.run(name):
            result = stage(cfg, tracker, {})
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str))
    return 0
