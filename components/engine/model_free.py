"""Drafters without a trained network, behind the engine protocol (batch 1).

* ``OracleDrafter``       -- "cheating": proposes a known continuation (e.g. the target's own
  greedy output), so under greedy verification every draft is accepted; the upper bound of
  what a perfect, free drafter would give;
* ``TargetDrafter``       -- drafts with the target itself (optionally at another temperature):
  always right under greedy, a close-but-different q under sampling; for tests;
* ``PromptLookupDrafter`` -- n-gram prompt lookup: finds the latest earlier occurrence of the
  trailing n-gram in the context and proposes the tokens that followed it (continued by
  looking up again when they run out, so loops are followed past one period), at most γ; and
  nothing without a match (the engines then take a plain step, as vLLM's n-gram proposer
  does, instead of verifying guesses).

All three keep the committed token ids (the hidden states they are given are ignored, so they
ask for no target taps: ``layer_ids = []``) and return one-hot or processed distributions as q;
a one-hot q (``OneHotProposal``, suffix decoding's too) is written only if a rule reads it.
They declare no capabilities (``capabilities()`` is empty): no batched passes, no DLoop stages,
no carryover, no causal tree head. They know nothing about verification rules or caches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING, Proposal, sample_tokens
from components.drafters.capabilities import Capability
from components.drafters.exchange import LazyProposal
from components.spec.sampling import SamplingParams


@dataclass
class TokenState:
    """Committed context ids (batch 1); rollback = truncate."""

    length: int = 0
    tokens: list[int] = field(default_factory=list)


def one_hot_proposal(tokens: list[int], vocab_size: int, device: torch.device) -> Proposal:
    """A proposal [1, G] whose q is one-hot at each token (logits 0 / -inf, float32); G = 0:
    nothing. Its [1, G, V] tensors are built when first read (``OneHotProposal``)."""
    return OneHotProposal(torch.tensor([tokens], dtype=torch.long, device=device).view(1, len(tokens)), vocab_size)


class OneHotProposal(LazyProposal):
    """A ``Proposal`` whose q is one-hot at each of its tokens [1, G]: ``logits`` (0 at the token,
    -inf elsewhere) and ``probs`` [1, G, V] float32 are written when first read, by scatter into
    filled buffers (the values of ``F.one_hot(ids, V).float()`` and its log). Greedy verification
    compares tokens and reads neither, and at a large vocabulary the two are most of a
    model-free drafter's cost: 8 bytes a vocabulary entry a draft token, written every round."""

    def __init__(self, tokens: Tensor, vocab_size: int, confidences: Tensor | None = None):
        super().__init__(tokens, confidences)  # tokens [1, G] long
        self.vocab_size = vocab_size

    def build_logits(self) -> Tensor:  # [1, G, V]
        return self._filled(float("-inf"), 0.0)

    def build_probs(self) -> Tensor:  # [1, G, V]
        return self._filled(0.0, 1.0)

    def _filled(self, fill: float, at_token: float) -> Tensor:
        g = self.tokens.shape[1]
        out = torch.full((1, g, self.vocab_size), fill, device=self.tokens.device)
        return out.scatter_(-1, self.tokens.unsqueeze(-1), at_token)


class TokenDrafter:
    """Shared bookkeeping: consume appends ids, rollback truncates, no target taps."""

    layer_ids: tuple[int, ...] = ()  # no target taps: these drafters read token ids only

    def __init__(self, vocab_size: int, num_speculative_tokens: int, device: torch.device | str = "cpu"):
        self.vocab_size = vocab_size
        self.num_speculative_tokens = num_speculative_tokens
        self.device = torch.device(device)

    def capabilities(self) -> frozenset[Capability]:
        """None beyond the core protocol: one request at a time, no own states, no carryover."""
        return frozenset()

    def identity(self) -> str:
        """What round profiles of this drafter are keyed by: its class (no parameters)."""
        return f"{type(self).__name__}:0"

    def init_state(self, batch_size: int) -> TokenState:
        if batch_size != 1:
            raise ValueError(f"{type(self).__name__} drafts for one request at a time, got batch {batch_size}")
        return TokenState()

    def consume(self, state: TokenState, tokens: Tensor, hidden: Tensor | None) -> TokenState:
        new = tokens[0].tolist()  # tokens [1, T]
        return TokenState(state.length + len(new), state.tokens + new)

    def rollback(self, state: TokenState, length: int) -> TokenState:
        return TokenState(length, state.tokens[:length])


