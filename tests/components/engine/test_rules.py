"""Acceptance rules: verifying many requests' rows at once equals verifying each alone."""

from __future__ import annotations

import pytest
import torch

from components.drafters.base import Proposal
from components.engine.core import new_randomness
from components.engine.rules import RULES, get_rule
from components.ruleset import RULE_USES, RuleUse
from components.spec.sampling import SamplingParams, probs_from_logits


def test_greedy_rows_at_once_equal_each_row_alone():
    torch.manual_seed(0)
    rule, vocab, width = get_rule("greedy"), 11, 4
    logits = torch.randn(5, width + 1, vocab)  # [R, G+1, V]
    target = logits.argmax(-1)
    lens = torch.tensor([0, 1, 4, 3, 2])
    drafts = torch.randint(0, vocab, (5, width))
    drafts[2, :3] = target[2, :3]  # row 2: three drafts accepted, then a miss
    drafts[2, 3] = (target[2, 3] + 1) % vocab
    drafts[3, :3] = target[3, :3]  # row 3: all of its three accepted
    got = rule.verify_rows(drafts, lens, logits)
    rnd = new_randomness(SamplingParams(temperature=0.0), 0, torch.device("cpu"))
    for r in range(5):
        g = int(lens[r])
        if g == 0:  # a plain round: the target's own choice at the first slot
            a, nxt = 0, rule.sample_target(logits[r:r + 1, :1], torch.zeros(1, 1, dtype=torch.long), rnd)[:, 0]
        else:
            one = rule.verify(drafts[r:r + 1, :g], logits[r:r + 1, :g + 1], Proposal(drafts[r:r + 1, :g], logits[r:r + 1, :g], logits[r:r + 1, :g].softmax(-1)),
                              torch.zeros(1, g + 1, dtype=torch.long), rnd)
            a, nxt = int(one.num_accepted[0]), one.next_token
        assert int(got.num_accepted[r]) == a and int(got.next_token[r]) == int(nxt[0])
    assert got.num_accepted[2] == 3 and got.num_accepted[3] == 3


def test_only_rules_without_per_request_randomness_verify_rows_together():
    assert [name for name, rule in RULES.items() if rule.verifies_rows] == ["greedy"]


def test_the_light_rule_table_says_what_the_rules_declare():
    """``components.ruleset`` (read by the config, without torch) matches the rule objects."""
    declared = {name: RuleUse(rule.samples, rule.trees, rule.coupled) for name, rule in RULES.items()}
    assert declared == RULE_USES


def test_a_rule_that_declares_trees_verifies_them_and_the_others_refuse():
    torch.manual_seed(0)
    tokens, parents, depths = torch.tensor([[3, 5]]), torch.tensor([[-1, 0]]), torch.tensor([[1, 2]])
    logits = torch.randn(1, 3, 7)  # [1, N+1, V]
    rnd = new_randomness(SamplingParams(temperature=1.0), 0, torch.device("cpu"))
    for rule in RULES.values():
        if rule.trees:
            result = rule.verify_tree(tokens, parents, depths, logits, 4, rnd)
            assert result.next_token.shape == (1,)
        else:
            with pytest.raises(NotImplementedError, match="chains only"):
                rule.verify_tree(tokens, parents, depths, logits, 4, rnd)


def zero_draft_round(rows: int, logits: torch.Tensor) -> tuple[torch.Tensor, Proposal, torch.Tensor]:
    """What a round of no drafts verifies for ``rows`` requests: drafts [R, 0], an empty
    proposal [R, 0, V], positions [R, 1] (each predicting position 7)."""
    vocab = logits.shape[-1]
    drafts = torch.zeros(rows, 0, dtype=torch.long)
    empty = torch.zeros(rows, 0, vocab)
    return drafts, Proposal(drafts, empty, empty), torch.full((rows, 1), 7, dtype=torch.long)


@pytest.mark.parametrize("name", ["greedy", "gumbel"])
def test_a_zero_draft_verification_is_the_targets_own_choice(name):
    """γ = 0: nothing accepted, and the next token is the target's own (greedy: the argmax;
    gumbel: its Gumbel-max sample under the same position-keyed noise), for every seed."""
    torch.manual_seed(0)
    rule = get_rule(name)
    logits = torch.randn(1, 1, 13)  # [1, 1, V]
    drafts, prop, where = zero_draft_round(1, logits)
    for seed in range(20):
        rnd = new_randomness(SamplingParams(temperature=0.0 if name == "greedy" else 0.8), seed, torch.device("cpu"))
        got = rule.verify(drafts, logits, prop, where, rnd)
        own = rule.sample_target(logits, where, rnd)[:, 0]  # [1]
        assert int(got.num_accepted[0]) == 0 and got.accepted.shape == (1, 0)
        assert int(got.next_token[0]) == int(own[0])
    if name == "greedy":
        assert int(got.next_token[0]) == int(logits.argmax())


@pytest.mark.parametrize("name", ["speculative", "block"])
def test_a_zero_draft_verification_samples_the_target(name):
    """γ = 0 under the sampled rules: the next token follows the target's processed
    distribution exactly (chi-square over 6000 seeded draws on a 6-token vocabulary)."""
    from tests.components.engine.test_engine_sampling import chi_square_p_value

    rule, n = get_rule(name), 6000
    sampling = SamplingParams(temperature=0.7)
    logits = torch.tensor([[[1.0, 0.2, -0.5, 0.9, -2.0, 0.0]]]).expand(n, 1, 6)  # [R, 1, V]
    drafts, prop, where = zero_draft_round(n, logits)
    rnd = new_randomness(sampling, 0, torch.device("cpu"))
    got = rule.verify(drafts, logits, prop, where, rnd)
    assert bool((got.num_accepted == 0).all())
    p = probs_from_logits(logits[0, 0].double(), sampling)  # [V]
    counts = {(t,): c for t, c in enumerate(torch.bincount(got.next_token, minlength=6).tolist()) if c}
    assert chi_square_p_value(counts, {(t,): float(p[t]) for t in range(6)}, n) > 1e-3
