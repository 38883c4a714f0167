"""A Ctrl-C that a library swallows is still seen: ``check`` raises it again."""

from __future__ import annotations

import os
import signal
import time

import pytest

from components import interrupts


def _ctrl_c_swallowed() -> None:
    """SIGINT to this process, landing in code that drops the KeyboardInterrupt (as a
    ``__del__`` or a broad ``except`` in a library does)."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)  # the handler runs at the next bytecode; the sleep is cut short by it
        pytest.fail("no KeyboardInterrupt raised")
    except KeyboardInterrupt:
        pass


def test_a_swallowed_ctrl_c_is_raised_again_by_check_and_forgotten_after_the_block():
    before = signal.getsignal(signal.SIGINT)
    with interrupts.sticky_ctrl_c():
        interrupts.check()  # nothing seen yet
        _ctrl_c_swallowed()
        assert interrupts.seen()
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
    assert signal.getsignal(signal.SIGINT) is before
    assert not interrupts.seen()
    interrupts.check()


def test_the_handler_raises_as_pythons_own_does():
    with interrupts.sticky_ctrl_c(), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)
