"""Draft-OPD on-policy objective (reference/methods-notes.md §1).

Per batch: simulate greedy draft–verify rounds of the *current* drafter over the recorded
rollouts (components/training/rounds.py, no gradients), keep the anchors where rounds start
(at most ``max_anchors`` per row, a random subset beyond), replay the drafter's block at those
anchors and apply the two-stream loss (registry ``opd`` by default): forward KL on the accepted
drafts and the correction position, decayed reverse KL on the first rejected draft.

Why this is on-policy although the text is the target's: which anchors exist and where each
block stops being trained depend on the drafter's own greedy drafts. Replaying the causal head
on its own samples equals teacher forcing here, since every trained position lies at or before
the first rejection, where the drafter's samples and the data tokens agree.

Knows the drafter interface and the round simulation; works for every registered drafter.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from components.drafters.base import DraftBatch
from components.losses import LossOutput
from components.training.objectives.base import Objective, register_objective
from components.training.rounds import anchor_tensor, simulate_rounds


@register_objective("opd")
class DraftOPDObjective(Objective):
    default_loss = "opd"

    @dataclass
    class Params:
        max_anchors: int = 0  # round starts trained per row (0: the drafter's num_anchors)
        chunk: int = 32  # anchors per no-grad simulation pass

    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        rounds = simulate_rounds(self.drafter, batch, self.params.chunk)
        limit = self.params.max_anchors or int(self.drafter.cfg.num_anchors)
        anchors = anchor_tensor(rounds.anchors, limit, generator).to(batch.input_ids.device)
        out = self.loss(self.drafter.training_forward(dataclasses.replace(batch, anchors=anchors)).loss_inputs())
        out.terms["sim_tau"] = torch.tensor(rounds.tau())
        return out.loss, out
