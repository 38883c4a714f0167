"""The batch engine's records: a ``Request`` as it comes in, a ``StepOutput`` per round and
request, a ``Row`` (one admitted request: its sequence state, randomness and this round's
drafts) and the ``Batch`` of rows with their shared ragged cache.

Every collaborator of ``continuous.BatchEngine`` (admission, drafting, tree rounds) receives
these as arguments. Knows sequences, rules, proposals and survival estimates as values; does no
model work.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING, Proposal
from components.engine.adaptive.rows import RowSurvival
from components.engine.cache.ragged import RaggedCache
from components.engine.cache.slots import SlotCache
from components.engine.core import GenerationResult, SequenceState
from components.engine.rules import RULES, RoundRandomness, Rule
from components.spec.sampling import SamplingParams

_ids = itertools.count()


@dataclass
class Request:
    """One generation request as the batch engine takes it (token ids in, token ids out)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = DEFAULT_SAMPLING
    seed: int = 0
    rule: str = "greedy"
    stop_token_ids: tuple[int, ...] = ()
    speculate: bool = True  # False: plain decoding for this request (one token per round)
    request_id: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            self.request_id = f"req-{next(_ids)}"
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id}: prompt_ids is empty (at least one token needed)")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.rule not in RULES:
            raise ValueError(f"request {self.request_id}: rule '{self.rule}' is not one of {sorted(RULES)}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    def check_end(self, tokens: list[int], fresh: int) -> tuple[list[int], str | None]:
        """(tokens kept, finish reason or None): the first stop token among tokens[fresh:] ends the
        request (kept in the output); else reaching max_new_tokens does."""
        limit = self.max_new_tokens
        if self.stop_token_ids:
            for i in range(fresh, min(len(tokens), limit)):
                if tokens[i] in self.stop_token_ids:
                    return tokens[:i + 1], "stop"
        if len(tokens) >= limit:
            return tokens[:limit], "length"
        return tokens, None


@dataclass
class StepOutput:
    """What one round produced for one request."""

    request_id: str
    new_tokens: list[int]  # emitted this round (may be empty only for a cancelled request)
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "cancelled"
    result: GenerationResult | None = None  # the whole generation, when finished
    rounds: tuple[int, ...] = ()  # tokens of each round merged into this output (a stream interval); () one round


@dataclass
class Row:
    """One admitted request, a row of the batch (its cache lives in the batch's ``RaggedCache``)."""

    request: Request
    rule: Rule
    rnd: RoundRandomness
    seq: SequenceState  # cache=None; draft_state None for plain decoding
    result: GenerationResult
    started: float  # perf_counter at admission
    proposal: Proposal | None = None  # this round's
    estimate: RowSurvival = field(default_factory=RowSurvival)  # survival for the adaptive cap
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # verified (tokens [1, 1], hidden
    # [1, 1, n, H]) the drafter has not consumed yet: plain rounds of a speculating row defer it
    drafts: Tensor | None = None  # [1, num_drafts] this round's (None: a plain round)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.seq.new_tokens)

    @property
    def speculates(self) -> bool:
        """Whether the row has a drafter state (False: plain decoding)."""
        return self.seq.draft_state is not None

    @property
    def num_drafts(self) -> int:
        """The drafts this row verifies this round (0: a plain round)."""
        return 0 if self.drafts is None else self.drafts.shape[1]

    def finish(self, reason: str) -> GenerationResult:
        """The row's whole generation, closed with ``reason``."""
        res = self.result
        res.tokens = list(self.seq.new_tokens)
        res.finish_reason = reason
        res.total_seconds = time.perf_counter() - self.started
        return res

    def output(self, emitted: list[int], fresh: int) -> StepOutput:
        """This round's output for the row, ``emitted`` tokens having been appended after the
        first ``fresh``: cut at a stop token or the length limit, finishing the row there."""
        cut, reason = self.request.check_end(self.seq.new_tokens, fresh)
        if not reason:
            return StepOutput(self.request.request_id, emitted)
        self.seq.new_tokens = cut
        return StepOutput(self.request.request_id, cut[fresh:], True, reason, self.finish(reason))


@dataclass
class Batch:
    """The running rows, in cache-row order, and their shared cache (None when empty)."""

    rows: list[Row] = field(default_factory=list)
    cache: RaggedCache | SlotCache | None = None

    def remove(self, indices: list[int]) -> None:
        """Drops the rows at ``indices`` and frees their cache rows."""
        if not indices:
            return
        gone = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        if self.cache is not None:
            self.cache.select(keep)  # frees the rows (a slot cache hands them back to its slab)
        if not keep:
            self.cache = None

    def join(self, rows: list[Row], cache: RaggedCache) -> None:
        """Appends ``rows`` whose cache rows are ``cache`` (one row each, in order)."""
        self.rows.extend(rows)
        if self.cache is None:
            self.cache = cache
        else:
            self.cache.concat(cache)
