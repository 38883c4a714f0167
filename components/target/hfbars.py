"""transformers' own progress bars ("Loading weights", "Writing model shards", the GGUF
de-quantizing bar) off for a block: only specline's own bars and lines reach the console.
Knows transformers' logging switch; nothing about models."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def no_hf_bars() -> Iterator[None]:
    """transformers' progress bars off for the block, then as before."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()
