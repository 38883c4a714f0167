"""Acceptance rules: verifying many requests' rows at once equals verifying each alone."""

from __future__ import annotations

import pytest
import torch

from components.drafters.base import Proposal
from components.engine.core import new_randomness
from components.engine.rules import RULES, get_rule
from components.ruleset import RULE_USES, RuleUse
from components.spec.sampling import SamplingParams


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
