"""Continuous batching: many requests share each target verification pass.

* ``continuous`` -- ``BatchEngine``: ``add``/``cancel``/``step``; one ``step`` is admit → draft →
  verify (one target forward over every row) → accept, the hot loop on one screen;
* ``state``      -- the records its collaborators receive: ``Request``, ``StepOutput``, ``Row``
  (one admitted request), ``Batch`` (the rows and their ragged cache);
* ``admit``      -- ``Admission``: waiting requests prefilled together in one padded pass;
* ``draft``      -- ``Drafting``: the round's draft cap, every row's drafts (batched where the
  drafter declares it), the drafter's updates after verification (deferred on plain rounds);
* ``tree_round`` -- ``TreeRounds``: a lone greedy/Gumbel row drafts a token tree instead of a chain;
* ``stats``      -- ``EngineStats``: engine-wide counters for dashboards and benchmarks;
* ``profile``    -- ``profile_round_times``/``stored_round_times``: the engine's round seconds per
  (batch size, cap), for the adaptive draft-length policy;
* ``adaptive``   -- ``adaptive_policy``/``loop_stages_for``: the adaptive cap over a stored profile,
  as the serve and eval stages both set it up;
* ``stream``     -- ``AsyncEngine``: requests in, async token streams out (one engine thread).

Knows the batch-1 engine's steps (``engine.engine``), the rules, the KV caches and the
draft-length policy; nothing about tokenization, HTTP or drafter families.
"""

from components.engine.batch.adaptive import OPEN_GATE, adaptive_policy, loop_stages_for
from components.engine.batch.continuous import BatchEngine
from components.engine.batch.profile import (
    RoundTimes,
    StoredProfile,
    profile_round_times,
    stored_round_times,
)
from components.engine.batch.state import Batch, Request, Row, StepOutput
from components.engine.batch.stats import EngineStats
from components.engine.batch.stream import AsyncEngine, EngineError

__all__ = [
    "OPEN_GATE",
    "AsyncEngine",
    "Batch",
    "BatchEngine",
    "EngineError",
    "EngineStats",
    "Request",
    "RoundTimes",
    "Row",
    "StepOutput",
    "StoredProfile",
    "adaptive_policy",
    "loop_stages_for",
    "profile_round_times",
    "stored_round_times",
]
