"""The adaptive draft cap: how many drafts a round of the batch engine may verify (0: a plain
round), chosen per round from a profile of the engine's round times and the acceptance seen.

* ``policy``  -- ``DraftLengthPolicy`` (what the batch engine asks), ``FixedDraftLength`` and
  ``AdaptiveDraftLength`` (DSpark-style, load-aware, self-calibrating);
* ``rows``    -- ``RowSurvival``: each row's survival estimate and record; ``round_cap`` asks the
  policy with them;
* ``times``   -- ``RoundTimes``: the seconds of a round per (batch size, cap), interpolated;
* ``profile`` -- ``profile_round_times``/``stored_round_times`` (measured once per host and
  setting, then read) and ``profile_forward_time`` (the target's forward alone);
* ``setup``   -- ``adaptive_engine``/``adaptive_policy``: the one set-up the serve and eval stages
  share; ``loop_stages_for``.

This package's ``__init__`` exports the first three only: ``profile`` and ``setup`` run the
batch engine, which itself asks the policy, so they are imported by module
(``components.engine.adaptive.setup``) or from ``components.engine``. Knows timings, acceptance
and the engine settings; nothing of configs, HTTP or drafter families.
"""

from components.engine.adaptive.policy import (
    AdaptiveDraftLength,
    DraftLengthPolicy,
    FixedDraftLength,
)
from components.engine.adaptive.rows import RowSurvival, round_cap, row_calibrated
from components.engine.adaptive.times import RoundTimes

__all__ = [
    "AdaptiveDraftLength",
    "DraftLengthPolicy",
    "FixedDraftLength",
    "RoundTimes",
    "RowSurvival",
    "round_cap",
    "row_calibrated",
]
