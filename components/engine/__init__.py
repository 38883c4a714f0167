"""The speculative decoding engine (batch 1, chains): prefill, draft, verify, accept.

* ``engine``     -- ``SpeculativeEngine.generate`` and the ``target_only_generate`` baseline;
* ``rules``      -- greedy / Gumbel / speculative / block rules as the engine applies them;
* ``model_free`` -- oracle, target-as-drafter and prompt-lookup drafters behind the same protocol.

Knows nothing about tokenization or drafter families; see ``engine.py`` for what is left out.
"""

from components.engine.engine import GenerationResult, SpeculativeEngine, target_only_generate
from components.engine.model_free import OracleDrafter, PromptLookupDrafter, TargetDrafter
from components.engine.rules import RULES

__all__ = [
    "RULES",
    "GenerationResult",
    "OracleDrafter",
    "PromptLookupDrafter",
    "SpeculativeEngine",
    "TargetDrafter",
    "target_only_generate",
]
