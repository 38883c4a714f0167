"""A reduced draft vocabulary (EAGLE-3's ``d2t``/``t2d``): the target tokens a drafter can propose.

With ``drafter.draft_vocab_size = DV`` (< the target's V) a drafter reads its drafts out through
its own head over DV target tokens instead of the target's V-row LM head, so the readout of γ
slots costs about DV/V of the full one. The target still verifies over its full vocabulary:
output stays lossless, a token outside the draft vocabulary is simply never proposed, and when
the target's choice is such a token it comes out as the recovered (or bonus) token.

Conventions (EAGLE-3, SpecForge, vLLM, SGLang): the draft vocabulary is a sorted list of target
ids; ``d2t [DV]`` int64 holds *offsets*, target id = draft id + d2t[draft id]; ``t2d [V]`` bool
says whether a target id is in it. Sorted ids keep the map monotone, so the argmax over draft
logits and over those logits spread into V (``-inf`` elsewhere) break ties alike.

* Choice (:func:`select_draft_vocab`): the DV most frequent tokens of the training rollouts'
  responses (the loss-masked tokens), ties by token id, the target's special/stop tokens always in.
* Head: ``DraftVocab.head`` [DV, H] starts as the target's LM-head rows of those tokens and is
  trained with the drafter, as EAGLE-3 and SpecForge train their draft head: restricted and
  renormalised, the target rows are already the right readout for the target's own hidden
  state, but the drafter's state is not the target's, and a trained head can shift mass within
  the draft vocabulary; starting from the rows (not at random) makes the initial drafter the
  full-vocabulary one restricted.
* Training target (:meth:`DraftVocab.target_logits`): the target's logits at the draft
  vocabulary only, i.e. its distribution restricted to the draft vocabulary and renormalised
  (EAGLE-3/SpecForge). The alternative, a full-vocabulary divergence with zero draft mass
  outside, is infinite for KL/CE wherever the target puts mass outside. The renormalised target
  is also where the true acceptance peaks: among drafts q supported on the draft vocabulary,
  α = Σ_V min(p, q) ≤ p(draft vocab), with equality at q = p restricted and renormalised. A data
  token outside the draft vocabulary (:meth:`DraftVocab.restrict_tokens`) ends its block for the
  losses, as the drafter can never propose it nor what is teacher-forced after it.
* Proposals (:meth:`DraftVocab.widen`): tokens in target ids, logits/probs spread into V with
  ``-inf``/0 outside, so every verification rule sees the full-vocabulary protocol unchanged;
  spread when first read (:class:`VocabProposal`): greedy verification compares tokens and reads
  neither, and DLoop's gate reads log q of its drafts over DV (the same values).

Knows nothing about drafter families, records or engines; of a tokenizer it reads only its
special ids (:func:`special_token_ids`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from components.drafters.errors import DrafterError
from components.drafters.exchange import LazyProposal, Proposal


class DraftVocab(nn.Module):
    """The draft vocabulary of one drafter: ``head`` (H → DV), ``d2t`` [DV] and ``t2d`` [V].

    Built with placeholder values: :meth:`assign` (from chosen target ids) or loading a
    checkpoint's state dict fills it; until then reading out through it is refused."""

    def __init__(self, vocab_size: int, draft_vocab_size: int, hidden_size: int):
        super().__init__()
        if not 0 < draft_vocab_size < vocab_size:
            raise DrafterError(f"drafter.draft_vocab_size {draft_vocab_size} must be in 1..{vocab_size - 1} "
                               f"(the target has {vocab_size} tokens; 0/None = the full vocabulary)")
        self.vocab_size = int(vocab_size)
        self.head = nn.Linear(hidden_size, draft_vocab_size, bias=False)  # [DV, H]
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))  # [DV] offsets
        self.register_buffer("t2d", torch.zeros(vocab_size, dtype=torch.bool))  # [V] membership
        self.chosen = False  # assign() or a loaded state dict sets it
        self._fast: list[nn.Module | None] = [None]  # an inference copy of the head (int8), never saved

    @property
    def size(self) -> int:
        """DV: tokens in the draft vocabulary."""
        return int(self.d2t.shape[0])

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args: object) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        self.chosen = self.chosen or prefix + "d2t" in state_dict  # a saved map is a chosen one

    # ---------------------------------------------------------------- the map
    @torch.no_grad()
    def assign(self, target_ids: Tensor, lm_head_weight: Tensor) -> DraftVocab:
        """Fills the map from sorted unique target ids [DV] and the head from the target's LM-head
        rows lm_head_weight [V, H] of those ids."""
        ids = torch.as_tensor(target_ids, dtype=torch.long).to(self.d2t.device)
        check_ids(ids, self.size, self.vocab_size, "draft vocabulary")
        self.d2t.copy_(ids - torch.arange(self.size, device=ids.device))
        self.t2d.zero_()[ids] = True
        self.head.weight.copy_(lm_head_weight.detach()[ids.to(lm_head_weight.device)].to(self.head.weight))
        self.chosen = True
        return self

    def target_ids(self) -> Tensor:  # -> [DV] long, sorted
        return torch.arange(self.size, device=self.d2t.device) + self.d2t

    def draft_of(self) -> Tensor:  # -> [V] long: draft id of each target id, -1 outside
        return torch.where(self.t2d, self.t2d.long().cumsum(0) - 1, torch.full_like(self.d2t[:1], -1))

    def check(self, where: str) -> None:
        """Raises when d2t and t2d do not describe the same sorted draft vocabulary."""
        check_ids(self.target_ids(), self.size, self.vocab_size, f"{where}: d2t")
        if int(self.t2d.sum()) != self.size or not bool(self.t2d[self.target_ids()].all()):
            raise DrafterError(f"{where}: t2d marks {int(self.t2d.sum())} target tokens, d2t maps {self.size} "
                               "others: the draft-vocabulary maps disagree")

    # ---------------------------------------------------------------- readout
    def readout(self) -> nn.Module:
        """H → DV: the head drafts are read out through (its fast copy when one is set)."""
        if not self.chosen:
            raise DrafterError(f"drafter.draft_vocab_size={self.size}: the draft vocabulary is not chosen yet; "
                               "build the drafter with the training rollouts' token counts, or load a checkpoint")
        return self._fast[0] if self._fast[0] is not None else self.head

    def use(self, head: nn.Module) -> None:
        """Reads out through ``head`` (an inference copy, e.g. int8); the float head stays for saving."""
        self._fast[0] = head

    # ---------------------------------------------------------------- proposals
    def to_target(self, draft_ids: Tensor) -> Tensor:  # [...] long -> [...] long
        return draft_ids + self.d2t[draft_ids]

    def widen(self, x: Tensor, fill: float) -> Tensor:  # [..., DV] -> [..., V]
        """Draft-vocabulary values spread into the target vocabulary, ``fill`` elsewhere."""
        out = x.new_full((*x.shape[:-1], self.vocab_size), fill)
        return out.index_copy_(-1, self.target_ids(), x)

    def proposal(self, tokens: Tensor, logits: Tensor, probs: Tensor, confidences: Tensor | None = None,
                 states: Tensor | None = None) -> VocabProposal:
        """A proposal from target-id tokens [B, γ] and readout logits/probs [B, γ, DV], spread into
        V when first read."""
        return VocabProposal(tokens, logits, probs, self, confidences, states)

    # ---------------------------------------------------------------- training
    def target_logits(self, lm_head: nn.Module, x: Tensor) -> Tensor:  # [..., H] final-normed -> [..., DV]
        """The target head's logits at the draft vocabulary only (its rows of the head, an nn.Linear)."""
        ids = self.target_ids().to(lm_head.weight.device)
        bias = lm_head.bias[ids] if lm_head.bias is not None else None
        return F.linear(x, lm_head.weight[ids], bias)

    def restrict_tokens(
        self,
        tokens: Tensor,  # [N, γ] long target ids (0 where invalid)
        valid: Tensor,  # [N, γ] bool, prefix-closed
    ) -> tuple[Tensor, Tensor]:  # draft ids [N, γ] (0 where invalid), valid [N, γ] cut at the first outside
        draft = self.draft_of().to(tokens.device)[tokens]
        kept = torch.cumprod((valid & (draft >= 0)).to(torch.int32), dim=-1).bool()
        return torch.where(kept, draft, torch.zeros_like(draft)), kept


