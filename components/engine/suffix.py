"""Suffix decoding (SuffixDecoding, Oliaro et al., arXiv 2411.04975; vLLM's ``suffix`` method):
a model-free drafter that copies what followed the current context's longest suffix before.

* ``SuffixTree``    -- (``suffix_tree.py``) exact occurrence counts of every token string of
  length ≤ ``max_depth`` in a set of token sequences, grown a token at a time;
* ``ResponseCache`` -- the global tree: finished responses, at most ``max_responses`` of them and
  ``max_tokens`` tokens in all, the oldest removed first (counts stay exact), keyed so that a
  request run again replaces its own earlier response;
* ``SuffixDrafter`` -- the engine's drafter (batch 1): a per-request tree over the request's
  committed ids (prompt + output so far) beside the drafter's global tree.

Speculation, per tree: the longest suffix of the context (at most ``max_depth -
num_speculative_tokens`` tokens, so a whole draft fits in the tree) that occurred before with a
next token is matched; from it the draft follows the most frequent next token (ties: the
smaller id), each token's estimated probability the running product of count(next) / count(all
next tokens seen there), while that stays ≥ ``min_token_prob`` and the draft is shorter than
``min(γ, max_spec_factor · match)``. Where the continuation runs out (the match's earlier
occurrence reached the end of what is known, as in a loop one period back), context + draft is
matched again and the walk goes on, as prompt lookup follows a loop. A candidate's score is the
sum of its tokens' probabilities; the global tree's candidate is taken only when it scores
higher than the request's. No match, or a best score below ``min_score``: nothing is proposed
(an empty ``Proposal``, tokens [1, 0]) and the engines take a plain step.

Where this differs from Arctic Inference's implementation (which vLLM calls): the longest match
only, not the best-scoring of every match length, and loops followed by matching again;
probabilities over the occurrences that have a next token (the context's own trailing occurrence
is no evidence); responses enter the global tree when finished (``observe``), not token by token
while they are generated, and ``suffix_drafter`` can start it with earlier ones (the data
stage's rollouts); chains only -- the paper's speculation *trees* are out of scope
(``tree.TreeEngine`` verifies trees, but this drafter returns one chain).

The trie itself (``suffix_tree.SuffixTree``) is exact and lazily stored; its module says how.

Proposals are one-hot q (``model_free.one_hot_proposal``), as prompt lookup's. Each draft's
confidence (read by the adaptive cap as a confidence head's) is its estimated acceptance given
the drafts before it: the tree's count ratio c / n, smoothed by how many occurrences n it was
read over ((c + 1) / (n + 2): 2/3 along a continuation seen once), as
``match_calibration.MatchCalibration`` has learned to read it from the ids requests commit, per
match length, ratio, tree and occurrences; drafts never depend on it. Asks for no target taps
(``layer_ids = ()``) and declares ``LEARNS_RESPONSES`` and ``PREVIEWS`` (the draft's confidences
before drafting, so that the adaptive cap is priced on this round's own match,
draft-then-decide; no batched passes, DLoop, carryover or tree head). Knows nothing about verification, caches, files or tokenization;
who runs requests calls ``observe`` with each finished response (declared as
``Capability.LEARNS_RESPONSES``: the batch engine does it as rows finish, the eval stage's
``suffix`` method after each request). Not thread-safe: observe from the thread that drafts.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import Proposal
from components.drafters.capabilities import Capability
from components.engine.match_calibration import Cell, MatchCalibration, cell_of
from components.engine.model_free import one_hot_proposal
from components.engine.suffix_tree import SuffixTree
from components.spec.sampling import SamplingParams

REQUEST = 0  # the per-request tree's one sequence id


@dataclass
class Candidate:
    """One tree's draft for a context: tokens, their estimated probabilities, the match length."""

    tokens: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    match_len: int = 0
    depths: list[int] = field(default_factory=list)  # the match length each token was read after
    totals: list[int] = field(default_factory=list)  # occurrences with a next token where each was read
    shared: bool = False  # read from the global tree (else the request's own)

    @property
    def score(self) -> float:
        """The expected number of accepted tokens, were the estimates right: Σ probabilities."""
        return sum(self.probs)

    @cached_property
    def ratios(self) -> list[float]:  # each token's count ratio given the ones before it
        return conditionals(self.probs)

    @cached_property
    def priors(self) -> list[float]:
        """Each token's ratio c / n smoothed by the evidence behind it, (c + 1) / (n + 2)
        (Laplace's rule of succession): what its confidence is before the calibration has seen
        such tokens -- 2/3 for a continuation seen once, not certainty."""
        return [(r * n + 1) / (n + 2) for r, n in zip(self.ratios, self.occurrences)]

    @cached_property
    def occurrences(self) -> list[int]:  # each token's n: ``totals``, else 1 (read where one occurrence went on)
        return self.totals or [1] * len(self.tokens)

    @cached_property
    def cells(self) -> list[Cell]:
        """Each token's calibration cell (without ``depths``: read along one match)."""
        depths = self.depths or [self.match_len + k for k in range(len(self.tokens))]
        return [cell_of(d, r, self.shared, n) for d, r, n in zip(depths, self.ratios, self.occurrences)]


