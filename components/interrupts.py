"""Ctrl-C that is not lost.

Python turns SIGINT into a ``KeyboardInterrupt`` wherever the main thread happens to be. Where
that is inside a ``__del__``, a weakref or GC callback, or a library's ``except BaseException``
that does not re-raise, the interpreter prints "Exception ignored" (or nothing) and the run goes
on as if no one had pressed Ctrl-C: a data stage then generates to its end. So a stage remembers
the signal: :func:`sticky_ctrl_c` installs a handler that records it and then raises as Python's
own does, and :func:`check` raises ``KeyboardInterrupt`` again between units of work (after a
shard, after a stage) if one was seen.

Knows signals only; nothing of stages, Ray or what a unit of work is.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

_SEEN = threading.Event()


def _record_and_raise(signum: int, frame: FrameType | None) -> None:
    _SEEN.set()
    signal.default_int_handler(signum, frame)  # raises KeyboardInterrupt, as Python's own handler does


@contextmanager
def sticky_ctrl_c() -> Iterator[None]:
    """Within the block, a Ctrl-C is recorded before it raises; the previous handler comes back
    after. Off the main thread (where Python allows no handler) only :func:`check` is inert."""
    _SEEN.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _record_and_raise)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _SEEN.clear()


def seen() -> bool:
    """Whether a Ctrl-C landed since the block began."""
    return _SEEN.is_set()


def check() -> None:
    """Raises ``KeyboardInterrupt`` if a Ctrl-C landed since the block began, even if the one
    Python raised was swallowed on its way up."""
    if _SEEN.is_set():
        raise KeyboardInterrupt("interrupted (Ctrl-C)")
