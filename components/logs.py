"""Where a run's output goes: a few lines a person can follow on the console, everything in a file.

:func:`session` opens ``<run_dir>/logs/<YYYYmmdd-HHMMSS>-<name>.log`` and puts two handlers on
the root logger for the length of a run:

* the **file** gets every record at INFO and above from every logger: ours, the libraries'
  (Ray, Ray Data, transformers, MLflow), Python warnings, and the output of Ray's workers that
  :mod:`components.cluster` hands to :data:`WORKER_LOGGER`;
* the **console** (stderr) gets what a person follows: the records of ``specline.*`` loggers
  (stage lines, see ``pipelines.cli``), warnings of our own modules (``components.*``,
  ``pipelines.*``) and errors. With ``log_level: verbose`` (``-v``) it gets every record at INFO
  and above, and Ray prints its workers' output itself, as by default.

Progress bars (tqdm) and the stages' own ``print`` lines write to stderr directly and stay on
the console either way. Libraries that bring their own console handler are made to propagate to
ours instead (:func:`adopt_library_loggers`); one imported later is adopted when Ray starts and
before each stage. The handlers on the root logger are the only state: :func:`console_level`
reads the level back from them.

Knows Python logging, the ``log_level`` key and the names of some libraries' loggers; nothing
about Ray's API, stages or MLflow.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from components.config import ConfigError, SpeclineConfig, run_dir

INFO, VERBOSE = "info", "verbose"
LEVELS = (INFO, VERBOSE)  # values of SpeclineConfig.log_level
CONSOLE_LOGGER = "specline"  # the lines a person follows (stage starts and ends)
PROJECT_LOGGERS = ("components", "pipelines")  # our modules' loggers: their warnings are for a person
WORKER_LOGGER = "specline.workers"  # Ray workers' stdout/stderr, streamed to the driver: file only
FILE_ONLY = {"file_only": True}  # ``extra=`` of a record for the file alone (e.g. a stage's result)
# A worker line that starts with this is progress for a person (e.g. the train stage's rank 0
# every train.log_every steps): the driver shows it on the console as a stage line (cluster.py).
PROGRESS_MARK = "[specline progress] "


def progress_line(text: str) -> str:
    """What a Ray worker prints (flushed) for the driver to show ``text`` on the console."""
    return PROGRESS_MARK + text
# Libraries that install a console handler of their own and stop propagation.
LIBRARY_LOGGERS = ("ray", "ray.data", "ray.train", "ray.tune", "ray.serve", "transformers", "mlflow",
                   "alembic")
FILE_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def check_level(level: str) -> str:
    """``level`` if it is a ``log_level``, else a ConfigError that lists them."""
    if level not in LEVELS:
        raise ConfigError(f"log_level: '{level}' is not one of {list(LEVELS)} "
                          "(info: stage lines on the console, everything in the log file; verbose: all of it "
                          "on the console too)")
    return level


def log_path(root: Path, name: str, now: float | None = None) -> Path:
    """``<root>/logs/<YYYYmmdd-HHMMSS>-<name>.log`` (not created)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(time.time() if now is None else now))
    return root / "logs" / f"{stamp}-{name}.log"


class ConsoleHandler(logging.Handler):
    """Writes to whatever ``sys.stderr`` is at emit time; lets through what ``level`` shows."""

    def __init__(self, level: str):
        super().__init__(logging.INFO)
        self.console_level = check_level(level)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "file_only", False) or _within(record.name, WORKER_LOGGER):
            return False  # worker output: on the console only as Ray prints it itself (verbose)
        return self._shown(record) and bool(super().filter(record))

    def _shown(self, record: logging.LogRecord) -> bool:
        if _within(record.name, CONSOLE_LOGGER) or self.console_level == VERBOSE or record.levelno >= logging.ERROR:
            return True
        return record.levelno >= logging.WARNING and any(_within(record.name, p) for p in PROJECT_LOGGERS)

    def format(self, record: logging.LogRecord) -> str:
        clock = time.strftime("%H:%M:%S", time.localtime(record.created))
        if _within(record.name, CONSOLE_LOGGER) and record.levelno < logging.WARNING:
            return f"{clock} {record.getMessage()}"
        return f"{clock} {record.levelname} {record.name}: {record.getMessage()}"  # tracebacks: file only

    def emit(self, record: logging.LogRecord) -> None:
        try:
            sys.stderr.write(self.format(record) + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 -- logging must never take the run down
            self.handleError(record)


class RunFileHandler(logging.FileHandler):
    """The run's log file (a class of its own so that a session finds and removes its handlers)."""


def _within(name: str, parent: str) -> bool:
    return name == parent or name.startswith(parent + ".")


def _ours(handler: logging.Handler) -> bool:
    return isinstance(handler, (ConsoleHandler, RunFileHandler))


def log_file() -> Path | None:
    """The log file of the session in progress; None outside one."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, RunFileHandler):
            return Path(handler.baseFilename)
    return None


def console_level() -> str | None:
    """The ``log_level`` of the session in progress; None outside one."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, ConsoleHandler):
            return handler.console_level
    return None


def adopt_library_loggers(names: tuple[str, ...] = LIBRARY_LOGGERS) -> None:
    """Within a session: the named loggers lose their own console handlers and propagate to ours
    (their file handlers stay). Outside one: nothing (libraries keep their usual output)."""
    if console_level() is None:
        return
    for name in names:
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                logger.removeHandler(handler)
        logger.propagate = True
        if name == "ray" and logger.level > logging.INFO:
            logger.setLevel(logging.INFO)  # Ray's INFO lines belong in the file


def _remove_ours(root: logging.Logger) -> None:
    for handler in [h for h in root.handlers if _ours(h)]:
        root.removeHandler(handler)
        handler.close()


@contextlib.contextmanager
def session(cfg: SpeclineConfig, name: str) -> Iterator[Path]:
    """Console and file handlers on the root logger for a run named ``name``; yields the file."""
    level = check_level(cfg.log_level)
    path = log_path(run_dir(cfg), name)
    path.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    _remove_ours(root)  # a previous session in this process that did not end (tests)
    file_handler = RunFileHandler(path, encoding="utf-8")
    file_handler.setLevel(logging.INFO)
    file_handler.setFormatter(logging.Formatter(FILE_FORMAT))
    saved_level = root.level
    root.setLevel(logging.INFO)
    root.addHandler(file_handler)
    root.addHandler(ConsoleHandler(level))
    logging.captureWarnings(True)  # warnings.warn → the "py.warnings" logger → the file
    adopt_library_loggers()
    try:
        yield path
    finally:
        logging.captureWarnings(False)
        _remove_ours(root)
        root.setLevel(saved_level)
