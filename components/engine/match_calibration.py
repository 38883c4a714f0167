"""How often a suffix-tree draft is right, learned from what the requests then commit.

A suffix tree's count ratio (count(next) / count(all next) where the draft was read) is 1 wherever
the tree saw a continuation once, and that is most places in a young tree: it says the same of a
token read after a 1-token match as of one read after a 12-token match, though the first is
right far less often (docs/results.md measures it per match length). The adaptive cap prices a
round on these confidences, so an estimate that is 1 everywhere makes it draft where drafting
loses, and its per-position calibration then scales every confidence down alike, so it no longer
drafts where drafting pays.

``MatchCalibration`` keeps, per *cell* -- the match length the token was read at (bucketed by
``DEPTH_EDGES``), its count ratio (bucketed by ``RATIO_EDGES``), which tree it came from (the
request's own or the global one), and how many occurrences the ratio was read over (bucketed by
``OCCURRENCE_EDGES``: a continuation seen once in the global tree is right far less often than
one seen ten times, both at ratio 1; docs/results.md) -- how many such tokens were predicted and
how many the request's committed ids then confirmed, and turns a draft's count conditionals c_k into
estimates of each token's chance of acceptance given the tokens before it were accepted::

    estimate_k = (hits(cell_k) + w · c_k) / (trials(cell_k) + w)        w = ``prior_weight``

where c_k is the prior the caller gives (suffix decoding: the tree's count ratio smoothed by the
occurrences behind it, ``suffix.Candidate.priors``), so a cell with no evidence keeps that prior
and one with much evidence says what it saw. Predictions are checked against the ids, not against the verdicts: every candidate the
drafter computes is noted (``note``; previews and proposals alike, once per position), and
compared, token by token up to the first that differs, with the ids its request commits there
(``settle``). So what is learned does not depend on which candidates the cap chose to draft
(greedy verification accepts exactly the tokens that equal the committed ones; a sampled rule's
acceptance is close to it). Knows token ids and cells; nothing about trees, engines or the cap.
"""

from __future__ import annotations

import bisect
import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

DEPTH_EDGES = (1, 2, 3, 4, 5, 7, 10, 16)  # match-length buckets: [1], [2], [3], [4], [5, 6], [7, 9], [10, 15], [16, ∞)
RATIO_EDGES = (0.5, 0.999)  # count-ratio buckets: below 0.5, [0.5, 0.999), about 1 (one continuation seen)
OCCURRENCE_EDGES = (1, 2, 4, 10)  # occurrences behind the ratio: [1], [2, 3], [4, 9], [10, ∞)
PENDING_PER_OWNER = 64  # unsettled checks kept per request (a request that stops committing drops the oldest)

Cell = tuple[int, int, int, int]  # (depth bucket, ratio bucket, tree: 0 the request's, 1 the global one, occurrences bucket)


def cell_of(depth: int, ratio: float, shared: bool, occurrences: int) -> Cell:
    """The cell of a token read after a match of ``depth`` tokens at count ratio ``ratio``, over
    ``occurrences`` occurrences of that match that went on."""
    return (max(0, bisect.bisect_right(DEPTH_EDGES, depth) - 1), bisect.bisect_right(RATIO_EDGES, ratio), int(shared),
            max(0, bisect.bisect_right(OCCURRENCE_EDGES, occurrences) - 1))


@dataclass
class _Check:
    """A noted candidate: its tokens from one position on, their cells, and how many of them the
    committed ids have been compared with so far."""

    tokens: list[int]
    cells: list[Cell]
    compared: int = 0


class MatchCalibration:
    """Per-cell counts of predicted and confirmed draft tokens (module docstring)."""

    def __init__(self, prior_weight: float = 2.0):
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.prior_weight = prior_weight
        self.trials: Counter[Cell] = Counter()
        self.hits: Counter[Cell] = Counter()
        # per request (any object standing for its committed ids, e.g. its tree): position → check
        self._pending: weakref.WeakKeyDictionary[object, dict[int, _Check]] = weakref.WeakKeyDictionary()

    def estimate(self, ratios: Sequence[float], cells: Sequence[Cell]) -> list[float]:
        """Each token's estimated acceptance given the ones before it (``ratios`` c_k, their cells)."""
        w = self.prior_weight
        return [(self.hits[c] + w * r) / (self.trials[c] + w) for r, c in zip(ratios, cells)]

    def note(self, owner: object, position: int, tokens: Sequence[int], cells: Sequence[Cell]) -> None:
        """A candidate for the ids of ``owner`` from ``position`` on (the first noted at a
        position is kept: a preview and the proposal after it read the same candidate)."""
        if not tokens:
            return
        pending = self._pending.setdefault(owner, {})
        if position in pending:
            return
        if len(pending) >= PENDING_PER_OWNER:
            del pending[min(pending)]
        pending[position] = _Check(list(tokens), list(cells))

    def settle(self, owner: object, ids: Sequence[int]) -> None:
        """Compares ``owner``'s noted candidates with its committed ``ids`` (all of them so far),
        counting each token once: a hit while the ids agree, one miss at the first that differs."""
        pending = self._pending.get(owner)
        if not pending:
            return
        for position in [p for p in pending if p < len(ids)]:
            check = pending[position]
            while check.compared < len(check.tokens) and position + check.compared < len(ids):
                k = check.compared
                self.trials[check.cells[k]] += 1
                check.compared += 1
                if ids[position + k] != check.tokens[k]:
                    check.compared = len(check.tokens)  # a miss ends the check
                    break
                self.hits[check.cells[k]] += 1
            if check.compared == len(check.tokens):
                del pending[position]

    def table(self) -> dict[Cell, tuple[int, int]]:
        """cell → (confirmed, predicted) so far (for reports and tests)."""
        return {c: (self.hits[c], n) for c, n in sorted(self.trials.items())}
