"""Continuous batching: many requests share each target verification pass.

* ``continuous`` -- ``BatchEngine``: ``add``/``cancel``/``step``; one ``step`` is admit → draft →
  verify (one target forward over every row) → accept, the hot loop on one screen;
* ``state``      -- the records its collaborators receive: ``Request``, ``StepOutput``, ``Row``
  (one admitted request), ``Batch`` (the rows and their ragged cache);
* ``admit``      -- ``Admission``: waiting requests prefilled together in one padded pass;
* ``draft``      -- ``Drafting``: the round's draft cap, every row's drafts (batched where the
  drafter declares it), the drafter's updates after verification (deferred on plain rounds);
* ``tree_round`` -- ``TreeRounds``: a lone row whose rule allows it drafts a token tree instead
  of a chain;
* ``stats``      -- ``EngineStats``: engine-wide counters for dashboards and benchmarks;
* ``stream``     -- ``AsyncEngine``: requests in, async token streams out (one engine thread).

Knows the chain and tree rounds' steps (``engine.chain``, ``engine.tree``), the settings, the
rules, the KV caches and the draft-length policy's interface (``engine.adaptive``); nothing
about tokenization, HTTP or drafter families.
"""

from components.engine.batch.continuous import BatchEngine
from components.engine.batch.state import Batch, Request, Row, StepOutput
from components.engine.batch.stats import EngineStats
from components.engine.batch.stream import AsyncEngine, EngineError

__all__ = [
    "AsyncEngine",
    "Batch",
    "BatchEngine",
    "EngineError",
    "EngineStats",
    "Request",
    "Row",
    "StepOutput",
]
