"""Which acceptance rules exist and where each may verify, as a table light enough for the
config to read (no torch).

The rules themselves (``components.engine.rules``) declare the same facts on their objects and
do the work; ``tests/components/engine/test_rules.py`` checks that this table says what they
declare, so a new rule is one class there and one line here. Knows rule names and uses only;
nothing about tensors, models or how a rule verifies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RuleUse:
    """Where a rule may be used."""

    samples: bool  # draws from the target's distribution (temperature > 0); greedy does not
    trees: bool  # verifies a token tree (the batch-1 tree engine)
    # the output is a function of the target and the seed, whatever the drafts (greedy; Gumbel with
    # shared noise): the eval holds it equal to target_only's, a lone batch row may verify a tree with it
    coupled: bool


RULE_USES: dict[str, RuleUse] = {
    "greedy": RuleUse(samples=False, trees=True, coupled=True),
    "gumbel": RuleUse(samples=True, trees=True, coupled=True),
    "speculative": RuleUse(samples=True, trees=True, coupled=False),
    "block": RuleUse(samples=True, trees=False, coupled=False),
}


def rules_where(samples: bool | None = None, trees: bool | None = None,
                coupled: bool | None = None) -> list[str]:
    """The rule names (in table order) whose uses match every flag given."""
    wanted = {k: v for k, v in (("samples", samples), ("trees", trees), ("coupled", coupled))
              if v is not None}
    return [name for name, use in RULE_USES.items() if all(getattr(use, k) == v for k, v in wanted.items())]
