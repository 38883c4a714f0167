"""The offline objective: the drafter's own training layout on recorded rollouts, any registry loss.

Block drafters draw random anchors (``drafter.num_anchors`` per sequence), EAGLE-3 unrolls its
training-time test, Medusa/MTP read every position; the loss is ``train.loss``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.drafters.base import DraftBatch
from components.losses import LossOutput
from components.training.objectives.base import Objective, register_objective


@register_objective("offline")
class OfflineObjective(Objective):
    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        out = self.loss(self.drafter.training_forward(batch, generator).loss_inputs())
        return out.loss, out
