"""The batch engine's token-tree round: when a single request is running, a tree of drafts
instead of a chain (``BatchEngine(tree_budget=N)``).

A verify pass over one row is memory-bound: N + 1 tokens cost little more than γ + 1 on an
accelerator, and a tree of N nodes keeps the best alternatives at every depth where a chain
keeps one. So when the batch has shrunk to one row (a quiet server, the last request of a
batch) and that row's rule verifies trees path-independently (greedy, or Gumbel coupling: the
output is the target's own whatever was drafted), the round is ``TreeEngine.round`` on that
row: its deferred drafter updates are consumed, the ragged cache is compacted to the row's
committed slots (so the tree's 4-D mask can sit right after them), and the round's cache
becomes the batch's again. With two or more rows, rounds are chains as before.

Sampled rows (``speculative``, ``block``) keep chains, so their output stays what the batch-1
chain engine would draw for the same seed. Not with DLoop stages or carryover (refused at
construction, as ``TreeEngine`` refuses them). A mixin of ``batch.BatchEngine``; knows the
tree engine and the ragged cache, nothing about drafter families.
"""

from __future__ import annotations

from typing import Any

from components.engine.batch_cache import RaggedCache
from components.engine.batch_state import StepOutput, _check_end, _Running
from components.engine.engine import Sequence
from components.engine.tree import TreeEngine

TREE_BATCH_RULES = ("greedy", "gumbel")  # rules whose output does not depend on the drafts


class TreeStep:
    """``_tree_round`` and its setup, for ``BatchEngine``."""

    def _init_trees(self, budget: int, builder: str, loop_stages: int, carryover: bool) -> None:
        """Tree engines per rule when ``budget`` > 0 (nodes per round)."""
        self._trees: dict[str, TreeEngine] = {}
        if budget <= 0:
            return
        if self.drafter is None:
            raise ValueError("tree_budget: token trees need a drafter")
        if loop_stages > 1 or carryover:
            raise ValueError("tree_budget: token trees are not combined with DLoop stages or carryover")
        self._trees = {rule: TreeEngine(self.target, self.drafter, rule, self.gamma, budget=budget, builder=builder,
                                        preallocate=self.preallocate) for rule in TREE_BATCH_RULES}

    def _tree_row(self) -> _Running | None:
        """The running row, if it is alone, speculates and its rule verifies trees."""
        rows = self.batch.rows
        if not self._trees or len(rows) != 1:
            return None
        run = rows[0]
        return run if run.seq.draft_state is not None and run.request.rule in self._trees else None

    def _tree_round(self, run: _Running) -> tuple[list[StepOutput], int, int, float, float]:
        """One tree round of the lone row → (outputs, accepted, nodes, draft s, verify s)."""
        if run.pending:
            self._flush([run])
        cache = self.batch.cache
        if cache.holes() > 0:
            cache.compact()
        if cache.length != run.seq.length - 1:
            raise RuntimeError(f"tree round: cache holds {cache.length} slots, the row {run.seq.length - 1}")
        res, before = run.result, len(run.seq.new_tokens)
        draft0, verify0 = res.draft_seconds, res.verify_seconds
        seq = Sequence(cache.cache, run.seq.draft_state, run.seq.last_token, run.seq.length, run.seq.new_tokens)
        seq = self._trees[run.request.rule].round(seq, run.remaining, run.rnd, res)
        self.batch.cache = RaggedCache.single(seq.cache)
        run.seq = Sequence(None, seq.draft_state, seq.last_token, seq.length, seq.new_tokens)
        run.proposal = run.survival = run.raw_survival = run.drafts = None
        cut, reason = _check_end(run.request, run.seq.new_tokens, before)
        emitted = cut[before:]
        if reason:
            run.seq.new_tokens = cut
            out = StepOutput(run.request.request_id, emitted, True, reason, self._finish(run, reason))
            self._remove([0])
        else:
            out = StepOutput(run.request.request_id, emitted)
        return [out], res.accepted[-1], res.drafted[-1], res.draft_seconds - draft0, res.verify_seconds - verify0

    # provided by BatchEngine
    batch: Any
    target: Any
    drafter: Any
    gamma: int
    preallocate: bool
    _flush: Any
    _finish: Any
    _remove: Any
