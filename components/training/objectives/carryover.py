"""Carryover drafting: draft → verify → re-draft with the target's rejected states (methods-notes §3).

Per batch of recorded target rollouts, for block drafters declaring ``block_internals`` and ``carryover``:

1. **First draft, no gradients.** Anchors a as the offline objective samples them (at most
   ``max_anchors`` per row). Each block is drafted greedily and free-running, exactly as
   ``propose`` does at inference: one backbone pass, then the drafter's ``sample_readout`` with
   temperature 0 (DSpark's Markov head reads its own previous draft). m = the leading drafts
   d_1..d_m equal to the recorded x_{a+1}..x_{a+m}, among the checkable ones (inside the
   sequence and supervised).
2. **Verify, no gradients.** For every anchor with a rejection (m < checkable drafts), the frozen
   target (``ObjectiveContext.target``) runs the branch [x_0..x_{a+m}, d_{m+1}..d_γ]; its taps at
   the drafter's layer ids at positions a+m+1..a+γ are the rejected states H_rej (γ − m rows per
   anchor). ``verify: tree`` runs all of a record's branches in one pass: the record's tokens up
   to its last branch point, then every branch's drafts, each branch attending to its own prefix
   and itself (a 4D mask, positions set per branch), so a prefix is computed once for all the
   branches that share it. ``branches`` runs each branch as its own sequence (right-padded
   batches of ``verify_chunk`` branches, sorted by length): every branch recomputes its prefix.
   ``auto``: tree where the target's family declares attention that takes such a mask
   (``TREE_MASK_FAMILIES``), else branches. Both give the same states up to float32 rounding.
3. **Re-draft, with gradients.** The block anchored at a2 = a+m+1 (the correction token, the
   recorded x_{a+m+1}) reads the recorded target context at positions < a2 plus its own anchor's
   carryover rows: ``backbone.fuse(H_rej + E_carry)`` at their original positions a+m+1..a+γ,
   projected by each layer's own K/V. Carryover rows are visible only to the block of the anchor
   that produced them. The loss is the stage's registry loss on these second blocks only, so
   gradients reach the second draft, the shared projections and E_carry (``carry_embed``).

Choices: anchors with a full accept (m = all checkable drafts) are kept and trained as plain
blocks at a2 with no carryover rows: at inference the carryover KV is empty after a full accept,
and this keeps that case in the training distribution. Second anchors whose first target x_{a2+1}
is outside the sequence or unsupervised are dropped (-1) before verification, so the target never
runs a branch that cannot be trained.

Requires of its drafter (checked when built, :func:`components.drafters.capabilities.require`):
``block_internals`` (the block backbone it unrolls) and ``carryover`` (E_carry, which exists with
``drafter.carryover=true``; ``drafter_overrides`` sets it when the chain loads the previous
objective's drafter, so E_carry starts at zero and the drafter starts as exactly the previous
one). Knows those two capabilities' Protocols and the target interface; no drafter family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor

from components.drafters.base import (
    DraftBatch,
    Drafter,
    DrafterError,
    DraftTrainOutput,
    block_tokens,
)
from components.drafters.capabilities import BlockInternals, Capability, Carryover, require
from components.drafters.dflash import sample_anchors
from components.drafters.layers import KV
from components.losses import DrafterLoss, LossOutput
from components.spec.sampling import GREEDY
from components.training.objectives.base import Objective, ObjectiveContext, register_objective

VERIFY_MODES = ("auto", "tree", "branches")
# HF model types whose attention takes a custom 4D mask with position ids (branches sharing a prefix)
TREE_MASK_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def tree_masks(target: Any) -> bool:
    """Whether ``target`` (a ``Target``) is of a family declared to take a branch mask."""
    config = getattr(getattr(target, "model", None), "config", None)
    return getattr(config, "model_type", None) in TREE_MASK_FAMILIES


class CarryoverDrafter(BlockInternals, Carryover, Protocol):
    """What this objective uses of its drafter: the block backbone and E_carry."""


@dataclass
class FirstDraft:
    """The no-gradient first draft of every anchor, and where its second draft starts."""

    anchors: Tensor  # [B, A] long, first-draft anchors a (-1 unused)
    drafts: Tensor  # [B, A, γ] long, greedy free-running drafts d_1..d_γ
    accepted: Tensor  # [B, A] long, m: leading drafts equal to the recorded tokens
    checkable: Tensor  # [B, A] long, drafts inside the sequence and supervised
    second: Tensor  # [B, A] long, a2 = a + m + 1 where its block can be trained, else -1
    rows: Tensor  # [B, A] long, carryover rows γ − m (0: full accept or no second block)
    states: Tensor | None = None  # [B, A, γ, H] the drafter's slot states of the drafts (no gradient)


@torch.no_grad()
def first_drafts(d: Any, batch: DraftBatch, anchors: Tensor, chunk: int) -> FirstDraft:
    """Greedy free-running drafts of every anchor's block (what ``propose`` would draft), in
    no-gradient passes of ``chunk`` anchors, with where each re-draft starts (module docstring);
    ``d``: a drafter declaring ``block_internals``."""
    was_training = d.training
    d.eval()
    try:
        t = batch.input_ids.shape[1]
        gamma = d.max_speculative_tokens
        context = d.target_context(batch.hidden)
        drafts = torch.zeros(*anchors.shape, gamma, dtype=torch.long, device=anchors.device)
        states = None
        for lo in range(0, anchors.shape[1], chunk):
            a = anchors[:, lo:lo + chunk]
            visible = torch.arange(t, device=a.device).view(1, 1, -1) < a.clamp_min(0).unsqueeze(-1)
            z = d.draft_states(d.block_states(batch.input_ids, a, context, visible))  # [B, A', γ, H]
            last = torch.gather(batch.input_ids, 1, a.clamp(0, t - 1))
            prop = d.sample_readout(z.reshape(-1, gamma, z.shape[-1]), last.reshape(-1), GREEDY, None)
            drafts[:, lo:lo + a.shape[1]] = prop.tokens.view(*a.shape, gamma)
            if states is None:
                states = z.new_zeros(*anchors.shape, gamma, z.shape[-1])
            states[:, lo:lo + a.shape[1]] = z
    finally:
        d.train(was_training)
    tokens, valid = block_tokens(batch, anchors, gamma)  # [B, A, γ] x_{a+1..a+γ}, checkable
    accepted = torch.cumprod(((drafts == tokens) & valid).to(torch.int32), dim=-1).sum(-1).long()
    checkable = valid.sum(-1).long()
    second = anchors + accepted + 1
    second = torch.where(_supervised_next(batch, second) & (checkable > 0), second, torch.full_like(second, -1))
    rows = torch.where((accepted < checkable) & (second >= 0), gamma - accepted, torch.zeros_like(accepted))
    return FirstDraft(anchors, drafts, accepted, checkable, second, rows, states)


def first_drafts_at_sampled_anchors(d: Any, batch: DraftBatch, max_anchors: int, chunk: int,
                                    generator: torch.Generator | None) -> FirstDraft:
    """``first_drafts`` at the batch's anchors, else at up to ``max_anchors`` per row (0: the
    drafter's ``num_anchors``) sampled as the offline objective samples them: the first step
    of every draft → verify → re-draft objective (carryover, retrace)."""
    loss_mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
    limit = max_anchors or int(d.cfg.num_anchors)
    anchors = batch.anchors if batch.anchors is not None else sample_anchors(loss_mask, limit, generator)
    return first_drafts(d, batch, anchors, chunk)


def _supervised_next(batch: DraftBatch, anchors: Tensor) -> Tensor:
    """[B, A] bool: anchor >= 0 and x_{a+1} is inside the sequence and supervised."""
    t = batch.input_ids.shape[1]
    mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
    nxt = anchors + 1
    ok = (anchors >= 0) & (nxt < t)
    return ok & torch.gather(mask.bool(), 1, nxt.clamp(0, t - 1))


@register_objective("carryover")
class CarryoverObjective(Objective):
    drafter_overrides: ClassVar[dict[str, Any]] = {"carryover": True}

    @dataclass
    class Params:
        max_anchors: int = 0  # first-draft anchors per row (0: the drafter's num_anchors)
        chunk: int = 32  # anchors per no-grad first-draft pass
        verify_chunk: int = 16  # rejected branches per target forward (verify: branches)
        verify: str = "auto"  # auto | tree | branches (module docstring)

    drafter: CarryoverDrafter  # besides the core Drafter interface (layer_ids, cfg, train/eval)

    def __init__(self, drafter: Drafter, loss: DrafterLoss, params: Any, context: ObjectiveContext):
        require(drafter, "objective 'carryover'", Capability.BLOCK_INTERNALS,
                hint="it unrolls a block drafter's backbone (block drafters such as dflash and dspark declare it)")
        require(drafter, "objective 'carryover'", Capability.CARRYOVER,
                hint="build or load the drafter with drafter.carryover=true "
                     "(the objective chain sets it via drafter_overrides)")
        if context.target is None:
            raise DrafterError("objective 'carryover' verifies drafts with the frozen target: "
                               "ObjectiveContext.target is None")
        for name in ("chunk", "verify_chunk"):
            if int(getattr(params, name)) < 1:
                raise DrafterError(f"objective 'carryover': {name} must be >= 1, got {getattr(params, name)}")
        if params.verify not in VERIFY_MODES:
            raise DrafterError(f"objective 'carryover': verify must be one of {list(VERIFY_MODES)}, got '{params.verify}'")
        if params.verify == "tree" and not tree_masks(context.target):
            raise DrafterError("objective 'carryover': verify: tree needs a target whose attention takes a branch "
                               f"mask (model_type one of {list(TREE_MASK_FAMILIES)}); use verify: branches")
        super().__init__(drafter, loss, params, context)
        self.tree = params.verify == "tree" or (params.verify == "auto" and tree_masks(context.target))

    # ------------------------------------------------------------------ 2. verification
    @torch.no_grad()
    def verify(self, batch: DraftBatch, first: FirstDraft) -> Tensor:
        """The target's taps of the rejected drafts → H_rej [B, A, γ, n, H], zero beyond each anchor's rows.

        Row k of anchor (b, i) is the state at position a+m+1+k of the branch
        [x_0..x_{a+m}, d_{m+1}..d_γ]."""
        target = self.context.target
        d = self.drafter
        gamma, n = d.max_speculative_tokens, len(d.layer_ids)
        b, a_count = first.anchors.shape
        hidden_size = batch.hidden.shape[-1]
        out = torch.zeros(b, a_count, gamma, n, hidden_size, dtype=d.backbone.fc.weight.dtype,
                          device=batch.hidden.device)
        todo = first.rows.nonzero().tolist()  # [(b, i)] with a rejection
        if not todo:
            return out
        anchors, accepted = first.anchors.tolist(), first.accepted.tolist()
        ids_cpu, drafts_cpu = batch.input_ids.cpu(), first.drafts.cpu()
        if self.tree:
            by_record: dict[int, list[int]] = {}
            for r, i in todo:  # nonzero() order: by record, then anchor
                by_record.setdefault(r, []).append(i)
            for r, items in by_record.items():
                self._verify_record(items, anchors[r], accepted[r], ids_cpu[r], drafts_cpu[r], out[r])
            return out
        todo.sort(key=lambda bi: anchors[bi[0]][bi[1]])  # similar lengths share a padded batch
        for lo in range(0, len(todo), self.params.verify_chunk):
            part = todo[lo:lo + self.params.verify_chunk]
            lengths = [anchors[r][i] + gamma + 1 for r, i in part]
            ids = torch.zeros(len(part), max(lengths), dtype=torch.long)
            att = torch.zeros(len(part), max(lengths), dtype=torch.long)
            for c, (r, i) in enumerate(part):
                a, m = anchors[r][i], accepted[r][i]
                ids[c, :a + m + 1] = ids_cpu[r, :a + m + 1]
                ids[c, a + m + 1:lengths[c]] = drafts_cpu[r, i, m:]
                att[c, :lengths[c]] = 1
            taps = target.forward(ids.to(target.device), attention_mask=att.to(target.device),
                                  layer_ids=d.layer_ids).hidden  # [C, L, n, H]
            for c, (r, i) in enumerate(part):
                a, m = anchors[r][i], accepted[r][i]
                out[r, i, :gamma - m] = taps[c, a + m + 1:a + gamma + 1].to(out.device, out.dtype)
        return out

    def _verify_record(self, items: list[int], anchors: list[int], accepted: list[int], ids: Tensor, drafts: Tensor,
                       out: Tensor) -> None:
        """``verify`` (tree) of one record's rejected anchors ``items``: one target pass over its
        tokens x_0..x_p (p: the last branch point) and then every branch's drafts, each branch
        attending to x_0..x_{a+m} and causally to itself, at positions a+m+1..a+γ. Writes each
        anchor's rows into ``out`` [A, γ, n, H]; ids [T], drafts [A, γ]."""
        target, gamma = self.context.target, self.drafter.max_speculative_tokens
        prefix = max(anchors[i] + accepted[i] for i in items) + 1
        widths = [gamma - accepted[i] for i in items]
        q = prefix + sum(widths)
        tokens, positions = torch.empty(q, dtype=torch.long), torch.empty(q, dtype=torch.long)
        mask = torch.zeros(q, q, dtype=torch.bool)  # [query, key]: True where it attends
        tokens[:prefix], positions[:prefix] = ids[:prefix], torch.arange(prefix)
        mask[:prefix, :prefix] = torch.ones(prefix, prefix, dtype=torch.bool).tril()
        at = prefix
        for i, width in zip(items, widths):
            branch = anchors[i] + accepted[i] + 1  # the branch's first position
            tokens[at:at + width] = drafts[i, accepted[i]:]
            positions[at:at + width] = torch.arange(branch, branch + width)
            mask[at:at + width, :branch] = True
            mask[at:at + width, at:at + width] = torch.ones(width, width, dtype=torch.bool).tril()
            at += width
        dev = target.device
        taps = target.forward(tokens[None].to(dev), attention_mask=mask[None, None].to(dev),
                              layer_ids=self.drafter.layer_ids, position_ids=positions[None].to(dev)).hidden[0]
        at = prefix
        for i, width in zip(items, widths):
            out[i, :width] = taps[at:at + width].to(out.device, out.dtype)
            at += width

    # ------------------------------------------------------------------ 3. second draft
    def carry_context(self, carry_hidden: Tensor, positions: Tensor) -> list[KV]:
        """Per-layer K/V of carryover rows: taps [B, S, n, H] + E_carry, fused, at positions [B, S]."""
        d = self.drafter
        n, h = carry_hidden.shape[-2:]
        x = carry_hidden.to(d.backbone.fc.weight.dtype) + d.carry_embed.view(n, h)
        return d.backbone.features_kv(d.backbone.fuse(x), positions)

    def second_draft(self, batch: DraftBatch, anchors2: Tensor, carry_hidden: Tensor,
                     carry_start: Tensor, rows: Tensor) -> DraftTrainOutput:
        """Blocks at anchors2 [B, A] reading the target context < a2 and their own carryover rows.

        carry_hidden [B, A, W, n, H]: anchor i's rejected taps, row k at position carry_start[b, i] + k
        (carry_start [B, A]); rows [B, A]: how many of the W slots are real (the rest are masked)."""
        d = self.drafter
        b, t = batch.input_ids.shape
        a_count, width = carry_hidden.shape[1:3]
        context = d.target_context(batch.hidden)
        visible = torch.arange(t, device=anchors2.device).view(1, 1, -1) < anchors2.clamp_min(0).unsqueeze(-1)
        if width > 0:
            slot = torch.arange(width, device=anchors2.device)
            positions = (carry_start.clamp_min(0).unsqueeze(-1) + slot).view(b, a_count * width)
            carry = self.carry_context(carry_hidden.flatten(1, 2), positions)
            context = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(context, carry)]
            own = torch.eye(a_count, dtype=torch.bool, device=anchors2.device).view(1, a_count, a_count, 1)
            real = (slot.view(1, 1, -1) < rows.unsqueeze(-1)) & (anchors2 >= 0).unsqueeze(-1)  # [B, A, W]
            carry_visible = (own & real.unsqueeze(1)).view(b, a_count, a_count * width)
            visible = torch.cat([visible, carry_visible], dim=-1)
        z = d.block_states(batch.input_ids, anchors2, context, visible)
        return d.block_output(batch, anchors2, z)

    # ------------------------------------------------------------------ the objective
    def forward(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, LossOutput]:
        first = first_drafts_at_sampled_anchors(self.drafter, batch, self.params.max_anchors, self.params.chunk,
                                                generator)
        carry_hidden = self.verify(batch, first)
        width = int(first.rows.max()) if first.rows.numel() else 0
        out = self.loss(self.second_draft(batch, first.second, carry_hidden[:, :, :width],
                                          first.second, first.rows).loss_inputs())
        used, second = first.anchors >= 0, first.second >= 0
        with_rows = first.rows > 0
        out.terms.update({
            "carry_first_accepted": first.accepted[used].float().mean(),  # mean m (greedy, first draft)
            "carry_fraction": with_rows[second].float().mean(),  # trained blocks that read carryover rows
            "carry_rows": first.rows[with_rows].float().mean(),  # mean rows where there are any
            "carry_blocks": second.sum(1).float().mean(),  # trained second blocks per row
        })
        return out.loss, out