def speculate(tree: SuffixTree, context: Sequence[int], max_match: int, gamma: int, max_spec_factor: float,
              min_prob: float) -> Candidate:
    """``tree``'s candidate for ``context``: the longest match m (≤ ``max_match``), then at most
    min(γ, ⌊factor · m⌋) tokens of greedy continuation; where the continuation runs out (the
    match's earlier occurrence reached the end of what is known: a loop), context + draft is
    matched again and drafting goes on, as prompt lookup continues a loop past one period.
    Without a match, an empty candidate."""
    place = tree.longest_match(context, max_match)
    if place is None:
        return Candidate()
    first, limit = place.depth, min(gamma, int(max_spec_factor * place.depth + 1e-6))
    out = Candidate(match_len=first)
    while place is not None and len(out.tokens) < limit:
        walk = tree.draft(place, limit - len(out.tokens), min_prob, out.probs[-1] if out.probs else 1.0)
        out.tokens, out.probs = out.tokens + walk.tokens, out.probs + walk.probs
        out.depths, out.totals = out.depths + walk.depths, out.totals + walk.totals
        if not walk.ran_out:
            break
        place = tree.longest_match(list(context) + out.tokens, max_match)
    return out


class ResponseCache:
    """The global tree: finished responses, oldest removed first beyond ``max_responses``
    responses or ``max_tokens`` tokens (a longer response keeps its first ``max_tokens``)."""

    def __init__(self, max_depth: int, max_responses: int, max_tokens: int):
        self.tree = SuffixTree(max_depth)
        self.max_responses, self.max_tokens = max_responses, max_tokens
        self.kept: OrderedDict[Hashable, int] = OrderedDict()  # key → sequence id, oldest first
        self.tokens = 0  # held in the tree
        self._next_id = 0

    def add(self, tokens: Sequence[int], key: Hashable | None = None) -> None:
        """Keeps ``tokens`` (replacing what ``key`` kept before); evicts the oldest beyond the bounds."""
        if key is not None:
            self.forget(key)
        tokens = list(tokens)[: self.max_tokens]
        if self.max_responses < 1 or not tokens:
            return
        seq_id, self._next_id = self._next_id, self._next_id + 1
        self.tree.extend(seq_id, tokens)
        self.tree.close(seq_id)
        self.kept[(ResponseCache, seq_id) if key is None else key] = seq_id
        self.tokens += len(tokens)
        while len(self.kept) > self.max_responses or self.tokens > self.max_tokens:
            self._drop(self.kept.popitem(last=False)[1])

    def forget(self, key: Hashable) -> None:
        """Removes the response kept under ``key``, if any."""
        seq_id = self.kept.pop(key, None)
        if seq_id is not None:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        self.tokens -= len(self.tree.seqs[seq_id])
        self.tree.remove(seq_id)


@dataclass
class SuffixState:
    """One request's committed ids (batch 1): the first ``length`` tokens of ``tree``'s sequence.
    States share a tree as it grows; a state behind its tree (rolled back, or consumed from
    twice) is rebuilt from its own ids when next used, so every state reads exactly its ids."""

    tree: SuffixTree
    length: int = 0

    @property
    def tokens(self) -> list[int]:
        return self.tree.seqs.get(REQUEST, [])[: self.length]


