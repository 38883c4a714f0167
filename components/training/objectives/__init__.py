"""Training objectives: how a batch of recorded rollouts becomes a drafter loss.

An objective is an ``nn.Module`` whose ``forward(batch, generator)`` returns ``(loss, LossOutput)``
so that DDP sees the whole forward. The trainer runs any registered objective the same way;
a config chains them (``train.objectives: [offline, opd]``), each one starting from the drafter
the previous one produced.

- ``offline``: random anchors in the rollouts, the drafter's own layout, any registry loss;
- ``opd``: Draft-OPD: blocks where simulated greedy rounds start, two-stream OPD loss;
- ``dloop``: DLoop loop-aware training: later stages read the drafter's own states;
- ``carryover``: draft → verify → re-draft with the target's rejected states as extra context;
- ``retrace``: draft → verify → re-draft with the drafter's own rejected drafts fused into the block inputs;
- ``edr``: the expected number of rounds over each whole rollout, exactly (blocks at every anchor);
- ``base_anchored``: Domino's curriculum, the loss moved from the backbone's logits to the causal head's.

Objectives register with ``@register_objective(name)``; nothing outside this package branches
on an objective's name.
"""

from components.training.objectives import (  # noqa: F401  (registers them)
    carryover,
    curriculum,
    dloop,
    edr,
    offline,
    opd,
    retrace,
)
from components.training.objectives.base import (
    OBJECTIVES,
    Objective,
    ObjectiveContext,
    build_objective,
    objective_class,
    register_objective,
)

__all__ = ["OBJECTIVES", "Objective", "ObjectiveContext", "build_objective", "objective_class",
           "register_objective"]
