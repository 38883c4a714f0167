"""DFlash2: DFlash's parallel block backbone with dynamic convolutions, and a candidate selector
(survey, "DFlash2").

1. **Dynamic convolution.** Around each attention and MLP sublayer of every draft layer, before
   and after it, a two-tap convolution along the block: Conv(z)_k = m_{k,0}⊙z_k + m_{k,1}⊙z_{k−1},
   its coefficients a learned base kernel (starting as the identity, m_0 = 1, m_1 = 0) plus a
   small low-rank correction read from the current hidden state z_k (its up-projection starting
   at zero). Slot 0 is the last verified token (DFlash's layout: the anchor, then masks), so the
   first draft position reads it; slot 0 reads nothing before it. The target's context rows are
   not convolved: they enter each layer as keys and values, as in DFlash.
2. **Candidate selector.** With ``drafter.selector_candidates`` M > 0 (the survey's design: 16),
   each draft position k keeps the top-M tokens C_k of its backbone logits U_k, and a pair (a at
   k−1, b at k) scores S_k(a, b) = U_k(b) + ⟨u_a ⊙ v_k, w_b⟩ (u, w
   low-rank token embeddings of ``drafter.markov_rank``, v_k from the backbone state). All pairs
   of a block are scored in one shot (``pair_scores``: no extra backbone or LM-head pass); greedy
   drafting follows the best successor from the last verified token, sampled drafting draws from
   the same scores restricted to C_k, and that restricted distribution is the q handed to
   verification (zero outside C_k), so verification stays exact. The default, M = 0, drops the
   restriction: slot k draws from S_k(x_{k−1}, ·) over the whole readout, with x_{k−1} the
   previous slot's draw (a rank-r product per slot, no pair table), which is exactly the readout
   training teacher-forces. No loss trains U_k on its own, so its top tokens often miss the
   target's; docs/results.md compares the two on one checkpoint. Checkpoints written before the
   option draft among 16.

Training is teacher-forced over the full readout: S_k(x_{k−1}, ·) with the data's previous token
(the selector's bias is then a DSpark-style transition gated by v_k); the restriction to C_k is
the drafting rule, so a teacher-forced argmax equals the engine's draft wherever it falls in C_k
(tested). ``train_readout_base`` also gives U_k (``Capability.BASE_LOGITS``). Not exported:
vLLM 0.32 has a DFlash2 (``DFlash2DraftModel``, on its GPU worker only) whose weight layout was
not matched against this one. Knows nothing about losses, verification or engines.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from components.drafters.base import DrafterError, DrafterSpec, Proposal, SharedParts, sample_tokens
from components.drafters.capabilities import Capability
from components.drafters.dflash import DFlashDrafter
from components.drafters.layers import KV, DecoderLayer, LayerSizes, init_weights
from components.drafters.registry import register_drafter
from components.spec.sampling import SamplingParams

CONV_RANK = 16  # rank of the dynamic convolution's state-dependent correction


class DynamicConv(nn.Module):
    """Conv(z)_k = m_{k,0}⊙z_k + m_{k,1}⊙z_{k−1} along a block, m_k = base + up(down(z_k))."""

    def __init__(self, hidden: int, block_size: int, rank: int = CONV_RANK):
        super().__init__()
        self.block_size = block_size
        self.base = nn.Parameter(torch.stack([torch.ones(hidden), torch.zeros(hidden)]))  # [2, H] identity
        self.down = nn.Linear(hidden, rank, bias=False)
        self.up = nn.Linear(rank, 2 * hidden, bias=False)
        nn.init.zeros_(self.up.weight)  # no correction at the start

    def forward(self, z: Tensor) -> Tensor:  # [B, A·bs, H] blocks laid end to end -> same
        b, q, h = z.shape
        blocks = z.view(b, q // self.block_size, self.block_size, h)
        m = self.base + self.up(torch.tanh(self.down(blocks))).view(*blocks.shape[:3], 2, h)  # [B, A, bs, 2, H]
        prev = torch.cat([torch.zeros_like(blocks[:, :, :1]), blocks[:, :, :-1]], dim=2)  # z_{k−1}, slot 0: none
        return (m[..., 0, :] * blocks + m[..., 1, :] * prev).view(b, q, h)


class DFlash2Layer(DecoderLayer):
    """A draft layer whose block rows pass a dynamic convolution before and after attention and MLP."""

    def __init__(self, sizes: LayerSizes, block_size: int):
        super().__init__(sizes)
        h = sizes.hidden_size
        self.conv_attn_in, self.conv_attn_out = DynamicConv(h, block_size), DynamicConv(h, block_size)
        self.conv_mlp_in, self.conv_mlp_out = DynamicConv(h, block_size), DynamicConv(h, block_size)

    def forward(self, x: Tensor, positions: Tensor, extra_kv: KV | None = None,
                mask: Tensor | None = None) -> tuple[Tensor, KV]:  # as DecoderLayer.forward
        attn, kv = self.attention(self.conv_attn_in(self.input_layernorm(x)), positions, extra_kv, mask)
        x = x + self.conv_attn_out(attn)
        x = x + self.conv_mlp_out(self.mlp(self.conv_mlp_in(self.post_attention_layernorm(x))))
        return x, kv


class Selector(nn.Module):
    """S_k(a, b) = U_k(b) + ⟨u_a ⊙ v_k, w_b⟩: u [V, r] over target ids, v: H → r, w [R, r]."""

    def __init__(self, vocab_size: int, hidden: int, rank: int, readout_size: int):
        super().__init__()
        self.u = nn.Embedding(vocab_size, rank)
        self.v = nn.Linear(hidden, rank, bias=False)
        self.w = nn.Linear(rank, readout_size, bias=False)

    def bias(self, z: Tensor, prev: Tensor) -> Tensor:  # [N, γ, H], [N, γ] target ids -> [N, γ, R]
        return self.w(self.u(prev) * self.v(z))


def pair_scores(selector: Selector, base: Tensor, z: Tensor, cand: Tensor, cand_target: Tensor,
                first_prev: Tensor) -> tuple[Tensor, Tensor]:
    """Every candidate pair of a block in one shot.

    base [B, γ, R] backbone logits U, z [B, γ, H], cand [B, γ, M] readout ids (C_k), cand_target
    the same in target ids, first_prev [B] the last verified token → (first [B, M]: S_0(last, b)
    for b ∈ C_0, pairs [B, γ−1, M, M]: S_k(a, b) for a ∈ C_{k−1}, b ∈ C_k, k ≥ 1)."""
    v = selector.v(z)  # [B, γ, r]
    wc = selector.w.weight[cand]  # [B, γ, M, r]
    uc = selector.u(cand_target)  # [B, γ, M, r]
    ub = base.gather(-1, cand)  # [B, γ, M]
    first = ub[:, 0] + torch.einsum("br,bmr->bm", selector.u(first_prev) * v[:, 0], wc[:, 0])
    pairs = ub[:, 1:, None, :] + torch.einsum("bkar,bkmr->bkam", uc[:, :-1] * v[:, 1:, None, :], wc[:, 1:])
    return first, pairs


@register_drafter("dflash2")
class DFlash2Drafter(DFlashDrafter):
    """DFlash with dynamic convolutions in its layers and a candidate selector on its readout."""

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        if self.cfg.sample_from_anchor:
            raise DrafterError("dflash2 drafts from the mask slots (sample_from_anchor=false): its first draft "
                               "position reads the anchor, the last verified token, through the convolution")
        rank = int(self.cfg.markov_rank)
        if rank <= 0:
            raise DrafterError(f"drafter.markov_rank must be > 0 for dflash2 (its selector's rank), got {rank}")
        if int(self.cfg.selector_candidates) < 0:
            raise DrafterError(f"drafter.selector_candidates must be >= 0 (0: the whole readout), got "
                               f"{self.cfg.selector_candidates}")
        bs = int(self.cfg.block_size)
        self.backbone.layers = nn.ModuleList(DFlash2Layer(self.sizes, bs) for _ in self.backbone.layers)
        self.selector = Selector(spec.target.vocab_size, self.sizes.hidden_size, rank, self.readout_size)
        for module in (self.backbone.layers, self.selector):
            init_weights(module)
        for conv in self.modules():
            if isinstance(conv, DynamicConv):  # identity at the start: the DFlash layer it extends
                nn.init.zeros_(conv.up.weight)

    def train_readout(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None]:
        logits, _, _ = self.train_readout_base(z, prev)
        return logits, None

    def train_readout_base(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Teacher-forced S_k(x_{k−1}, ·) over the whole readout, and U_k."""
        base = self.lm_head(z)
        return base + self.selector.bias(z, prev), None, base

    def sample_readout(self, z: Tensor, last_token: Tensor, sampling: SamplingParams,
                       generator: torch.Generator | None) -> Proposal:
        """Walks the block from the last verified token: slot k draws from S_k(x_{k−1}, ·) among
        C_k (pair scores), or over the whole readout with ``selector_candidates: 0``; the
        proposal's logits are the scores it drew from, -inf outside C_k."""
        base = self.lm_head(z)  # [B, γ, R]
        if int(self.cfg.selector_candidates) == 0:
            return self._walk_readout(base, z, last_token, sampling, generator)
        b, gamma, r = base.shape
        m = min(int(self.cfg.selector_candidates), r)
        cand = base.topk(m, dim=-1).indices  # [B, γ, M] readout ids
        first, pairs = pair_scores(self.selector, base, z, cand, self.to_target(cand), last_token)
        rows = torch.arange(b, device=z.device)
        tokens, logits, probs = [], [], []
        scores = first  # [B, M]
        for k in range(gamma):
            full = base.new_full((b, r), float("-inf")).scatter(1, cand[:, k], scores)  # [B, R]
            tok, p = sample_tokens(full, sampling, generator)  # readout ids [B], probs [B, R]
            tokens.append(self.to_target(tok))
            logits.append(full)
            probs.append(p)
            if k + 1 < gamma:
                idx = (cand[:, k] == tok[:, None]).float().argmax(-1)  # the drawn token's place in C_k
                scores = pairs[rows, k, idx]  # [B, M]: S_{k+1}(x_k, ·)
        return self.proposal(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(probs, 1))

    def _walk_readout(self, base: Tensor, z: Tensor, last_token: Tensor, sampling: SamplingParams,
                      generator: torch.Generator | None) -> Proposal:
        """base [B, γ, R], z [B, γ, H]: slot k draws from U_k + selector bias of the previous draw."""
        prev, tokens, logits, probs = last_token, [], [], []  # prev [B] target ids
        for k in range(base.shape[1]):
            scores = base[:, k] + self.selector.bias(z[:, k:k + 1], prev[:, None])[:, 0]  # [B, R]
            tok, p = sample_tokens(scores, sampling, generator)  # readout ids [B], probs [B, R]
            prev = self.to_target(tok)
            tokens.append(prev)
            logits.append(scores)
            probs.append(p)
        return self.proposal(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(probs, 1))

    def capabilities(self) -> frozenset[Capability]:
        return frozenset(super().capabilities() | {Capability.BASE_LOGITS})
