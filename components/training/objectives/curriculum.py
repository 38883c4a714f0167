"""Domino's base-anchored curriculum: train the backbone's own distribution first, then hand the
loss over to the causal head's corrected one (survey, "Domino").

    L = (1 − β)·loss(q) + β·loss(q_base),   β = max(0, 1 − step / (anneal_fraction · total))

q is what the drafter drafts from (backbone + causal head), q_base = softmax(U_k) the backbone's
own readout (``DraftTrainOutput.base_logits``); ``loss`` is ``train.loss`` for both, on the same
random anchors as the offline objective. β falls linearly from 1 to 0 over the first
``anneal_fraction`` of the stage's steps (SpecForge's Domino: half) and stays 0 after, when the
base term is not computed at all. A confidence head trains on q's acceptance only, so with
weight 1 − β (its logits enter the base term detached): what it predicts moves while the
correction starts. Without the curriculum a head that sees the prefix lets the
optimizer neglect the backbone, which every slot's draft rests on.

Where it can run: drafters declaring ``Capability.BASE_LOGITS`` (a causal head over a parallel
backbone: Domino, DSpark with a Markov or RNN head). Metrics add ``curriculum_beta`` and
``base_loss``; α and τ are q's. Knows the drafter training interface and the loss registry only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DraftBatch, Drafter
from components.drafters.capabilities import Capability, require
from components.losses import DrafterLoss, LossOutput
from components.training.objectives.base import Objective, ObjectiveContext, register_objective


def curriculum_beta(step: int, total: int, anneal_fraction: float) -> float:
    """β at optimizer step ``step`` of ``total``: 1 → 0 linearly over anneal_fraction · total steps."""
    span = anneal_fraction * max(1, total)
    return 0.0 if span <= 0 else max(0.0, 1.0 - step / span)


@register_objective("base_anchored")
class BaseAnchoredObjective(Objective):
    @dataclass
    class Params:
        anneal_fraction: float = 0.5  # share of the stage's steps over which β falls from 1 to 0

    def __init__(self, drafter: Drafter, loss: DrafterLoss, params: Any, context: ObjectiveContext):
        require(drafter, "objective 'base_anchored'", Capability.BASE_LOGITS,
                hint="it trains a causal head's backbone logits first (domino, or dspark with a markov head)")
        if not 0.0 <= params.anneal_fraction <= 1.0:
            raise ValueError(f"objective 'base_anchored': anneal_fraction must be in [0, 1], got {params.anneal_fraction}")
        super().__init__(drafter, loss, params, context)
        self.beta = 1.0 if params.anneal_fraction > 0 else 0.0

    def at_step(self, step: int, total: int) -> None:
        self.beta = curriculum_beta(step, total, self.params.anneal_fraction)

    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        out = self.drafter.training_forward(batch, generator)
        main = self.loss(out.loss_inputs())
        beta = self.beta
        terms = dict(main.terms)
        terms["curriculum_beta"] = torch.tensor(beta)
        if beta <= 0.0:
            return main.loss, LossOutput(main.loss, main.per_position, main.alpha, main.tau, terms)
        base = self.loss(out.loss_inputs(base=True))
        loss = (1.0 - beta) * main.loss + beta * base.loss
        terms["base_loss"] = base.loss.detach()
        return loss, LossOutput(loss, main.per_position, main.alpha, main.tau, terms)
