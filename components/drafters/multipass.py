"""Block drafters that run DFlash's backbone more than once per round (survey, "Looping and
editing the block"): D-Loop and DEdit. One verification per round either way; the passes are
the drafter's own business, inside ``propose``.

**D-Loop** (Chen et al., 2026; not the multi-stage DLoop of ``engine``/``objectives.dloop``).
Pass 1 is DFlash's block [last verified token, masks]; pass 2 puts pass 1's first p drafts
(the prefix) into their slots as input tokens and regenerates the remaining γ − p slots (the
suffix) in parallel, conditioned on them. No new parameters. The drafts handed to verification
are pass 1's prefix and pass 2's suffix, each with the distribution it was drawn from; the
suffix's q depends only on the context and the prefix drafts, which precede it, so sampled
verification stays exact. Training (prefix–suffix objective, the drafter's own
``training_forward``): the prefix slots read out of pass 1, the suffix slots out of pass 2 with
the *recorded* tokens in the prefix slots, the condition under which a suffix draft can be
accepted at all. The survey's "selected prefix" is not specified further; here p is fixed by
``drafter.loop_prefix`` (default ⌊γ/2⌋: two halves, the unconditioned half the shorter).

**DEdit** (Yu et al., 2026). Pass 1 unmasks the block as DFlash does; each of
``drafter.edit_passes`` editing passes then feeds the current drafts back as the block's input
tokens (instead of masks) and re-predicts every slot at once, attention inside the block
bidirectional as in pass 1. Intermediate drafts are the argmax of each pass (they are inputs,
never verified); the final drafts are drawn from the last pass, whose distribution is the q
handed to verification. ProposalMix training (``training_forward`` in training mode): the
first pass as DFlash, plus one editing pass whose input at each slot is the drafter's own
first-pass argmax with probability equal to its confidence in it (its probability, detached),
else the recorded token; every slot of the editing pass is trained on the recorded target.
So inputs are mostly right where the drafter is sure and repaired where it is not; the papers
say mixing by confidence, this module chooses the rule. Training mode returns 2·N blocks (the
first passes, then the editing passes); evaluation mode returns the N blocks exactly as the
engine drafts them (pass 1 then ``edit_passes`` argmax editing passes).

Both use DFlash's layout (``sample_from_anchor=false``: slot k holds position anchor + k, so a
draft is fed back into its own slot) and declare what DFlash does except ``block_internals``
and ``carryover``: the objectives that unroll a single-pass block (dloop, carryover, edr) would
train the wrong thing. Knows nothing about losses, verification or engines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor

from components.drafters.base import (
    DEFAULT_SAMPLING,
    DraftBatch,
    DrafterError,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    Proposal,
    SharedParts,
    block_tokens,
    gather_positions,
    is_greedy,
    row_settings,
)
from components.drafters.capabilities import Capability
from components.drafters.dflash import DFlashDrafter
from components.drafters.registry import register_drafter
from components.spec.sampling import SamplingParams

Runner = Callable[[Tensor], Tensor]  # block ids [R, bs] -> block states z [R, bs, H]
Draw = Callable[[Tensor, list[int]], list[Proposal]]  # slot states [R, S, H], slots per row -> one [1, n_i] per row


def join(a: Proposal, b: Proposal) -> Proposal:
    """Two proposals of one row laid end to end (slots of ``a`` then ``b``)."""
    states = torch.cat([a.states, b.states], 1) if a.states is not None and b.states is not None else None
    return Proposal(torch.cat([a.tokens, b.tokens], 1), torch.cat([a.logits, b.logits], 1),
                    torch.cat([a.probs, b.probs], 1), None, states)


def split_rows(prop: Proposal, z: Tensor, counts: list[int]) -> list[Proposal]:
    """A proposal over R rows → one per row, row i cut to its counts[i] drafts, with its slot states z [R, S, H]."""
    return [Proposal(prop.tokens[i:i + 1, :n], prop.logits[i:i + 1, :n], prop.probs[i:i + 1, :n], None,
                     z[i:i + 1, :n]) for i, n in enumerate(counts)]


def stack_outputs(first: DraftTrainOutput, second: DraftTrainOutput) -> DraftTrainOutput:
    """Two training outputs over the same anchors as one of 2·N blocks (``first``'s, then ``second``'s)."""
    fields = {f.name: (getattr(first, f.name), getattr(second, f.name)) for f in dataclasses.fields(first)}
    return DraftTrainOutput(**{k: torch.cat([a, b]) if a is not None else None for k, (a, b) in fields.items()})


def proposal_mix(guess: Tensor, recorded: Tensor, conf: Tensor, valid: Tensor,
                 generator: torch.Generator | None = None) -> Tensor:
    """ProposalMix's editing inputs [..., γ]: each slot the drafter's guess with probability
    ``conf`` (its probability of that guess), else the recorded token; the guess where nothing
    is recorded (``valid`` false). guess, recorded [..., γ] target ids; conf [..., γ] in [0, 1]."""
    keep = torch.rand(conf.shape, generator=generator, device=conf.device) < conf
    return torch.where(keep | ~valid, guess, recorded)


class MultiPassDrafter(DFlashDrafter):
    """DFlash's backbone, several passes a round: subclasses say what each pass reads (``draft_round``)."""

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        if self.cfg.sample_from_anchor:
            raise DrafterError(f"{self.cfg.name} feeds drafts back into their own slots: it needs DFlash's layout "
                               "(drafter.sample_from_anchor=false)")
        if self.cfg.carryover or self.cfg.retrace:
            raise DrafterError(f"{self.cfg.name} has no carryover or recycling (its passes would read the carried "
                               "rows or recycled drafts differently from how those objectives train them): set "
                               "drafter.carryover=false and drafter.retrace=false")

    def capabilities(self) -> frozenset[Capability]:
        return frozenset(super().capabilities() - {Capability.BLOCK_INTERNALS, Capability.CARRYOVER})

    def draft_round(self, run: Runner, last: Tensor, gammas: list[int], draw: Draw) -> list[Proposal]:
        """One round's passes over rows last [R]: ``run`` a block through the backbone, ``draw`` slot
        states into drafts (one proposal [1, n_i] per row); row i gets gammas[i] drafts."""
        raise NotImplementedError

    def propose(self, state: DraftState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = self.check_gamma(num_speculative_tokens or self.max_speculative_tokens)
        b = last_token.shape[0]

        def draw(z: Tensor, counts: list[int]) -> list[Proposal]:  # every row the same count: one draw
            return split_rows(self.sample_readout(z[:, :counts[0]], last_token, sampling, generator), z, counts)

        rows = self.draft_round(self.block_runner(state, b), last_token, [gamma] * b, draw)
        return Proposal(*(torch.cat([getattr(r, f) for r in rows]) for f in ("tokens", "logits", "probs")),
                        None, torch.cat([r.states for r in rows]))

    def propose_many(self, states: list[DraftState], last_tokens: Tensor,
                     sampling: SamplingParams | list[SamplingParams], num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """``propose`` per row, every pass one backbone call over all rows; sampled rows draw from
        their own generators in the order ``propose`` draws (greedy rows: one readout, cut)."""
        per_row, samplings, gens = row_settings(len(states), sampling, num_speculative_tokens, generators, self.max_speculative_tokens)
        self.check_gamma(max(per_row))
        greedy = all(is_greedy(s) for s in samplings)

        def draw(z: Tensor, counts: list[int]) -> list[Proposal]:
            if greedy:
                return split_rows(self.sample_readout(z[:, :max(counts)], last_tokens, samplings[0], None), z, counts)
            props = []
            for i, n in enumerate(counts):
                if n == 0:  # nothing to draw (D-Loop's suffix of a row whose γ ends in the prefix)
                    logits = self.lm_head(z[i:i + 1, :0])
                    prop = self.proposal(last_tokens.new_zeros(1, 0), logits, torch.zeros_like(logits))
                else:
                    prop = self.sample_readout(z[i:i + 1, :n], last_tokens[i:i + 1], samplings[i], gens[i])
                prop.states = z[i:i + 1, :n]
                props.append(prop)
            return props

        return self.draft_round(self.rows_runner(states, last_tokens.device), last_tokens, per_row, draw)

    def greedy_drafts(self, z: Tensor) -> Tensor:
        """Draft-slot states [..., γ, H] → their argmax tokens [..., γ] in target ids (a pass's inputs)."""
        return self.to_target(self.lm_head(z).argmax(-1))


@register_drafter("d_loop")
class DLoopDrafter(MultiPassDrafter):
    """D-Loop: pass 1 drafts the prefix, pass 2 regenerates the suffix given it."""

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        gamma = self.max_speculative_tokens
        if gamma < 2:
            raise DrafterError(f"d_loop needs at least 2 drafts per block (a prefix and a suffix): drafter.block_size >= 3, "
                               f"got {self.cfg.block_size}")
        self.prefix = int(self.cfg.loop_prefix) if self.cfg.loop_prefix is not None else gamma // 2
        if not 1 <= self.prefix < gamma:
            raise DrafterError(f"drafter.loop_prefix must be in 1..{gamma - 1} (the block drafts {gamma}), got {self.prefix}")

    def sequential_passes(self, gamma: int) -> int:
        return 1 if gamma <= self.prefix else 2

    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        anchors, context, visible = self.block_inputs(batch, generator)
        z1 = self.block_states(batch.input_ids, anchors, context, visible)  # [B, A, bs, H]
        blocks = self.anchor_blocks(batch.input_ids, anchors)  # pass 2: the recorded prefix in its slots
        recorded = anchors.clamp_min(0).unsqueeze(-1) + torch.arange(1, self.prefix + 1, device=anchors.device)
        blocks[:, :, 1:1 + self.prefix] = gather_positions(batch.input_ids, recorded)
        z2 = self.block_states(batch.input_ids, anchors, context, visible, blocks)
        cut = 1 + self.prefix  # slots 0..p from pass 1, the suffix from pass 2
        return self.block_output(batch, anchors, torch.cat([z1[:, :, :cut], z2[:, :, cut:]], 2), targets)

    def draft_round(self, run: Runner, last: Tensor, gammas: list[int], draw: Draw) -> list[Proposal]:
        ids = self.mask_block(last)
        z1 = run(ids)[:, 1:]  # [R, γ, H]
        prefix = draw(z1, [min(self.prefix, g) for g in gammas])
        if all(g <= self.prefix for g in gammas):
            return prefix
        for i, prop in enumerate(prefix):
            ids[i, 1:1 + prop.tokens.shape[1]] = prop.tokens[0]
        z2 = run(ids)[:, 1 + self.prefix:]  # [R, γ − p, H]
        suffix = draw(z2, [max(0, g - self.prefix) for g in gammas])
        return [join(a, b) for a, b in zip(prefix, suffix)]


@register_drafter("dedit")
class DEditDrafter(MultiPassDrafter):
    """DEdit: an unmasking pass, then ``edit_passes`` passes re-predicting every slot from the drafts."""

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        self.edit_passes = int(self.cfg.edit_passes)
        if self.edit_passes < 0:
            raise DrafterError(f"drafter.edit_passes must be >= 0, got {self.edit_passes}")

    def sequential_passes(self, gamma: int) -> int:
        return 1 + self.edit_passes

    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        anchors, context, visible = self.block_inputs(batch, generator)
        blocks = self.anchor_blocks(batch.input_ids, anchors)
        z = self.block_states(batch.input_ids, anchors, context, visible, blocks)  # [B, A, bs, H]
        if not self.training:  # as the engine drafts: argmax drafts fed back edit_passes times
            for _ in range(self.edit_passes):
                blocks = blocks.clone()
                blocks[:, :, 1:] = self.greedy_drafts(self.draft_states(z))
                z = self.block_states(batch.input_ids, anchors, context, visible, blocks)
            return self.block_output(batch, anchors, z, targets)
        first = self.block_output(batch, anchors, z, targets)
        if self.edit_passes == 0:
            return first
        with torch.no_grad():  # ProposalMix: own argmax with probability = its confidence, else the record
            probs = self.lm_head(self.draft_states(z)).float().softmax(-1)  # [B, A, γ, R]
            conf, guess = probs.max(-1)
            guess = self.to_target(guess)
            recorded, valid = block_tokens(batch, anchors, self.max_speculative_tokens)
            blocks = blocks.clone()
            blocks[:, :, 1:] = proposal_mix(guess, recorded, conf, valid, generator)
        edited = self.block_states(batch.input_ids, anchors, context, visible, blocks)
        return stack_outputs(first, self.block_output(batch, anchors, edited, targets))

    def draft_round(self, run: Runner, last: Tensor, gammas: list[int], draw: Draw) -> list[Proposal]:
        ids = self.mask_block(last)
        z = run(ids)
        for _ in range(self.edit_passes):
            ids = torch.cat([ids[:, :1], self.greedy_drafts(z[:, 1:])], 1)
            z = run(ids)
        return draw(z[:, 1:], gammas)