class SuffixDrafter:
    """Suffix decoding behind the engine's drafter protocol (module docstring); ``observe``
    teaches the global tree a finished response."""

    layer_ids: tuple[int, ...] = ()  # no target taps: reads token ids only

    def __init__(self, vocab_size: int, num_speculative_tokens: int = 16, max_depth: int = 64,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, min_score: float = 0.0,
                 max_cached_responses: int = 10_000, max_cached_tokens: int = 1 << 18,
                 device: torch.device | str = "cpu"):
        """``max_depth``: the trees' depth, bounding match + draft (a match is at most
        ``max_depth - num_speculative_tokens`` long); ``max_cached_responses`` 0: no global tree."""
        if not 1 <= num_speculative_tokens < max_depth:
            raise ValueError(f"need 1 ≤ num_speculative_tokens ({num_speculative_tokens}) < max_depth ({max_depth})")
        if max_spec_factor <= 0 or not 0 <= min_token_prob <= 1 or max_cached_responses < 0 or max_cached_tokens < 1:
            raise ValueError(f"need max_spec_factor > 0 ({max_spec_factor}), 0 ≤ min_token_prob ≤ 1 ({min_token_prob}), "
                             f"max_cached_responses ≥ 0 ({max_cached_responses}), max_cached_tokens ≥ 1 ({max_cached_tokens})")
        self.vocab_size, self.num_speculative_tokens = vocab_size, num_speculative_tokens
        self.max_depth, self.max_match = max_depth, max_depth - num_speculative_tokens
        self.max_spec_factor, self.min_token_prob, self.min_score = max_spec_factor, min_token_prob, min_score
        self.responses = ResponseCache(max_depth, max_cached_responses, max_cached_tokens)
        self.calibration = MatchCalibration()  # the confidences' estimates, learned from committed ids
        self.device = torch.device(device)
        # per request tree: (ids, last token, responses seen, candidate) of its latest preview
        self._previews: weakref.WeakKeyDictionary[SuffixTree, tuple[int, int, int, Candidate]] = \
            weakref.WeakKeyDictionary()
        self._observed = 0  # responses observed or forgotten so far (a preview read the tree before)

    def capabilities(self) -> frozenset[Capability]:
        """LEARNS_RESPONSES (``observe``), PREVIEWS (``preview``); batch 1, no own states or carryover."""
        return frozenset({Capability.LEARNS_RESPONSES, Capability.PREVIEWS})

    def identity(self) -> str:
        """What round profiles of this drafter are keyed by: its class (no parameters)."""
        return f"{type(self).__name__}:0"

    # ------------------------------------------------------------------ the request's tree
    def init_state(self, batch_size: int) -> SuffixState:
        if batch_size != 1:
            raise ValueError(f"{type(self).__name__} drafts for one request at a time, got batch {batch_size}")
        return SuffixState(SuffixTree(self.max_depth))

    def consume(self, state: SuffixState, tokens: Tensor, hidden: Tensor | None) -> SuffixState:
        """The state after the committed ``tokens`` [1, T] (hidden states ignored)."""
        ids = tokens[0].tolist()
        return SuffixState(self._tree(state, ids), state.length + len(ids))

    def rollback(self, state: SuffixState, length: int) -> SuffixState:
        return SuffixState(state.tree, min(length, state.length))

    def _tree(self, state: SuffixState, ahead: Sequence[int] = ()) -> SuffixTree:
        """``state``'s tree holding its ids and then ``ahead``: the shared tree, extended where it
        ends within ``ahead`` (a ``preview`` may have run it ahead of the state), else rebuilt
        from the state's own ids (rolled back, or consumed from twice along another path)."""
        seq = state.tree.seqs.get(REQUEST, [])
        beyond = seq[state.length:]
        if len(seq) < state.length or beyond != list(ahead[:len(beyond)]):
            rebuilt = SuffixTree(self.max_depth)
            rebuilt.extend(REQUEST, state.tokens)
            state.tree, beyond = rebuilt, []
        if len(ahead) > len(beyond):
            state.tree.extend(REQUEST, ahead[len(beyond):])
            self.calibration.settle(state.tree, state.tree.seqs[REQUEST])
        return state.tree

    # ------------------------------------------------------------------ drafting
    def propose(self, state: SuffixState, last_token: Tensor, sampling: SamplingParams | None = None,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        """At most γ tokens after ``last_token`` [1]; none (tokens [1, 0]) without a match ≥ ``min_score``."""
        gamma = num_speculative_tokens or self.num_speculative_tokens
        best = self._previewed(state, last_token, gamma) or self.candidate(state, last_token, gamma)
        tokens = self._kept(best)
        return suffix_proposal(tokens, self.confidences(best, len(tokens)), self.vocab_size, self.device)

    def preview(self, state: SuffixState, recent: Tensor) -> Tensor:  # recent [1, k+1] -> [1, g]
        """The confidences of the draft ``propose`` would make once the ids of ``recent`` (not
        yet consumed, then the last token) are consumed: [1, 0] when it would propose nothing.
        Exact: the request's tree is run ahead over the unconsumed ids (``consume`` then finds
        them there)."""
        ids = recent[0].tolist()  # the unconsumed ids, then the last token
        best = self.candidate(state, ids[-1], self.num_speculative_tokens, ids[:-1])
        self._previews[state.tree] = (state.length + len(ids) - 1, ids[-1], self._observed, best)
        return torch.tensor([self.confidences(best, len(self._kept(best)))], dtype=torch.float32)  # [1, g]

    def _previewed(self, state: SuffixState, last_token: Tensor, gamma: int) -> Candidate | None:
        """The candidate the request's last ``preview`` read, taken once, if it read these very
        ids, last token and trees: ``candidate`` reads the same at any γ from its length up to the
        preview's (a shorter one may cut the other tree's draft to a score it beats)."""
        kept = self._previews.pop(state.tree, None)
        if kept is None:
            return None
        length, last, observed, best = kept
        same = (length == state.length == len(state.tree.seqs.get(REQUEST, [])) and last == int(last_token[0])
                and observed == self._observed and len(best.tokens) <= gamma <= self.num_speculative_tokens)
        return best if same else None

    def _kept(self, best: Candidate) -> list[int]:
        """The candidate's tokens if it is proposed (a match scoring ≥ ``min_score``), else none."""
        return best.tokens if best.tokens and best.score >= self.min_score else []

    def candidate(self, state: SuffixState, last_token: Tensor | int, gamma: int,
                  ahead: Sequence[int] = ()) -> Candidate:
        """The best candidate of at most ``gamma`` tokens after ``last_token`` ([1], or its id;
        ``speculate`` over the committed tail that fits a match), before ``min_score`` is applied;
        ``ahead``: ids committed after the state's, not consumed yet (``preview``)."""
        tree = self._tree(state, ahead)
        end = state.length + len(ahead)
        last = last_token if isinstance(last_token, int) else int(last_token[0])
        context = tree.seqs.get(REQUEST, [])[max(0, end - self.max_match + 1):end] + [last]
        best = self.speculate(tree, context, gamma)
        self.calibration.note(tree, end + 1, best.tokens, best.cells)  # its ids: the last token at end
        return best

    def confidences(self, best: Candidate, count: int | None = None) -> list[float]:
        """The first ``count`` (default all) tokens' estimated acceptance given the ones before
        them: their count conditionals, smoothed by the occurrences behind them
        (``Candidate.priors``), as ``calibration`` has learned to read them."""
        return self.calibration.estimate(best.priors[:count], best.cells[:count])

    def speculate(self, request: SuffixTree, context: list[int], gamma: int) -> Candidate:
        """The request tree's candidate, or the global tree's when it scores higher."""
        args = (self.max_match, gamma, self.max_spec_factor, self.min_token_prob)
        own = speculate(request, context, *args)
        if not self.responses.kept:
            return own
        shared = speculate(self.responses.tree, context, *args)
        shared.shared = True
        return shared if shared.score > own.score else own

    # ------------------------------------------------------------------ the global tree
    def observe(self, response: Sequence[int], key: Hashable | None = None) -> None:
        """Keeps a finished response (new tokens, prompt excluded) in the global tree; under
        ``key`` (e.g. the prompt) it replaces that key's earlier response."""
        self.responses.add(response, key)
        self._observed += 1

    def forget(self, key: Hashable) -> None:
        """Drops the response kept under ``key`` (before running that request again: not from its own answer)."""
        self.responses.forget(key)
        self._observed += 1


def conditionals(probs: Sequence[float]) -> list[float]:
    """A draft's running probabilities (p_1, p_1·c_2, ...) → each token's own c_k = p_k / p_{k-1}:
    its estimated probability of acceptance given the drafts before it were accepted."""
    before = [1.0, *probs[:-1]]
    return [min(1.0, p / max(b, 1e-12)) for p, b in zip(probs, before)]


def suffix_proposal(tokens: list[int], confidences: list[float], vocab_size: int, device: torch.device) -> Proposal:
    """One-hot q over ``tokens`` with ``confidences`` (the adaptive cap's survival estimates)."""
    prop = one_hot_proposal(tokens, vocab_size, device)
    if tokens:
        prop.confidences = torch.tensor([confidences[:len(tokens)]], dtype=torch.float32, device=device)  # [1, G]
    return prop


def suffix_drafter(section: Any, vocab_size: int, device: torch.device | str = "cpu",
                   responses: Iterable[Sequence[int]] = ()) -> SuffixDrafter:
    """A ``SuffixDrafter`` as a config section's ``suffix_*`` keys set it (eval's and serve's), its
    global tree starting with ``responses`` (the oldest: the first out when requests' fill it)."""
    drafter = SuffixDrafter(vocab_size, section.suffix_num_speculative_tokens, section.suffix_max_tree_depth,
                            section.suffix_max_spec_factor, section.suffix_min_token_prob,
                            max_cached_responses=section.suffix_max_cached_responses, device=device)
    for response in responses:
        drafter.observe(response)
    return drafter
