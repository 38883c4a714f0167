"""The batch engine's request and row records, shared by its steps (``batch.py`` and the
``batch_admit``/``batch_draft``/``batch_tree`` mixins): a ``Request`` as it comes in, a
``StepOutput`` per round and request, a running row (``_Running``) and the batch, and where a
request's output ends. Knows sequences, rules and proposals as values; does no model work.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING, Proposal
from components.engine.batch_cache import RaggedCache
from components.engine.engine import GenerationResult, Sequence
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


@dataclass
class StepOutput:
    """What one round produced for one request."""

    request_id: str
    new_tokens: list[int]  # emitted this round (may be empty only for a cancelled request)
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "cancelled"
    result: GenerationResult | None = None  # the whole generation, when finished


@dataclass
class _Running:
    """A request in the batch: its sequence state (cache lives in the batch's RaggedCache)."""

    request: Request
    rule: Rule
    rnd: RoundRandomness
    seq: Sequence  # cache=None; draft_state None for plain decoding
    result: GenerationResult
    started: float
    proposal: Proposal | None = None  # this round's
    survival: Tensor | None = None  # [γ'] this round's proposal's survival, calibrated for this row
    raw_survival: Tensor | None = None  # [γ'] the same as the confidence head gave it
    hits: list[float] = field(default_factory=lambda: [0.0, 0.0])  # this row's Σ predicted, Σ accepted
    pending: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # verified (tokens, hidden) the
    # drafter has not consumed yet: plain rounds of a speculating row defer it to its next draft
    drafts: Tensor | None = None  # [1, γ_b] this round's
    carried: int = 0

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.seq.new_tokens)


@dataclass
class _Batch:
    rows: list[_Running] = field(default_factory=list)
    cache: RaggedCache | None = None


def _check_end(req: Request, tokens: list[int], fresh: int) -> tuple[list[int], str | None]:
    """(tokens kept, finish reason or None): the first stop token among tokens[fresh:] ends the
    request (kept in the output); else reaching max_new_tokens does."""
    limit = req.max_new_tokens
    if req.stop_token_ids:
        for i in range(fresh, min(len(tokens), limit)):
            if tokens[i] in req.stop_token_ids:
                return tokens[:i + 1], "stop"
    if len(tokens) >= limit:
        return tokens[:limit], "length"
    return tokens, None