def check_ids(ids: Tensor, size: int, vocab_size: int, what: str) -> None:
    """Raises unless ids [size] are strictly increasing target ids in 0..vocab_size-1."""
    if ids.dim() != 1 or ids.shape[0] != size:
        raise DrafterError(f"{what}: {tuple(ids.shape)} ids, expected [{size}]")
    if size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not bool((ids[1:] > ids[:-1]).all())):
        raise DrafterError(f"{what}: ids must be sorted, distinct target ids in 0..{vocab_size - 1}")


def select_draft_vocab(counts: Tensor, size: int, always: Iterable[int] = ()) -> Tensor:
    """The draft vocabulary: sorted target ids [size] of the ``size`` largest counts [V] (ties: the
    smaller id first), with every id of ``always`` (special/stop tokens) included first."""
    counts = torch.as_tensor(counts, dtype=torch.float64).flatten()
    forced = sorted({int(i) for i in always if 0 <= int(i) < counts.shape[0]})
    if not 0 < size <= counts.shape[0] or len(forced) > size:
        raise DrafterError(f"drafter.draft_vocab_size {size}: needs 1..{counts.shape[0]} tokens and room for the "
                           f"{len(forced)} special/stop tokens")
    score = counts.clone()
    score[forced] = float("inf")
    order = torch.sort(-score, stable=True).indices  # descending count, ascending id among equals
    return order[:size].sort().values


