"""Aggregate counters of a running batch engine, for dashboards and benchmarks.

Per-request figures live in ``GenerationResult``; these are engine-wide, summed over rounds:
tokens emitted, rounds, mean batch size, τ (over the rows' drafting rounds, as vLLM counts) and
the share of row-rounds that drafted (a row of a cap of 0, plain decoding or an empty proposal
steps plainly), acceptance by draft position, draft / verify / busy seconds and tokens per busy
second, the prompt tokens admitted and those copied from kept prefixes. ``summary()`` gives plain
numbers (a serving layer exports them as metrics). Knows nothing about models or requests'
contents.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    rounds: int = 0
    row_rounds: int = 0  # Σ over rounds of the rows in the batch (mean batch = row_rounds / rounds)
    tokens: int = 0  # tokens emitted, prefill tokens included
    finished: int = 0  # requests finished (any reason)
    drafting_rounds: int = 0  # (row, round) pairs that drafted (≥ 1 draft verified)
    drafted: int = 0
    accepted: int = 0
    accepted_at: list[int] = field(default_factory=list)  # per draft position k: times accepted
    reached_at: list[int] = field(default_factory=list)  # per draft position k: times drafted and reached
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # the batched target forward
    prefill_seconds: float = 0.0  # admission: the prefill passes of requests joining the batch
    busy_seconds: float = 0.0  # whole rounds, admission (prefill) included
    prompt_tokens: int = 0  # of the requests admitted
    prefix_hit_tokens: int = 0  # of those, copied from kept prompt prefixes instead of computed

    def record(self, rows: int, accepted: list[int], drafted: list[int], emitted: int, finished: int,
               draft_seconds: float, verify_seconds: float, busy_seconds: float, prefill_seconds: float = 0.0) -> None:
        """One round: rows in the batch, accepted/drafted per drafting row, tokens emitted."""
        self.rounds += 1
        self.row_rounds += rows
        self.tokens += emitted
        self.finished += finished
        self.drafting_rounds += len(drafted)
        self.drafted += sum(drafted)
        self.accepted += sum(accepted)
        for a, d in zip(accepted, drafted):
            while len(self.reached_at) < d:
                self.reached_at.append(0)
                self.accepted_at.append(0)
            for k in range(min(a + 1, d)):
                self.reached_at[k] += 1
                self.accepted_at[k] += int(k < a)
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.prefill_seconds += prefill_seconds
        self.busy_seconds += busy_seconds

    def summary(self) -> dict[str, float | list[float]]:
        busy = max(self.busy_seconds, 1e-12)
        return {
            "rounds": self.rounds, "tokens": self.tokens, "finished": self.finished,
            "mean_batch": self.row_rounds / max(1, self.rounds),
            "tau": 1 + self.accepted / self.drafting_rounds if self.drafting_rounds else 1.0,
            "drafting_share": self.drafting_rounds / self.row_rounds if self.row_rounds else 0.0,
            "alpha_by_position": [a / r if r else 0.0 for a, r in zip(self.accepted_at, self.reached_at)],
            "tokens_per_second": self.tokens / busy,
            "draft_share": self.draft_seconds / busy, "verify_share": self.verify_seconds / busy,
            "prefill_share": self.prefill_seconds / busy,
            "prefix_hit_share": self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
        }
