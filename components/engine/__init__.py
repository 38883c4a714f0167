"""The speculative decoding engine: prefill, draft, verify, accept.

* ``core``       -- what every engine shares: the drafter protocol (``EngineDrafter``), the
  records (``SequenceState``, ``GenerationResult``), randomness and cache helpers;
* ``settings``   -- ``EngineSettings``: γ, DLoop stages and gate, carryover, trees, preallocation,
  resolved once per drafter (``resolve_settings``); every default written once;
* ``chain``      -- the chain round's steps as functions (prefill, draft, verify, accept, commit,
  carry over), run by both the batch-1 and the batch engine;
* ``single``     -- ``SpeculativeEngine`` (batch 1, chains), the ``decode`` loop and the
  ``target_only_generate`` baseline;
* ``tree``       -- ``TreeEngine`` and ``tree_round``: DDTree / causal token trees per round;
* ``rules``      -- greedy / Gumbel / speculative / block rules as the engines apply them, each
  declaring where it may verify (``components.ruleset`` holds the same table for the config);
* ``model_free`` -- oracle, target-as-drafter and prompt-lookup drafters behind the same protocol;
* ``suffix``     -- suffix decoding (SuffixDecoding): a model-free drafter over suffix trees of the
  request and of earlier responses (``SuffixDrafter.observe``);
* ``suffix_tree`` -- ``SuffixTree``: the depth-limited suffix trie those trees are, exact counts;
* ``match_calibration`` -- how often a suffix draft read after a match of each length is right,
  learned from the ids requests commit (the confidences the adaptive cap reads);
* ``hybrid``     -- ``HybridDrafter``: per request and round, the suffix draft when its score
  clears a threshold, else a trained drafter's, which consumes the target's states every round;
* ``adaptive/``  -- the draft cap per round: fixed, or adaptive (DSpark-style, load-aware) over a
  round profile; the set-up the serve and eval stages share (``adaptive_engine``);
* ``cache/``     -- the target's KV caches: preallocated layers (``slab``), a batch's ragged cache
  (``ragged``);
* ``batch/``     -- continuous batching: ``BatchEngine`` and its records, admission, batched
  drafting, tree rounds, stats and async streams (``AsyncEngine``).

What an engine feature needs of a drafter beyond the core protocol is declared by the drafter
(``components.drafters.capabilities``) and checked when the settings are resolved. Knows
nothing about tokenization or drafter families; see ``single.py`` for what is left out.
"""

from components.engine.adaptive import AdaptiveDraftLength, FixedDraftLength, RoundTimes
from components.engine.adaptive.profile import (
    StoredProfile,
    profile_round_times,
    stored_round_times,
)
from components.engine.adaptive.setup import (
    adaptive_engine,
    adaptive_policy,
    loop_gate_for,
    loop_stages_for,
)
from components.engine.batch import AsyncEngine, BatchEngine, EngineError, Request, StepOutput
from components.engine.core import GenerationResult
from components.engine.hybrid import HybridDrafter
from components.engine.model_free import OracleDrafter, PromptLookupDrafter, TargetDrafter
from components.engine.rules import RULES
from components.engine.settings import (
    DEFAULT_LOOP_GATE,
    OPEN_GATE,
    TREE_BUILDERS,
    EngineSettings,
    resolve_settings,
)
from components.engine.single import SpeculativeEngine, target_only_generate
from components.engine.suffix import SuffixDrafter, suffix_drafter
from components.engine.tree import TreeEngine

__all__ = [
    "DEFAULT_LOOP_GATE",
    "OPEN_GATE",
    "RULES",
    "TREE_BUILDERS",
    "AdaptiveDraftLength",
    "AsyncEngine",
    "BatchEngine",
    "EngineError",
    "EngineSettings",
    "FixedDraftLength",
    "GenerationResult",
    "HybridDrafter",
    "OracleDrafter",
    "PromptLookupDrafter",
    "Request",
    "RoundTimes",
    "SpeculativeEngine",
    "StepOutput",
    "StoredProfile",
    "SuffixDrafter",
    "TargetDrafter",
    "TreeEngine",
    "adaptive_engine",
    "adaptive_policy",
    "loop_gate_for",
    "loop_stages_for",
    "profile_round_times",
    "resolve_settings",
    "stored_round_times",
    "suffix_drafter",
    "target_only_generate",
]
