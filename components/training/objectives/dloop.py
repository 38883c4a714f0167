"""DLoop loop-aware training (reference/methods-notes.md §2) for block drafters (DFlash, DSpark).

At serving, DLoop drafts several blocks before one verification: after stage 1 at anchor a,
the target states of the drafted positions a..a+γ−1 do not exist yet, so stage 2 (anchored at
the last draft, position a+γ) reads the drafter's *own* draft-slot states in their place, in
the fused-feature slot of the context (``Drafter.consume_own``). A drafter trained only on
target states drifts there; this objective trains it for that situation:

* per batch a depth S is drawn from 2..``max_stages``; stage 1 is the ordinary block at the
  sampled anchors; stage s ≥ 2 is anchored at a + (s−1)·γ with the *recorded* token there as
  its anchor token (as the paper does: ground-truth tokens, own hidden states) and reads the
  target rows before a plus the own states of stages 1..s−1 of the same chain;
* loss = ½(loss of stage 1 + loss of stage S) with the objective's registry loss;
* own states are detached by default (``bptt: false``): the digests leave it open, and
  detaching keeps one stage's graph per backward.

Stage-s training logits equal those of the inference loop (propose → consume_own → propose)
when the earlier stages' drafts were right; tests/components/training/test_dloop.py checks it.
Requires of its drafter (checked when built): ``block_internals`` (the block backbone it unrolls)
and ``own_context`` (``consume_own``, without which the trained loop cannot be served). Knows
those capabilities' Protocols; no drafter family, no new parameters, no extra target forwards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DraftBatch, Drafter, DrafterError, DraftTrainOutput
from components.drafters.capabilities import BlockInternals, Capability, require
from components.drafters.dflash import sample_anchors
from components.losses import DrafterLoss, LossOutput
from components.training.objectives.base import Objective, ObjectiveContext, register_objective


@register_objective("dloop")
class DLoopObjective(Objective):
    @dataclass
    class Params:
        max_stages: int = 3  # N: deepest unroll (S is drawn from 2..N per batch)
        bptt: bool = False  # let gradients flow from stage S back through the own states

    drafter: BlockInternals  # besides the core Drafter interface (cfg, ...)

    def __init__(self, drafter: Drafter, loss: DrafterLoss, params: Any, context: ObjectiveContext):
        require(drafter, "objective 'dloop'", Capability.BLOCK_INTERNALS, Capability.OWN_CONTEXT,
                hint="it unrolls a block drafter's stages on its own states (block drafters such as dflash "
                     "and dspark declare both)")
        super().__init__(drafter, loss, params, context)
        if params.max_stages < 2:
            raise DrafterError(f"objective 'dloop': max_stages must be >= 2, got {params.max_stages}")

    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
        depth = 2 + int(torch.randint(self.params.max_stages - 1, (1,), generator=generator))
        anchors = sample_anchors(mask, int(self.drafter.cfg.num_anchors), generator)  # [B, A]
        stages = self.stage_outputs(batch, anchors, depth)
        first, last = self.loss(stages[0][0].loss_inputs()), self.loss(stages[-1][0].loss_inputs())
        loss = 0.5 * (first.loss + last.loss)
        first.terms.update({"stage1_loss": first.loss.detach(), "last_stage_loss": last.loss.detach(),
                            "depth": torch.tensor(float(depth))})
        if last.tau is not None:
            first.terms["last_stage_tau"] = last.tau
        return loss, LossOutput(loss, first.per_position, first.alpha, first.tau, first.terms)

    def stage_outputs(self, batch: DraftBatch, anchors: Tensor, depth: int) -> list[tuple[DraftTrainOutput, Tensor]]:
        """(teacher-forced output, block states z [B, A, bs, H]) of stages 1..depth at anchors [B, A]."""
        d = self.drafter
        b, t = batch.input_ids.shape
        dev, gamma = anchors.device, d.max_speculative_tokens
        target_ctx = d.target_context(batch.hidden)
        base_visible = torch.arange(t, device=dev).view(1, 1, -1) < anchors.clamp_min(0).unsqueeze(-1)  # [B, A, T]
        z = d.block_states(batch.input_ids, anchors, target_ctx, base_visible)
        out = [(d.block_output(batch, anchors, z), z)]
        own_kv: list[tuple[Tensor, Tensor]] = []
        chain = torch.arange(anchors.shape[1], device=dev).repeat_interleave(gamma)  # own row → its anchor
        for stage in range(1, depth):
            own = d.draft_states(z)  # [B, A, γ, H]
            own = own if self.params.bptt else own.detach()
            pos = (anchors.clamp_min(0) + (stage - 1) * gamma).unsqueeze(-1) + torch.arange(gamma, device=dev)
            kv = d.backbone.features_kv(own.reshape(b, -1, own.shape[-1]), pos.reshape(b, -1))
            own_kv = kv if not own_kv else [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2))
                                            for (k0, v0), (k1, v1) in zip(own_kv, kv)]
            rows = chain.repeat(stage)  # [stage·A·γ]
            own_visible = (rows.view(1, 1, -1) == torch.arange(anchors.shape[1], device=dev).view(1, -1, 1))
            visible = torch.cat([base_visible, own_visible.expand(b, -1, -1)], dim=-1)  # [B, A, T + R]
            context = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(target_ctx, own_kv)]
            stage_anchor = anchors + stage * gamma
            stage_anchor = torch.where((anchors >= 0) & (stage_anchor < t - 1), stage_anchor, torch.full_like(anchors, -1))
            z = d.block_states(batch.input_ids, stage_anchor, context, visible)
            out.append((d.block_output(batch, stage_anchor, z), z))
        return out
