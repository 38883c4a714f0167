"""The batch engine with the adaptive draft cap, as a server runs it, set up in one place.

The serve stage's replicas and the eval stage's ``drafter_adaptive`` method both call
``adaptive_engine``, so that the eval measures what is served: ``AdaptiveDraftLength`` over the
round profile stored for the settings (``profile.stored_round_times``: measured once per host,
then read) at the batch sizes the engine will see (``profile_batch_sizes``). Under the adaptive
cap the DLoop gate is usually left open (``settings.OPEN_GATE``), so that the cap the policy
picks, 0..γ·stages, decides how many stages a round drafts (a cap of 0 is a plain round:
``loop_gate_for``); ``loop_stages_for`` gives DLoop stages to the drafters that can draft on
their own states.

Knows the drafter capabilities, the engine settings, the profile store and the policy; nothing
of configs, HTTP or evaluation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from components.drafters.capabilities import Capability, has
from components.engine.adaptive.policy import AdaptiveDraftLength
from components.engine.adaptive.profile import StoredProfile, stored_round_times
from components.engine.batch.continuous import BatchEngine
from components.engine.settings import DEFAULT_LOOP_GATE, OPEN_GATE, EngineSettings

PROFILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32)  # profiled below the engine's own largest batch


def loop_stages_for(drafter: Any, stages: int) -> int:
    """``stages`` DLoop stages for a drafter that drafts on its own states
    (``Capability.OWN_CONTEXT``: block drafters), 1 for any other (or none)."""
    return int(stages) if drafter is not None and has(drafter, Capability.OWN_CONTEXT) else 1


def loop_gate_for(gate: float | None, adaptive: bool) -> float:
    """The DLoop gate: ``gate`` when set; else open (``OPEN_GATE``) under the adaptive cap, whose
    choice of G ≤ γ·stages then decides how many stages a round drafts, and the engines' default
    with a fixed cap (which would otherwise draft every stage always)."""
    if gate is not None:
        return float(gate)
    return OPEN_GATE if adaptive else DEFAULT_LOOP_GATE


def profile_batch_sizes(max_batch_size: int) -> list[int]:
    """The batch sizes a round profile is measured at: 1, the engine's largest, and those of
    ``PROFILE_BATCH_SIZES`` between them."""
    return sorted({b for b in PROFILE_BATCH_SIZES if b < max_batch_size} | {1, int(max_batch_size)})


def adaptive_policy(target: Any, drafter: Any, settings: EngineSettings, profile_dir: str | Path,
                    max_batch_size: int,
                    notice: Callable[[Path], None] | None = None) -> tuple[AdaptiveDraftLength, StoredProfile]:
    """(the policy, its profile): ``AdaptiveDraftLength`` priced by the round profile of
    ``drafter`` under ``settings`` up to ``max_batch_size`` rows, read from ``profile_dir`` or
    measured there (``notice(path)`` first; raises ValueError for an unreadable stored file)."""
    stored = stored_round_times(profile_dir, target, drafter, profile_batch_sizes(max_batch_size), notice=notice,
                                settings=settings)
    # a slot cache's rows verify only their own drafts: a round costs its rows' mean width
    return AdaptiveDraftLength(round_time=stored.times, ragged=target.batch_cache == "slots"), stored


def adaptive_engine(target: Any, drafter: Any, settings: EngineSettings, profile_dir: str | Path,
                    max_batch_size: int, notice: Callable[[Path], None] | None = None,
                    learn_responses: bool = True, prefix_tokens: int = 0) -> tuple[BatchEngine, StoredProfile]:
    """(the engine, its profile): a ``BatchEngine`` of ``max_batch_size`` rows drafting by
    ``settings`` under the adaptive cap of ``adaptive_policy`` (``learn_responses``,
    ``prefix_tokens``: as ``BatchEngine``'s)."""
    policy, stored = adaptive_policy(target, drafter, settings, profile_dir, max_batch_size, notice)
    engine = BatchEngine(target, drafter, max_batch_size=max_batch_size, draft_length=policy, settings=settings,
                         learn_responses=learn_responses, prefix_tokens=prefix_tokens)
    return engine, stored
