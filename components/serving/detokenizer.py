"""Incremental detokenization: token ids → text deltas for one streamed generation, with stop
strings (and stop token ids, when the serving layer rather than the engine ends on them).

``TextStream.push(tokens)`` takes each round's new tokens and returns the text that may be sent
now. Text is decoded from all tokens so far (so a character split over two byte-level tokens
comes out whole), and two things are held back until the next tokens decide them:

* a trailing replacement character (an incomplete UTF-8 sequence);
* a tail that is the beginning of a stop string (``"\\n\\nUs"`` while ``"\\n\\nUser:"`` is a stop
  string): a stop string is matched on the decoded text across token boundaries and no part
  of it ever leaks into a delta.

When a stop string is found, the text before it (or through it, with ``include_stop``) is the
last delta, ``stopped`` is set and ``stop_at_token`` says how many tokens the output has then.
``finish()`` releases whatever was held back when the generation ends otherwise.

Given ``stop_token_ids``, the first of them after ``min_tokens`` tokens ends the output the same
way (the token kept, as the engine keeps it); earlier ones do not.

Knows a tokenizer's ``decode``; nothing about the engine, HTTP or the OpenAI schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    """Incremental detokenization of one generation (see the module docstring)."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = (), include_stop: bool = False,
                 skip_special_tokens: bool = True, stop_token_ids: Sequence[int] = (), min_tokens: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.stop_ids, self.min_tokens = frozenset(int(t) for t in stop_token_ids), int(min_tokens)
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = []
        self.sent = ""  # text already returned
        self.stopped: str | None = None  # the stop string (or the stop token's text) that ended it
        self.stop_at_token: int | None = None  # tokens in the output when it stopped

    def push(self, tokens: Sequence[int]) -> str:
        """The next delta after ``tokens`` (may be empty); nothing after a stop string."""
        if self.stopped is not None:
            return ""
        if not self.stop and not self.stop_ids:
            self.tokens += [int(t) for t in tokens]
            return self._emit(self._decode().rstrip(REPLACEMENT))
        for token in tokens:  # token by token: a stop string or id ends the output at its token
            self.tokens.append(int(token))
            text = self._decode()
            if int(token) in self.stop_ids and len(self.tokens) > self.min_tokens:
                self.stopped, self.stop_at_token = self.tokenizer.decode([int(token)]), len(self.tokens)
                return self._emit(text)
            hit = self._find_stop(text)
            if hit is not None:
                return self._stop_at(text, *hit)
        return self._emit(self._safe_prefix(self._decode()))

    def finish(self) -> str:
        """Whatever was held back, at the end of a generation that no stop string ended."""
        if self.stopped is not None:
            return ""
        return self._emit(self._decode())

    @property
    def text(self) -> str:
        return self.sent

    # ------------------------------------------------------------------ internals
    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=self.skip_special_tokens)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(where, stop string) of the earliest stop string in ``text`` not already sent past."""
        start = max(0, len(self.sent) - max((len(s) for s in self.stop), default=0))
        found = [(i, s) for s in self.stop if (i := text.find(s, start)) >= 0]
        return min(found) if found else None

    def _stop_at(self, text: str, where: int, stop: str) -> str:
        self.stopped, self.stop_at_token = stop, len(self.tokens)
        end = where + len(stop) if self.include_stop else where
        return self._emit(text[:end])

    def _safe_prefix(self, text: str) -> str:
        """``text`` less a trailing incomplete character and less a tail that may begin a stop string."""
        text = text.rstrip(REPLACEMENT)
        hold = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold]

    def _emit(self, upto: str) -> str:
        """The part of ``upto`` not sent yet. Text never shrinks: what was sent stays sent (a
        tokenizer that rewrites earlier text once more tokens come is followed by length)."""
        delta = upto[len(self.sent):]
        self.sent += delta
        return delta