def special_token_ids(tokenizer: object, generation_eos: object = None) -> list[int]:
    """Special and stop token ids a target emits: the tokenizer's special ids plus any
    generation-config eos ids (an int or a list)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    eos = generation_eos if isinstance(generation_eos, (list, tuple)) else [generation_eos]
    ids |= {int(i) for i in eos if i is not None}
    return sorted(int(i) for i in ids if i is not None and int(i) >= 0)


class VocabProposal(LazyProposal):
    """A ``Proposal`` read out over a draft vocabulary: ``logits``/``probs`` [B, G, V] are its
    readout's [B, G, DV] spread into V (``DraftVocab.widen``: -inf / 0 outside) when first read,
    since greedy verification reads neither and at V = 49,152 spreading them is a large share of
    a small drafter's round. Slicing (``rows``), joining (``concat``) and ``log_q`` stay in DV."""

    def __init__(self, tokens: Tensor, logits: Tensor, probs: Tensor, vocab: DraftVocab,
                 confidences: Tensor | None = None, states: Tensor | None = None):
        super().__init__(tokens, confidences, states)
        self.readout_logits, self.readout_probs, self.vocab = logits, probs, vocab  # [B, G, DV] each

    def build_logits(self) -> Tensor:  # [B, G, V]
        return self.vocab.widen(self.readout_logits, float("-inf"))

    def build_probs(self) -> Tensor:  # [B, G, V]
        return self.vocab.widen(self.readout_probs, 0.0)

    def rows(self, i: int, g: int) -> VocabProposal:
        conf, states = self.confidences, self.states
        return VocabProposal(self.tokens[i:i + 1, :g], self.readout_logits[i:i + 1, :g], self.readout_probs[i:i + 1, :g],
                             self.vocab, conf[i:i + 1, :g] if conf is not None else None,
                             states[i:i + 1, :g] if states is not None else None)

    def log_q(self, picked: Tensor) -> Tensor:  # picked [B, G] target ids -> [B, G]
        log_q = torch.log_softmax(self.readout_logits.float(), dim=-1)  # the same values as over V
        draft = self.vocab.draft_of().to(picked.device)[picked]  # -1 outside the draft vocabulary
        out = log_q.gather(-1, draft.clamp_min(0).unsqueeze(-1)).squeeze(-1)
        return out.masked_fill(draft < 0, float("-inf"))

    @staticmethod
    def join(props: list[Proposal]) -> Proposal:
        vocab = props[0].vocab  # type: ignore[attr-defined]
        if any(p.vocab is not vocab for p in props):  # type: ignore[attr-defined]
            return Proposal.join(props)
        conf = [p.confidences for p in props]
        return VocabProposal(torch.cat([p.tokens for p in props], 1),
                             torch.cat([p.readout_logits for p in props], 1),  # type: ignore[attr-defined]
                             torch.cat([p.readout_probs for p in props], 1),  # type: ignore[attr-defined]
                             vocab, torch.cat(conf, 1) if all(c is not None for c in conf) else None)
