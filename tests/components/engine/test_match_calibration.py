"""Suffix decoding's learned confidences: the per-cell counts against a hand count of what the
committed ids confirmed, each token counted once however the ids arrive, the estimate between
the tree's ratio (no evidence) and the observed rate (much evidence), and the drafter feeding it
from its own candidates; drafts never change with it."""

from __future__ import annotations

import random

import pytest
import torch

from components.engine.match_calibration import (
    DEPTH_EDGES,
    PENDING_PER_OWNER,
    MatchCalibration,
    cell_of,
)
from components.engine.suffix import SuffixDrafter, conditionals


class Owner:
    """Stands for one request's ids (the calibration keys its pending checks weakly by it)."""


A, B, C = cell_of(1, 1.0, False, 1), cell_of(3, 1.0, False, 1), cell_of(8, 0.4, True, 5)


def test_cells_bucket_the_match_length_the_ratio_the_tree_and_the_occurrences():
    assert [cell_of(d, 1.0, False, 1)[0] for d in (1, 2, 3, 4, 5, 6, 7, 9, 10, 15, 16, 40)] == \
        [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 7, 7]
    assert len(DEPTH_EDGES) == 8
    assert [cell_of(3, r, False, 1)[1] for r in (0.1, 0.49, 0.5, 0.9, 0.999, 1.0)] == [0, 0, 1, 1, 2, 2]
    assert cell_of(3, 1.0, True, 1)[2] == 1 and cell_of(3, 1.0, False, 1)[2] == 0
    assert [cell_of(3, 1.0, True, n)[3] for n in (1, 2, 3, 4, 9, 10, 500)] == [0, 1, 1, 2, 2, 3, 3]


def test_without_evidence_the_estimate_is_the_trees_ratio():
    cal = MatchCalibration()
    assert cal.estimate([1.0, 0.5, 0.25], [A, B, C]) == [1.0, 0.5, 0.25]


def test_each_token_counts_once_up_to_the_first_that_differs():
    cal, owner = MatchCalibration(prior_weight=2.0), Owner()
    cal.note(owner, 3, [7, 8, 9], [A, B, C])
    cal.settle(owner, [0, 1, 2, 7])  # the first token committed: a hit
    assert cal.table() == {A: (1, 1)}
    cal.settle(owner, [0, 1, 2, 7])  # nothing new: nothing counted again
    assert cal.table() == {A: (1, 1)}
    cal.settle(owner, [0, 1, 2, 7, 8, 5, 9])  # 8 right, then 5 where 9 was drafted: a miss, done
    assert cal.table() == {A: (1, 1), B: (1, 1), C: (0, 1)}
    cal.settle(owner, [0, 1, 2, 7, 8, 5, 9, 9])
    assert cal.table() == {A: (1, 1), B: (1, 1), C: (0, 1)}
    # (hits + w·ratio) / (trials + w)
    assert cal.estimate([0.5, 0.5, 0.5], [A, B, C]) == pytest.approx([(1 + 1) / 3, (1 + 1) / 3, (0 + 1) / 3])


def test_a_position_is_noted_once_and_a_first_miss_ends_its_check():
    cal, owner = MatchCalibration(), Owner()
    cal.note(owner, 1, [4, 4], [A, A])
    cal.note(owner, 1, [5, 5], [B, B])  # a preview and the proposal after it: the first is kept
    cal.note(owner, 2, [], [])  # an empty candidate: nothing to check
    cal.settle(owner, [0, 3, 4])
    assert cal.table() == {A: (0, 1)}


def test_pending_checks_are_bounded_per_request_and_dropped_with_it():
    cal, owner = MatchCalibration(), Owner()
    for p in range(PENDING_PER_OWNER + 10):
        cal.note(owner, 1000 + p, [1], [A])
    assert len(cal._pending[owner]) == PENDING_PER_OWNER
    del owner
    assert len(cal._pending) == 0


def test_the_estimate_follows_the_evidence_against_a_hand_count():
    rng = random.Random(0)
    cal, owner = MatchCalibration(prior_weight=2.0), Owner()
    ids: list[int] = [0]
    hand = {A: [0, 0], B: [0, 0]}
    for p in range(1, 400):
        cell = A if p % 2 else B
        right = rng.random() < (0.2 if cell is A else 0.9)
        nxt = rng.randrange(2, 50)
        cal.note(owner, p, [nxt if right else 1], [cell])
        ids.append(nxt)
        cal.settle(owner, ids)
        hand[cell][0] += right
        hand[cell][1] += 1
    assert cal.table() == {c: tuple(v) for c, v in sorted(hand.items())}
    est = cal.estimate([1.0, 1.0], [A, B])
    assert est == pytest.approx([(hand[A][0] + 2) / (hand[A][1] + 2), (hand[B][0] + 2) / (hand[B][1] + 2)])
    assert est[0] < 0.35 and est[1] > 0.8


def test_a_bad_prior_weight_is_refused():
    with pytest.raises(ValueError, match="prior_weight"):
        MatchCalibration(prior_weight=0)


# ----------------------------------------------------------------------------- the drafter feeding it
def test_the_drafter_learns_from_its_own_candidates_and_drafts_the_same_tokens():
    """A stream where one-token matches mislead (every token follows 0, each time another) and a
    long repeat does not: after it, a short match's confidence has fallen below the tree's ratio
    of 1 and the repeat's stays high; a fresh drafter proposes the same tokens throughout."""
    rng = random.Random(1)
    phrase = [40, 41, 42, 43, 44, 45, 46, 47]
    stream: list[int] = []
    for _ in range(12):
        stream += [0, rng.randrange(1, 30), 0, rng.randrange(1, 30)] + phrase
    learner, fresh = SuffixDrafter(64, 4, 24, max_cached_responses=0), SuffixDrafter(64, 4, 24, max_cached_responses=0)
    sl, sf = learner.init_state(1), fresh.init_state(1)
    for i, tok in enumerate(stream[:-1]):
        last = torch.tensor([tok])
        pl, pf = learner.propose(sl, last), fresh.propose(sf, last)
        assert torch.equal(pl.tokens, pf.tokens)
        sl = learner.consume(sl, last[None], None)
        sf = fresh.consume(sf, last[None], None)
        fresh.calibration = type(fresh.calibration)()  # the control keeps no evidence
    table = learner.calibration.table()
    hits, trials = (sum(v[i] for c, v in table.items() if c[0] == 0) for i in (0, 1))  # one-token matches
    assert trials > 10 and hits / trials < 0.5
    state = learner.consume(sl, torch.tensor([[0]]), None)
    best = learner.candidate(state, torch.tensor([rng.randrange(1, 30)]), 4)  # after "0 x": a short match
    if best.tokens:
        assert learner.confidences(best)[0] < conditionals(best.probs)[0]
    long_best = learner.candidate(learner.consume(sl, torch.tensor([phrase[:3]]), None), torch.tensor([phrase[3]]), 4)
    assert long_best.tokens == phrase[4:8]
    assert min(learner.confidences(long_best)[:3]) > 0.8  # read along the repeat at a ratio of 1
