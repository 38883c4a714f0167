"""The speculative decoding engine (chains): prefill, draft, verify, accept.

* ``engine``     -- ``SpeculativeEngine.generate`` (batch 1) and the ``target_only_generate`` baseline;
* ``batch``      -- ``BatchEngine``: continuous batching over a ragged KV cache (``batch_cache``),
  per-request rules/sampling/seeds/stop tokens, cancellation;
* ``tree``       -- ``TreeEngine``: DDTree token trees per round (batch 1), greedy/Gumbel/sampling;
* ``schedule``   -- fixed or adaptive (DSpark-style, load-aware) draft cap per round;
* ``profile``    -- the batch engine's round times per (batch size, cap), for the adaptive cap;
* ``async_engine`` -- ``AsyncEngine``: requests in, async token streams out (for serving);
* ``rules``      -- greedy / Gumbel / speculative / block rules as the engine applies them;
* ``model_free`` -- oracle, target-as-drafter and prompt-lookup drafters behind the same protocol.

Knows nothing about tokenization or drafter families; see ``engine.py`` for what is left out.
"""

from components.engine.async_engine import AsyncEngine, EngineError
from components.engine.batch import BatchEngine, Request, StepOutput
from components.engine.engine import GenerationResult, SpeculativeEngine, target_only_generate
from components.engine.model_free import OracleDrafter, PromptLookupDrafter, TargetDrafter
from components.engine.rules import RULES
from components.engine.tree import TreeEngine

__all__ = [
    "RULES",
    "AsyncEngine",
    "BatchEngine",
    "EngineError",
    "GenerationResult",
    "OracleDrafter",
    "PromptLookupDrafter",
    "Request",
    "SpeculativeEngine",
    "StepOutput",
    "TargetDrafter",
    "TreeEngine",
    "target_only_generate",
]