class OracleDrafter(TokenDrafter):
    """Proposes ``reference[n : n+γ]`` where n is the position after ``last_token``."""

    def __init__(self, reference: list[int], vocab_size: int, num_speculative_tokens: int, device: torch.device | str = "cpu"):
        super().__init__(vocab_size, num_speculative_tokens, device)
        self.reference = list(reference)  # the whole expected sequence, prompt included

    def propose(self, state: TokenState, last_token: Tensor, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma, n = num_speculative_tokens or self.num_speculative_tokens, state.length + 1
        tokens = (self.reference[n : n + gamma] + [0] * gamma)[:gamma]
        return one_hot_proposal(tokens, self.vocab_size, self.device)


class PromptLookupDrafter(TokenDrafter):
    """n-gram lookup over the context (longest n first, ``max_ngram`` down to 1): proposes what
    followed the match, at most γ tokens, and an empty proposal (tokens [1, 0]) without one."""

    def __init__(self, vocab_size: int, num_speculative_tokens: int, max_ngram: int = 3, device: torch.device | str = "cpu"):
        super().__init__(vocab_size, num_speculative_tokens, device)
        self.max_ngram = max_ngram

    def propose(self, state: TokenState, last_token: Tensor, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        context = state.tokens + [int(last_token[0])]
        return one_hot_proposal(lookup(context, self.max_ngram, gamma), self.vocab_size, self.device)


def lookup(context: list[int], max_ngram: int, count: int | None = None) -> list[int]:
    """Tokens that followed the latest earlier occurrence of context's trailing n-gram ([] if none).

    With ``count``, up to ``count`` tokens: when the continuation reaches the end of the context
    (the match was one loop period back), the lookup runs again on the context plus what it
    proposed, so a repeating pattern is continued instead of cut at one period."""
    if count is None:
        return _follow(context, max_ngram)
    drafted: list[int] = []
    while len(drafted) < count:
        follow = _follow(context + drafted, max_ngram)
        if not follow:
            break
        drafted += follow[: count - len(drafted)]
    return drafted


def _follow(context: list[int], max_ngram: int) -> list[int]:
    ids = torch.tensor(context, dtype=torch.long)
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        windows = ids.unfold(0, n, 1)[:-1]  # [L-n, n] every earlier n-gram (the trailing one excluded)
        hits = (windows == ids[-n:]).all(dim=1).nonzero().flatten()
        if hits.numel():
            return context[int(hits[-1]) + n :]
    return []


class TargetDrafter(TokenDrafter):
    """Drafts γ tokens with the target (no cache: recomputes the context; tests only)."""

    def __init__(self, target: Any, num_speculative_tokens: int, temperature: float | None = None):
        super().__init__(target.vocab_size, num_speculative_tokens, target.device)
        self.target = target
        self.temperature = temperature  # None: the engine's sampling settings

    @torch.no_grad()
    def propose(self, state: TokenState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        if self.temperature is not None:
            sampling = SamplingParams(temperature=self.temperature)
        ids = torch.tensor([state.tokens + [int(last_token[0])]], dtype=torch.long, device=self.device)
        toks, logits, probs = [], [], []
        for _ in range(gamma):
            step = self.target.model(input_ids=ids).logits[:, -1:]  # [1, 1, V]
            tok, prob = sample_tokens(step, sampling, generator)  # [1, 1], [1, 1, V]
            toks.append(tok), logits.append(step), probs.append(prob)
            ids = torch.cat([ids, tok], dim=1)
        return Proposal(torch.cat(toks, 1), torch.cat(logits, 1), torch.cat(probs, 1), None)
