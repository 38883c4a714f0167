"""EDR, the sequence-level objective: minimise the expected number of draft–verify rounds over
each recorded rollout, under the drafter's own occupancy of round starts (``losses/edr.py``).

Per batch: the drafter's block at *every* anchor of each row's response (the first response
token, which the prefill produced, to the second-to-last; about twice the offline objective's
64 random anchors on 128-token responses), each slot's acceptance c = 1 − TV(p, q) with its
gradient (the same α the DSpark loss trains, by the fused kernel where it runs), then the
exact expected rounds by dynamic programming and its exact gradient (``edr_surrogate``): every
anchor's slots weighted by how likely a round is to start there and by the rounds the outcomes
leave. Loss = Σ_rows E[#rounds] / Σ_rows anchors (rounds per generated token, 1/τ), so it has
no weights to tune; a confidence head (DSpark) keeps training on the same blocks as in the
DSpark loss (BCE to sg[α], ``confidence_weight``), and ``ce_weight`` > 0 adds the data tokens'
cross-entropy (0: EDR alone). ``sim_tau`` in the metrics is n / E[#rounds].

Where it can run: block drafters (``Capability.BLOCK_INTERNALS``: DFlash, DSpark), whose
``training_forward`` lays one block out at each given anchor (``DraftBatch.anchors``). For an
autoregressive drafter the expected rounds are the summed per-token TV (``losses/edr.py``), which
the per-token losses train already. Rows are independent, so DDP shards them as usual.
Knows the drafter training interface and the loss components; nothing about Ray or files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DraftBatch, Drafter
from components.drafters.capabilities import Capability, require
from components.losses import DrafterLoss, LossOutput
from components.losses.common import (
    acceptance_stats,
    position_mean,
    safe_tokens,
    target_probs,
    upcast,
    valid_mask,
)
from components.losses.confidence import confidence_terms
from components.losses.edr import edr_surrogate
from components.losses.fused import fused_available, fused_tv_ce
from components.losses.overlap import overlap_tv
from components.training.objectives.base import Objective, ObjectiveContext, register_objective


def every_anchor(loss_mask: Tensor) -> tuple[Tensor, Tensor]:  # [B, T] -> ([B, S] long, -1 padded; [B])
    """Per row, every position from its first response token on whose next token is supervised,
    in order (so anchor index s + j + 1 is the round after s accepting j), and their count."""
    mask = loss_mask.bool()
    cand = mask[:, 1:] & mask[:, :-1]  # a: response token at a, supervised x_{a+1}
    lengths = cand.sum(1)
    width = max(1, int(lengths.max()))
    order = torch.where(cand, torch.arange(cand.shape[1], device=mask.device), cand.shape[1])
    anchors = order.sort(dim=1).values[:, :width]
    return torch.where(anchors < cand.shape[1], anchors, -1), lengths


@register_objective("edr")
class EDRObjective(Objective):
    default_loss = "tv_ce_confidence"  # not applied: EDR forms its own loss (module docstring)

    @dataclass
    class Params:
        confidence_weight: float = 1.0  # a confidence head's BCE to sg[α] (DSpark's; 0: untrained)
        ce_weight: float = 0.0  # the data tokens' cross-entropy beside EDR (0: EDR alone)

    def __init__(self, drafter: Drafter, loss: DrafterLoss, params: Any, context: ObjectiveContext):
        require(drafter, "objective 'edr'", Capability.BLOCK_INTERNALS,
                hint="it lays a block out at every anchor (block drafters such as dflash and dspark); for an "
                     "autoregressive drafter the expected rounds are the summed per-token TV a per-token loss trains")
        super().__init__(drafter, loss, params, context)

    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        if batch.loss_mask is None:
            raise ValueError("the edr objective needs the batch's loss mask (which tokens are the response)")
        anchors, lengths = every_anchor(batch.loss_mask)
        anchors = anchors.to(batch.input_ids.device)
        inputs = self.drafter.training_forward(dataclasses.replace(batch, anchors=anchors)).loss_inputs()
        n, gamma = inputs.draft_logits.shape[:2]
        if n != anchors.numel():
            raise ValueError(f"the edr objective needs one block per anchor; drafter '{self.drafter.cfg.name}' "
                             f"laid out {n} blocks for {anchors.numel()} anchors")
        mask = valid_mask(inputs.valid, inputs.draft_logits[..., 0])
        alpha, tv, ce = self._acceptance(inputs, mask)
        accept = torch.where(mask, 1.0 - tv, torch.zeros_like(tv)).view(*anchors.shape, gamma)  # [B, S, γ]
        rounds = edr_surrogate(accept.double(), lengths.to(accept.device))  # [B]
        tokens = lengths.sum().clamp_min(1).to(rounds.dtype)
        loss = (rounds.sum() / tokens).float()
        terms = {"edr_rounds_per_token": loss.detach(), "sim_tau": (tokens / rounds.detach().sum().clamp_min(1e-9))}
        if self.params.confidence_weight and inputs.confidence_logits is not None:
            conf = confidence_terms(inputs.confidence_logits, alpha)
            conf_mean = (conf * mask).sum() / mask.sum().clamp_min(1)
            loss = loss + self.params.confidence_weight * conf_mean
            terms["confidence"] = conf_mean.detach()
        if self.params.ce_weight:
            ce_mean = (ce * mask).sum() / mask.sum().clamp_min(1)
            loss = loss + self.params.ce_weight * ce_mean
            terms["ce"] = ce_mean.detach()
        alpha_mean, tau = acceptance_stats(alpha, mask)
        return loss, LossOutput(loss, position_mean(tv.detach(), mask), alpha_mean, tau, terms)

    def _acceptance(self, inputs, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:  # -> α (detached), TV, CE [N, γ]
        """α and TV per slot (TV with its gradient) and the data tokens' CE, by the fused kernel
        where it runs (as the DSpark loss computes them)."""
        if fused_available(inputs.target_logits, inputs.draft_logits):
            alpha, tv, log_q = fused_tv_ce(inputs.target_logits, inputs.draft_logits,
                                           safe_tokens(inputs.target_tokens, mask), 1.0)
            return alpha, tv, -log_q
        logits = upcast(inputs.draft_logits)
        alpha, tv = overlap_tv(target_probs(inputs.target_logits), logits)
        log_q = torch.log_softmax(logits, dim=-1).gather(-1, safe_tokens(inputs.target_tokens, mask).unsqueeze(-1))
        return alpha.detach(), tv, -log_q.squeeze(-1)
