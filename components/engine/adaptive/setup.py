"""The batch engine's adaptive draft cap as a server runs it, set up in one place.

The serve stage's replicas and the eval stage's ``drafter_adaptive`` method build the same
thing, so that the eval measures what is served: ``AdaptiveDraftLength`` over the round profile
stored for the setting (``profile.stored_round_times``: measured once per host, then read), DLoop
stages where the drafter can draft on its own states, and the DLoop gate open (``OPEN_GATE``), so
that the cap the policy picks, 0..γ·stages, decides how many stages a round drafts (a cap of 0 is
a plain round).

Knows the drafter capabilities, the profile store and the policy; nothing of configs, HTTP or
evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from components.drafters.capabilities import Capability, has
from components.engine.adaptive.policy import AdaptiveDraftLength
from components.engine.adaptive.profile import StoredProfile, stored_round_times

OPEN_GATE = float("-inf")  # DLoop gate under the adaptive cap: every stage allowed, the cap decides


def loop_stages_for(drafter: Any, stages: int) -> int:
    """``stages`` DLoop stages for a drafter that drafts on its own states
    (``Capability.OWN_CONTEXT``: block drafters), 1 for any other (or none)."""
    return int(stages) if drafter is not None and has(drafter, Capability.OWN_CONTEXT) else 1


def adaptive_policy(target: Any, drafter: Any, profile_dir: str | Path, batch_sizes: Sequence[int],
                    engine_kwargs: dict[str, Any],
                    notice: Callable[[Path], None] | None = None) -> tuple[AdaptiveDraftLength, StoredProfile]:
    """(the policy, its profile): ``AdaptiveDraftLength`` priced by the round profile of
    ``drafter`` under ``engine_kwargs`` at ``batch_sizes``, read from ``profile_dir`` or measured
    there (``notice(path)`` first; raises ValueError for an unreadable stored file)."""
    stored = stored_round_times(profile_dir, target, drafter, batch_sizes, notice=notice, **engine_kwargs)
    return AdaptiveDraftLength(round_time=stored.times), stored
