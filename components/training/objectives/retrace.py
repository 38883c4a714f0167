"""ReTrace-style rejected-suffix reuse: draft → verify → re-draft reading the rejected drafts
(``components/drafters/retrace.py``: the recycle gate and how drafts align with the next block).

Per batch of recorded target rollouts, for block drafters declaring ``block_internals`` and
``recycles``:

1. **First draft, no gradients.** As the carryover objective's (``carryover.first_drafts``):
   greedy free-running blocks at anchors a, exactly what ``propose`` drafts; m = the leading
   drafts equal to the recorded tokens; the drafter's slot states z of every draft are kept.
2. **Verify, free.** The rollouts are the target's own: the target's token at the first
   rejected position a+m+1 is the recorded x_{a+m+1} (the correction; exact for greedy
   rollouts, a draw of the target's for sampled ones). No target forward, unlike carryover.
3. **Re-draft, with gradients.** The block anchored at a2 = a+m+1 reads the recorded target
   context < a2 (as after the round at inference) and, in its input slots, the first draft's
   rejected suffix aligned with it (``retrace.align``: states z, detached, and the signal
   embed(x_{a+m+1}) − embed(d_{m+1})) through the recycle gate. The stage's loss is on these
   second blocks only, so gradients reach the gate and the whole drafter.

As carryover: anchors with a full accept are kept and trained as plain blocks at a2 (nothing
to recycle, as at inference), and second anchors whose first target is outside the sequence
or unsupervised are dropped. ``drafter_overrides`` sets ``drafter.retrace`` when the chain
loads the previous objective's drafter: the gate's projections start at zero, so the drafter
starts as exactly the previous one. Knows the ``block_internals`` and ``recycles`` Protocols;
no drafter family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from components.drafters.base import DraftBatch, Drafter, DrafterError, gather_positions
from components.drafters.capabilities import Capability, require
from components.drafters.retrace import align
from components.losses import DrafterLoss, LossOutput
from components.training.objectives.base import Objective, ObjectiveContext, register_objective
from components.training.objectives.carryover import first_drafts_at_sampled_anchors


@register_objective("retrace")
class RetraceObjective(Objective):
    drafter_overrides: ClassVar[dict[str, Any]] = {"retrace": True}

    @dataclass
    class Params:
        max_anchors: int = 0  # first-draft anchors per row (0: the drafter's num_anchors)
        chunk: int = 32  # anchors per no-grad first-draft pass

    def __init__(self, drafter: Drafter, loss: DrafterLoss, params: Any, context: ObjectiveContext):
        require(drafter, "objective 'retrace'", Capability.BLOCK_INTERNALS,
                hint="it unrolls a block drafter's backbone (block drafters such as dflash and dspark declare it)")
        require(drafter, "objective 'retrace'", Capability.RECYCLES,
                hint="build or load the drafter with drafter.retrace=true (the objective chain sets it via "
                     "drafter_overrides)")
        if int(params.chunk) < 1:
            raise DrafterError(f"objective 'retrace': chunk must be >= 1, got {params.chunk}")
        super().__init__(drafter, loss, params, context)

    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        d: Any = self.drafter
        first = first_drafts_at_sampled_anchors(d, batch, self.params.max_anchors, self.params.chunk, generator)
        correction = gather_positions(batch.input_ids, first.second)  # [B, A] x_{a+m+1}
        recycled = align(first.states, first.drafts, first.accepted, correction, int(d.cfg.block_size),
                         d.first_slot, d.embed)
        t = batch.input_ids.shape[1]
        second = first.second
        visible = torch.arange(t, device=second.device).view(1, 1, -1) < second.clamp_min(0).unsqueeze(-1)
        z = d.block_states(batch.input_ids, second, d.target_context(batch.hidden), visible, recycled=recycled)
        out = self.loss(d.block_output(batch, second, z).loss_inputs())
        used, trained = first.anchors >= 0, second >= 0
        with_rows = recycled.present.any(-1) & trained
        out.terms.update({
            "retrace_first_accepted": first.accepted[used].float().mean(),  # mean m (greedy, first draft)
            "retrace_fraction": with_rows[trained].float().mean(),  # trained blocks that read recycled drafts
            "retrace_blocks": trained.sum(1).float().mean(),  # trained second blocks per row
        })
        return out.loss, out
