"""The speculative decoding engine: prefill, draft, verify, accept.

* ``engine``     -- ``SpeculativeEngine.generate`` (batch 1, chains; DLoop stages, carryover),
  the ``target_only_generate`` baseline, the drafter protocol the engines need;
* ``tree``       -- ``TreeEngine``: DDTree / causal token trees per round (batch 1);
* ``rules``      -- greedy / Gumbel / speculative / block rules as the engines apply them;
* ``model_free`` -- oracle, target-as-drafter and prompt-lookup drafters behind the same protocol;
* ``adaptive/``  -- the draft cap per round: fixed, or adaptive (DSpark-style, load-aware) over a
  round profile; the set-up the serve and eval stages share (``adaptive_policy``);
* ``cache/``     -- the target's KV caches: preallocated layers (``slab``), a batch's ragged cache
  (``ragged``);
* ``batch/``     -- continuous batching: ``BatchEngine`` and its records, admission, batched
  drafting, tree rounds, stats and async streams (``AsyncEngine``).

What an engine feature needs of a drafter beyond the core protocol is declared by the drafter
(``components.drafters.capabilities``) and checked when the engine is built. Knows nothing about
tokenization or drafter families; see ``engine.py`` for what is left out.
"""

from components.engine.adaptive import AdaptiveDraftLength, FixedDraftLength
from components.engine.adaptive.profile import (
    StoredProfile,
    profile_round_times,
    stored_round_times,
)
from components.engine.adaptive.setup import OPEN_GATE, adaptive_policy, loop_stages_for
from components.engine.batch import AsyncEngine, BatchEngine, EngineError, Request, StepOutput
from components.engine.engine import GenerationResult, SpeculativeEngine, target_only_generate
from components.engine.model_free import OracleDrafter, PromptLookupDrafter, TargetDrafter
from components.engine.rules import RULES
from components.engine.tree import TreeEngine

__all__ = [
    "OPEN_GATE",
    "RULES",
    "AdaptiveDraftLength",
    "AsyncEngine",
    "BatchEngine",
    "EngineError",
    "FixedDraftLength",
    "GenerationResult",
    "OracleDrafter",
    "PromptLookupDrafter",
    "Request",
    "SpeculativeEngine",
    "StepOutput",
    "StoredProfile",
    "TargetDrafter",
    "TreeEngine",
    "adaptive_policy",
    "loop_stages_for",
    "profile_round_times",
    "stored_round_times",
    "target_only_generate",
]
