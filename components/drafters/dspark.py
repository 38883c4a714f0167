"""DSpark (the default drafter): the DFlash backbone plus a light causal head and a confidence head.

Heads (reference/dspark-dflash-facts.md §2):

* Markov (``markov_head="linear"``): a low-rank transition bias ``W2(W1[x_{k-1}])`` added to the
  backbone logits ``lm_head(z_k)``; W1 = ``markov_w1`` [V, r], W2 = ``markov_w2`` (r → V).
  Training is teacher-forced and parallel (previous ids = [anchor, x_{a+1}, ...]); inference
  samples left to right, slot 0 conditioned on the anchor (the last verified token).
* RNN (``markov_head="rnn"``): a gated state s_k over the drafted tokens:
  [g, c, o] = joint_proj([s_{k-1}; W1[x_{k-1}]; z_k]), s_k = σ(g)s_{k-1} + (1−σ(g))tanh(c),
  bias = W2(tanh(o)); unrolled along the block in training too.
* Confidence: c_k = wᵀ[z_k; W1[x_{k-1}]] + b, π_k = σ(c_k), the conditional probability that
  draft k is accepted given its prefix was.

Default layout: sample_from_anchor=True, so a block of 7 gives 7 drafts (slot k → x_{a+k+1}).
With a draft vocabulary W1 stays [V, r] (previous tokens are target ids: the anchor may be any
token) and W2 reads out over the DV draft tokens, as vLLM's DSpark lays them out.
Knows nothing about the loss weights or the draft-length scheduler.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from components.drafters.base import DrafterError, DrafterSpec, Proposal, SharedParts
from components.drafters.capabilities import Capability
from components.drafters.dflash import DFlashDrafter
from components.drafters.layers import init_weights
from components.drafters.registry import register_drafter
from components.spec.sampling import SamplingParams

HEAD_TYPES = ("linear", "rnn", "none")


class MarkovHead(nn.Module):
    """bias(z_k, x_{k-1}) = W2(W1[x_{k-1}]); stateless, so training is parallel. W1 [V, r] reads
    target ids, W2 writes the R readout logits (R = DV with a draft vocabulary)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, readout_size: int | None = None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, readout_size or vocab_size, bias=False)

    def prev_embed(self, prev: Tensor) -> Tensor:  # [...] long -> [..., r]
        return self.markov_w1(prev)

    def teacher_forced(self, z: Tensor, prev: Tensor) -> Tensor:  # [N, γ, H], [N, γ] -> [N, γ, R]
        return self.markov_w2(self.markov_w1(prev))

    def step(self, z: Tensor, prev: Tensor, carry: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """z [B, H], prev [B] → bias [B, R], carry (unused)."""
        return self.markov_w2(self.markov_w1(prev)), carry


class RNNHead(MarkovHead):
    """A gated recurrent state over the block's previous tokens."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, readout_size: int | None = None):
        super().__init__(vocab_size, hidden_size, rank, readout_size)
        self.rank = rank
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def step(self, z: Tensor, prev: Tensor, carry: Tensor | None) -> tuple[Tensor, Tensor]:
        """z [B, H], prev [B], carry s [B, r] | None → bias [B, R], new s [B, r]."""
        e = self.markov_w1(prev)
        s = carry if carry is not None else z.new_zeros(z.shape[0], self.rank)
        g, c, o = self.joint_proj(torch.cat([s, e, z], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(g)
        s = gate * s + (1 - gate) * torch.tanh(c)
        return self.markov_w2(torch.tanh(o)), s

    def teacher_forced(self, z: Tensor, prev: Tensor) -> Tensor:  # [N, γ, H], [N, γ] -> [N, γ, R]
        carry, out = None, []
        for j in range(z.shape[1]):
            bias, carry = self.step(z[:, j], prev[:, j], carry)
            out.append(bias)
        return torch.stack(out, dim=1)


class ConfidenceHead(nn.Module):
    """c_k = proj([z_k; W1[x_{k-1}]]) (the W1 part only with a causal head)."""

    def __init__(self, hidden_size: int, rank: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size + rank, 1)

    def forward(self, z: Tensor, prev_emb: Tensor | None) -> Tensor:  # [..., H], [..., r] -> [...]
        x = z if prev_emb is None else torch.cat([z, prev_emb], dim=-1)
        return self.proj(x).squeeze(-1)


@register_drafter("dspark")
class DSparkDrafter(DFlashDrafter):
    """DFlash backbone + Markov/RNN causal head + confidence head."""

    default_num_layers = 5
    default_sample_from_anchor = True

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        kind, rank = self.cfg.markov_head, int(self.cfg.markov_rank)
        if kind not in HEAD_TYPES:
            raise DrafterError(f"drafter.markov_head: '{kind}' is not one of {HEAD_TYPES}")
        if kind != "none" and rank <= 0:
            raise DrafterError(f"drafter.markov_rank must be > 0 for markov_head='{kind}', got {rank}")
        hidden = self.sizes.hidden_size
        self.markov_head = self.build_causal_head(kind, rank)
        conf_rank = rank if self.markov_head is not None else 0
        self.confidence_head = ConfidenceHead(hidden, conf_rank) if self.cfg.enable_confidence_head else None
        for module in (self.markov_head, self.confidence_head):
            if module is not None:
                init_weights(module)

    def build_causal_head(self, kind: str, rank: int) -> nn.Module | None:
        """The causal head ``drafter.markov_head`` names (None: none; Domino builds its own)."""
        head_cls = {"linear": MarkovHead, "rnn": RNNHead}.get(kind)
        if head_cls is None:
            return None
        return head_cls(self.spec.target.vocab_size, self.sizes.hidden_size, rank, self.readout_size)

    def _confidence(self, z: Tensor, prev: Tensor) -> Tensor | None:  # [..., H], [...] -> [...]
        if self.confidence_head is None:
            return None
        prev_emb = self.markov_head.prev_embed(prev) if self.markov_head is not None else None
        return self.confidence_head(z, prev_emb)

    def train_readout(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None]:
        """z [N, γ, H], prev [N, γ] (anchor then data tokens) → logits [N, γ, R], c [N, γ]."""
        logits, conf, _ = self.train_readout_base(z, prev)
        return logits, conf

    def train_readout_base(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``train_readout`` and the backbone's own logits lm_head(z) (None without a causal head)."""
        base = self.lm_head(z)
        if self.markov_head is None:
            return base, self._confidence(z, prev), None
        return base + self.markov_head.teacher_forced(z, prev), self._confidence(z, prev), base

    def sample_readout(self, z: Tensor, last_token: Tensor, sampling: SamplingParams,
                       generator: torch.Generator | None) -> Proposal:
        """Left-to-right sampling: draft k's bias reads the token drafted at k−1 (its target id)."""
        base = self.lm_head(z)  # [B, γ, R] one backbone pass already done
        prev, carry = last_token, None
        tokens, logits, probs, prevs = [], [], [], []
        for j in range(z.shape[1]):
            logit_j = base[:, j]
            if self.markov_head is not None:
                bias, carry = self.markov_head.step(z[:, j], prev, carry)
                logit_j = logit_j + bias
            tok, p = self.draw(logit_j, sampling, generator)  # target ids [B], probs [B, R]
            tokens.append(tok)
            logits.append(logit_j)
            probs.append(p)
            prevs.append(prev)
            prev = tok
        c = self._confidence(z, torch.stack(prevs, dim=1))  # [B, γ] in one call, after the draws
        confidences = torch.sigmoid(c) if c is not None else None
        return self.proposal(torch.stack(tokens, 1), torch.stack(logits, 1), torch.stack(probs, 1), confidences)

    def capabilities(self) -> frozenset[Capability]:
        caps = set(super().capabilities()) | {Capability.SLOT_HEADS}
        if self.markov_head is not None:  # the tree head's path dependence is the Markov bias
            caps |= {Capability.CAUSAL_TREE_HEAD, Capability.BASE_LOGITS}
        return frozenset(caps)

    def causal_tree_head(self, z: Tensor):  # z [γ, H] one proposal's slot states -> CausalHead
        """DominoTree's path-dependent scores (``spec.trees.build_causal_trees``): a node at depth
        d's children are read out from slot d's state with the Markov bias of the node's own token
        (the root's token at depth 0), so sibling branches get their own distributions."""
        def head(paths: Tensor, depth: Tensor, candidates: Tensor) -> Tensor:  # [n, γ+1], [n], [n, M]
            prev = paths.gather(1, depth[:, None])  # [n, 1] the node's token
            logits, _ = self.train_readout(z[depth][:, None], prev)  # [n, 1, R]
            full = self.full_logits(logits[:, 0])  # [n, V]: -inf outside a draft vocabulary
            return torch.log_softmax(full.float(), dim=-1).gather(1, candidates)
        return head
