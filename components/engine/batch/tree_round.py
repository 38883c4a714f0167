"""The batch engine's token-tree round: when a single request is running, a tree of drafts
instead of a chain (``settings.tree_budget`` > 0).

A verify pass over one row is memory-bound: N + 1 tokens cost little more than γ + 1 on an
accelerator, and a tree of N nodes keeps the best alternatives at every depth where a chain
keeps one. So when the batch has shrunk to one row (a quiet server, the last request of a
batch) and that row's rule declares ``coupled`` (its tree output is the target's own
whatever was drafted: greedy, Gumbel coupling), the round is ``tree.tree_round`` on that row:
the ragged cache is compacted to the row's committed slots (so the tree's 4-D mask can sit
right after them), and the round's cache becomes the batch's again. With two or more rows,
rounds are chains as before.

Rows of other rules keep chains, so their output stays what the batch-1 chain engine would
draw for the same seed. Not with DLoop stages or carryover (refused when the settings are
resolved). Knows the tree round, the batch's records and the ragged cache; nothing about
drafter families or the drafter's deferred updates (the batch engine flushes them before a
tree round).
"""

from __future__ import annotations

from typing import Any

from components.engine.batch.state import Batch, Row, StepOutput
from components.engine.cache.ragged import RaggedCache
from components.engine.core import SequenceState
from components.engine.settings import EngineSettings
from components.engine.tree import tree_round


class TreeRounds:
    """Tree rounds of a lone row whose rule declares ``coupled``."""

    def __init__(self, target: Any, drafter: Any, settings: EngineSettings):
        """``settings.tree_budget`` nodes per round; 0: never (every round is a chain)."""
        self.target, self.drafter, self.settings = target, drafter, settings

    def lone_row(self, batch: Batch) -> Row | None:
        """The running row, if it is alone, speculates and its rule verifies trees in a batch."""
        if self.settings.tree_budget <= 0 or len(batch.rows) != 1:
            return None
        row = batch.rows[0]
        return row if row.speculates and row.rule.coupled else None

    def round(self, batch: Batch, row: Row) -> tuple[list[StepOutput], list[int], list[int], float, float]:
        """One tree round of ``batch``'s lone ``row`` (no deferred drafter updates left) →
        (outputs, [accepted], [nodes], draft s, verify s); both lists empty when the drafter
        proposed nothing and the round was a plain step."""
        if row.pending:
            raise RuntimeError("tree round: the row's deferred drafter updates were not consumed")
        cache = batch.cache
        if cache.holes() > 0:
            cache.compact()
        if cache.length != row.seq.length - 1:
            raise RuntimeError(f"tree round: cache holds {cache.length} slots, the row {row.seq.length - 1}")
        res, before = row.result, len(row.seq.new_tokens)
        draft0, verify0, drafting0 = res.draft_seconds, res.verify_seconds, len(res.accepted)
        seq = SequenceState(cache.cache, row.seq.draft_state, row.seq.last_token, row.seq.length, row.seq.new_tokens)
        seq = tree_round(self.target, self.drafter, self.settings, row.rule, seq, row.remaining, row.rnd, res)
        batch.cache = RaggedCache.single(seq.cache)
        row.seq = SequenceState(None, seq.draft_state, seq.last_token, seq.length, seq.new_tokens)
        row.proposal = row.drafts = None
        row.estimate.clear()
        out = row.output(row.seq.new_tokens[before:], before)
        if out.finished:
            batch.remove([0])
        accepted, nodes = res.accepted[drafting0:], res.drafted[drafting0:]  # [] after a plain step
        return [out], accepted, nodes, res.draft_seconds - draft0, res.verify_seconds - verify0
