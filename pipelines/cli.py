"""Command-line plumbing shared by every ``python -m pipelines.<stage>`` entry point.

Parses ``conf=<file> key=value ... [-v|--verbose]``, opens the run's log session
(``components.logs``: the console shows one line per stage start and end with its wall time and
headline figure, ``<run_dir>/logs/<timestamp>-<name>.log`` gets everything; ``-v`` is
``log_level=verbose``), turns the known user errors into one clear line on stderr (exit status
2) and Ctrl-C into the stage's "interrupted" line (exit status 130) instead of a traceback, and
prints the stage's result as JSON on stdout. A Ctrl-C is remembered (``components.interrupts``):
one that a library swallowed still stops the run after the stage it landed in.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from components import interrupts, logs, reuse
from components.config import ConfigError, SpeclineConfig
from components.confload import load_cli
from components.drafters.errors import DrafterError
from components.target.corpus import CorpusError
from components.target.hf import TargetError
from components.target.smollm2 import ConversionError
from components.tracking import Tracker
from pipelines.headlines import duration, headline, plan

USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, TargetError, CorpusError, ConversionError, DrafterError)
VERBOSE_FLAGS = ("-v", "--verbose")
INTERRUPTED = 130  # exit status after Ctrl-C (128 + SIGINT), as shells report it

StageFn = Callable[[SpeclineConfig, Tracker, dict[str, Any]], dict[str, Any]]

log = logging.getLogger(logs.CONSOLE_LOGGER)


def split_flags(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``-v``/``--verbose`` turned into the override ``log_level=verbose``."""
    rest = [a for a in argv if a not in VERBOSE_FLAGS]
    return rest + [f"log_level={logs.VERBOSE}"] if len(rest) < len(argv) else rest


def run_stage(name: str, stage: StageFn, cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any],
              step: str = "", run_id: str | None = None) -> dict[str, Any]:
    """``stage(cfg, tracker, upstream)`` between a start line and an end line (wall time, headline),
    or, where its output exists for the same inputs (``components.reuse``), that output and one line."""
    logs.adopt_library_loggers()  # a library imported since the last stage brought its own handler
    decision = reuse.decide(name, cfg, upstream)
    if decision is not None and decision.reuse:
        return _reused(decision, tracker, upstream, step)
    what = " ".join(p for p in (plan(name, cfg), f"({decision.why})" if decision and decision.why else "") if p)
    log.info("%s%s …%s", step, name, f" {what}" if what else "")
    if decision is not None:
        tracker.set_tags({"reused": "false", "specline.stage_key": decision.key})
        removed = reuse.begin(decision, cfg)
        if removed:
            log.info("%s%s: removed the earlier output %s", step, name, ", ".join(removed), extra=logs.FILE_ONLY)
    t0 = time.perf_counter()
    try:
        out = stage(cfg, tracker, upstream)
        if decision is not None:
            reuse.complete(decision, upstream, out, run_id, time.perf_counter() - t0)
        interrupts.check()  # a Ctrl-C that a library swallowed: the output is whole (and recorded); stop here
    except BaseException as err:
        _failed(f"{step}{name}", time.perf_counter() - t0, err)
        raise
    line = headline(name, out)
    log.info("%s%s done in %s%s", step, name, duration(time.perf_counter() - t0), f": {line}" if line else "")
    return out


def _reused(decision: reuse.Decision, tracker: Tracker, upstream: dict[str, Any], step: str) -> dict[str, Any]:
    """The recorded output of a stage, one console line, and its MLflow run tagged as a reuse."""
    out = reuse.reused(decision, upstream)
    record = decision.record or {}
    tracker.set_tags({"reused": "true", "specline.stage_key": decision.key,
                      "specline.reused_from_run": record.get("run_id") or "", "specline.record": decision.record_path})
    tracker.log_dict(record, "stage_record.json")
    line = headline(decision.stage, out)
    log.info("%s%s reused%s (%s; force=[%s] reruns)", step, decision.stage, f": {line}" if line else "",
             decision.why, decision.stage)
    return out


def _failed(what: str, seconds: float, err: BaseException) -> None:
    """The end line of a stage that raised (its traceback goes to the log file only)."""
    if isinstance(err, KeyboardInterrupt):
        log.info("%s interrupted after %s", what, duration(seconds))
        return
    text = f"{type(err).__name__}: {err}".strip().splitlines()[0]
    # a user error is printed once, as main's one "error:" line; the file keeps its traceback
    extra = logs.FILE_ONLY if isinstance(err, USER_ERRORS) else None
    where = f"; full log: {logs.log_file()}" if logs.log_file() else ""
    log.error("%s failed after %s: %s%s", what, duration(seconds), text, where, exc_info=err, extra=extra)


def _tracker(cfg: SpeclineConfig) -> Tracker:
    """The run's Tracker, with MLflow's loggers adopted by the log session before its store starts
    (importing mlflow installs MLflow's own console handler)."""
    if cfg.tracking.enabled:
        import mlflow  # noqa: F401

        logs.adopt_library_loggers()
    return Tracker(cfg)


def main(stage: StageFn, name: str, argv: Sequence[str] | None = None) -> int:
    """Runs ``stage`` as a top-level MLflow run; returns the process exit status."""
    argv = split_flags(sys.argv[1:] if argv is None else argv)
    try:
        cfg = load_cli(argv)
        with interrupts.sticky_ctrl_c(), logs.session(cfg, name) as path:
            hint = "" if cfg.log_level == logs.VERBOSE else " (-v: everything on the console)"
            log.info("specline %s: full log in %s%s", name, path, hint)
            tracker = _tracker(cfg)
            with tracker.run(name) as run_id:
                result = run_stage(name, stage, cfg, tracker, {}, run_id=run_id)
            text = json.dumps(result, indent=2, default=str)
            log.info("result:\n%s", text, extra=logs.FILE_ONLY)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the stage's end line said so; what it wrote is whole (a rerun resumes)
        return INTERRUPTED
    print(text)
    return 0
