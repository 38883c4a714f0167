"""Domino: the DFlash backbone with a causal head of full-prefix memory (survey, "Domino").

A GRU reads the target's (frozen, shared) embeddings of the tokens before each draft slot, the
last verified token first, so its state s_{k-1} summarises the anchor and every token drafted
before slot k, not only the last one as DSpark's Markov head does. A low-rank correction
W2·SiLU(W1[z_k; s_{k-1}]) is added to the backbone's logits U_k = lm_head(z_k):

    q_k = softmax(U_k + W2·SiLU(W1[z_k; s_{k-1}]))

GRU state size and correction rank are both ``drafter.markov_rank``. W2 starts at zero, so the
corrected distribution starts as the backbone's own. Training is teacher-forced and parallel in
the backbone (the GRU runs along the block, γ short steps); drafting samples left to right as
DSpark does, slot 0 conditioned on the anchor. The confidence head reads [z_k; s_{k-1}].

Domino trains with the base-anchored curriculum (objective ``base_anchored``: the loss moves
from the backbone's q_base to q as training goes, so the head cannot leave the work to itself),
which ``Capability.BASE_LOGITS`` makes possible. Causal token trees (``builder="causal"``) score a
node's children with the GRU run along that node's own root-to-node path (DominoTree).

Layout as DSpark's (``sample_from_anchor``: slot k → x_{a+k+1}). vLLM has no Domino format, so
it is not exported (no ``SLOT_HEADS``). Knows nothing about losses, curricula or engines.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from components.drafters.base import DrafterError, DrafterSpec, SharedParts
from components.drafters.capabilities import Capability
from components.drafters.dspark import DSparkDrafter
from components.drafters.registry import register_drafter


class DominoHead(nn.Module):
    """GRU over the embeddings of the previous tokens + a low-rank logit correction.

    The same interface as DSpark's heads (``prev_embed``, ``teacher_forced``, ``step``), except
    that ``prev_embed`` reads a whole sequence: its state at j depends on prev[..., :j+1]."""

    def __init__(self, embed: Callable[[Tensor], Tensor], hidden_size: int, rank: int, readout_size: int):
        super().__init__()
        self._embed = embed  # the drafter's shared, frozen embedding (not a submodule: never saved here)
        self.gru = nn.GRU(hidden_size, rank, batch_first=True)
        self.w1 = nn.Linear(hidden_size + rank, rank)
        self.w2 = nn.Linear(rank, readout_size, bias=False)

    def zero_correction(self) -> None:
        """W2 = 0: the corrected logits start equal to the backbone's."""
        nn.init.zeros_(self.w2.weight)

    def prev_embed(self, prev: Tensor) -> Tensor:  # [N, γ] long -> [N, γ, r] GRU states s
        """s[:, j] after reading prev[:, 0..j] (the state slot j's correction reads)."""
        x = self._embed(prev).to(self.w1.weight.dtype)
        return self.gru(x)[0]

    def correction(self, z: Tensor, s: Tensor) -> Tensor:  # [..., H], [..., r] -> [..., R]
        return self.w2(nn.functional.silu(self.w1(torch.cat([z, s.to(z.dtype)], dim=-1))))

    def teacher_forced(self, z: Tensor, prev: Tensor) -> Tensor:  # [N, γ, H], [N, γ] -> [N, γ, R]
        return self.correction(z, self.prev_embed(prev))

    def step(self, z: Tensor, prev: Tensor, carry: Tensor | None) -> tuple[Tensor, Tensor]:
        """z [B, H], prev [B], carry h [1, B, r] | None → correction [B, R], new h [1, B, r]."""
        x = self._embed(prev[:, None]).to(self.w1.weight.dtype)  # [B, 1, H]
        out, h = self.gru(x, carry)
        return self.correction(z, out[:, 0]), h


@register_drafter("domino")
class DominoDrafter(DSparkDrafter):
    """DFlash backbone + Domino's GRU correction head + (optional) confidence head."""

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        self.markov_head.zero_correction()

    def build_causal_head(self, kind: str, rank: int) -> nn.Module:
        if rank <= 0:
            raise DrafterError(f"drafter.markov_rank must be > 0 for domino (its GRU state and correction rank), got {rank}")
        return DominoHead(self.embed, self.sizes.hidden_size, rank, self.readout_size)

    def train_readout_base(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """DSpark's, with the GRU run once for the correction and the confidence head alike."""
        s = self.markov_head.prev_embed(prev)  # [N, γ, r]
        base = self.lm_head(z)
        conf = self.confidence_head(z, s) if self.confidence_head is not None else None
        return base + self.markov_head.correction(z, s), conf, base

    def capabilities(self) -> frozenset[Capability]:
        return frozenset(super().capabilities() - {Capability.SLOT_HEADS})  # no vLLM layout to export to

    def causal_tree_head(self, z: Tensor):  # z [γ, H] one proposal's slot states -> CausalHead
        """DominoTree: a node at depth d's children are read out from slot d's state with the GRU
        run along the node's own path (root token, then its path tokens), so the correction is
        recomputed per branch."""
        def head(paths: Tensor, depth: Tensor, candidates: Tensor) -> Tensor:  # [n, γ+1], [n], [n, M]
            s = self.markov_head.prev_embed(paths)  # [n, γ+1, r]; causal, so padding past depth is unread
            s = s.gather(1, depth.view(-1, 1, 1).expand(-1, 1, s.shape[-1]))[:, 0]  # [n, r]
            zd = z[depth]  # [n, H]
            logits = self.lm_head(zd) + self.markov_head.correction(zd, s)  # [n, R]
            full = self.full_logits(logits)  # [n, V]: -inf outside a draft vocabulary
            return torch.log_softmax(full.float(), dim=-1).gather(1, candidates)
        return head
