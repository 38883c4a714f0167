"""Medusa: γ residual heads on the target's last hidden state.

Head k (0-based) maps the target's final-normed last hidden state h at position a−1 through
``medusa_layers`` residual blocks (x + SiLU(Wx + b), weights zero-initialised so every head
starts as the target's own head) and the shared LM head; it predicts x_{a+k+1}, i.e. the token
k+2 steps after h (the target's own head already gave x_a, the last verified token). Heads are
independent: the last token is not an input. Weight names follow vLLM's Medusa
(``blocks.{k}.layers.{j}``). Knows nothing about tree verification.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from components.config import DrafterConfig
from components.drafters.base import (
    DEFAULT_SAMPLING,
    DraftBatch,
    Drafter,
    DrafterError,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    Proposal,
    SharedParts,
    is_greedy,
    row_settings,
    rows_at_anchors,
)
from components.drafters.capabilities import Capability
from components.drafters.eagle3 import shift_right
from components.drafters.registry import register_drafter
from components.spec.sampling import SamplingParams


class ResidualBlock(nn.Module):
    def __init__(self, hidden_size: int, num_layers: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_layers))
        for layer in self.layers:
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


@register_drafter("medusa")
class MedusaDrafter(Drafter):
    default_num_layers = 1

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        h = self.sizes.hidden_size
        self.blocks = nn.ModuleList(ResidualBlock(h, int(self.cfg.medusa_layers)) for _ in range(self.cfg.medusa_heads))

    @staticmethod
    def default_layer_ids(num_target_layers: int, cfg: DrafterConfig) -> list[int]:
        return [num_target_layers - 1]

    @staticmethod
    def default_num_speculative_tokens(cfg: DrafterConfig) -> int:
        return cfg.medusa_heads

    def sequential_passes(self, gamma: int) -> int:
        return 1  # all heads read the same hidden state at once

    def _normed(self, hidden: Tensor) -> Tensor:  # [B, T, n, H] -> [B, T, H] final-normed last tap
        return self.shared.final_norm(hidden[:, :, -1]).to(self.blocks[0].layers[0].weight.dtype)

    def _heads(self, h: Tensor, gamma: int) -> Tensor:  # [..., H] -> [..., γ, R]
        if gamma > len(self.blocks):
            raise DrafterError(f"medusa has {len(self.blocks)} heads, asked for {gamma} drafts")
        return torch.stack([self.lm_head(block(h)) for block in self.blocks[:gamma]], dim=-2)

    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        b, t = batch.input_ids.shape
        gamma = len(self.blocks)
        h = shift_right(self._normed(batch.hidden))  # row a reads h_{a-1}; row 0 has none
        if batch.anchors is None:
            batch = dataclasses.replace(batch, anchors=torch.arange(1, t, device=h.device).expand(b, t - 1))
        out = rows_at_anchors(self._heads(h, gamma), batch, batch.anchors, self.shared, targets, self.vocab)
        has_h = (batch.anchors >= 1).reshape(-1, 1)
        out.valid &= has_h
        if out.reachable is not None:
            out.reachable &= has_h
        return out

    def consume(self, state: DraftState, tokens: Tensor, hidden: Tensor) -> DraftState:
        feats = self._normed(hidden)
        if state.feats is not None:
            feats = torch.cat([state.feats, feats], 1)
        return DraftState(state.length + tokens.shape[1], [], feats)

    def propose(self, state: DraftState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        if state.feats is None:
            raise DrafterError("medusa needs at least one consumed position before proposing")
        logits = self._heads(state.feats[:, -1], num_speculative_tokens or self.num_speculative_tokens)  # [B, γ, R]
        tokens, probs = self.draw(logits, sampling, generator)
        return self.proposal(tokens, logits, probs)

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.BATCHED_PROPOSE})

    def propose_many(self, states: list[DraftState], last_tokens: Tensor,
                     sampling: SamplingParams | list[SamplingParams], num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """``propose`` for many batch-1 states in one pass of the heads (the batch engine's rows):
        ``sampling`` and ``num_speculative_tokens`` shared or one per row; each row draws from its own
        generator, as ``propose`` would for it alone."""
        if any(s.feats is None for s in states):
            raise DrafterError("medusa needs at least one consumed position before proposing")
        r = len(states)
        per_row, samplings, gens = row_settings(r, sampling, num_speculative_tokens, generators, self.num_speculative_tokens)
        logits = self._heads(torch.cat([s.feats[:, -1] for s in states]), max(per_row))  # [R, γ, D]
        if all(is_greedy(s) for s in samplings):  # no randomness: one argmax, then each row's γ
            tokens, probs = self.draw(logits, samplings[0], None)
            p = self.proposal(tokens, logits, probs)
            return [Proposal(p.tokens[i:i + 1, :n], p.logits[i:i + 1, :n], p.probs[i:i + 1, :n], None)
                    for i, n in enumerate(per_row)]
        draws = [self.draw(logits[i:i + 1, :n], samplings[i], gens[i]) for i, n in enumerate(per_row)]
        return [self.proposal(t, logits[i:i + 1, :n], p) for i, (n, (t, p)) in enumerate(zip(per_row, draws))]
