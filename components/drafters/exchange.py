"""What drafters exchange with the trainer and the engine: specs, batches, outputs, state, proposals.

Plain dataclasses with a shape comment on every tensor field (and ``LazyProposal``, a proposal
whose [B, G, V] tensors are built when first read); :mod:`components.drafters.base` re-exports them beside the interface that produces and consumes them. R is the readout
vocabulary (V, or DV with a draft vocabulary, :mod:`components.drafters.vocab`). Knows nothing
about drafter families, checkpoints or engines.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from components.config import DrafterConfig
from components.drafters.errors import DrafterError
from components.drafters.layers import KV, LayerSizes
from components.losses.common import LossInputs


# ----------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class TargetInfo:
    """What a drafter must know about its target to refuse a different one."""

    name_or_path: str
    tokenizer_hash: str
    hidden_size: int
    vocab_size: int
    num_layers: int

    @classmethod
    def of(cls, target: Any) -> TargetInfo:
        return cls(str(target.name_or_path), str(target.tokenizer_hash), int(target.hidden_size),
                   int(target.vocab_size), int(target.num_layers))


@dataclass(frozen=True)
class DrafterSpec:
    """A fully resolved drafter architecture: no None sizes, layer ids and mask id fixed."""

    config: DrafterConfig  # every optional field filled in
    sizes: LayerSizes  # draft decoder layer sizes
    target: TargetInfo


@dataclass
class SharedParts:
    """Frozen target parts a drafter borrows; kept outside its parameters and checkpoints."""

    embed_tokens: nn.Module  # [V, H] embedding table
    lm_head: nn.Module  # H -> V
    final_norm: nn.Module  # the target's final norm (target logits from last hidden states)
    # (layer l, its input hidden [B, T, H] = the output of layer l-1, positions [B, T]) -> the
    # k, v [B, h_kv, T, d] layer l writes to its cache: training recomputes the target's K/V from
    # the stored taps (``Capability.TARGET_KV`` drafters); None: not available
    target_kv: Callable[[int, Tensor, Tensor], KV] | None = None

    @classmethod
    def of(cls, target: Any) -> SharedParts:
        return cls(target.embed_tokens, target.lm_head, target.final_norm, target.project_kv)


# ----------------------------------------------------------------------------- data
@dataclass
class DraftBatch:
    """One training batch, as the data stage stores it."""

    input_ids: Tensor  # [B, T] long
    hidden: Tensor  # [B, T, n, H] target taps at drafter.layer_ids, in that order
    last_hidden: Tensor  # [B, T, H] output of the target's last layer, before the final norm
    loss_mask: Tensor | None = None  # [B, T] bool: the token at t is supervised (None: all)
    anchors: Tensor | None = None  # [B, A] long anchor positions, -1 = unused (None: drafter picks)


@dataclass
class DraftTrainOutput:
    """What the losses consume: N blocks of γ drafts; draft j of block n predicts x_{a_n+j+1}.

    R is the readout vocabulary: V, or DV with a draft vocabulary (then tokens are draft ids and
    a data token outside the draft vocabulary ends its block's ``valid`` positions)."""

    draft_logits: Tensor  # [N, γ, R] the drafter's logits (after any causal head)
    target_logits: Tensor | None  # [N, γ, R] frozen head on the target's last hidden states, detached
    # (None when the forward ran with targets=False)
    target_tokens: Tensor  # [N, γ] long, the data tokens in readout ids (0 where invalid)
    valid: Tensor  # [N, γ] bool, truncated at the first invalid position of each block
    confidence_logits: Tensor | None = None  # [N, γ] confidence head logits c_k
    reachable: Tensor | None = None  # [N, γ] bool, valid before the draft-vocabulary cut (None: = valid)
    base_logits: Tensor | None = None  # [N, γ, R] the backbone's own logits before a causal head
    # (None: the drafter has no such head; the base-anchored curriculum trains them)

    def checkable(self) -> Tensor:  # [N, γ] bool
        """Drafts a greedy round checks: ``reachable`` (a data token outside the draft vocabulary
        is checked and rejected), else ``valid``."""
        return self.valid if self.reachable is None else self.reachable

    def loss_inputs(self, position_weights: Tensor | None = None, base: bool = False) -> LossInputs:
        """The losses' view of the drafts; ``base=True``: of the backbone's own logits instead,
        with the confidence logits detached (the confidence head trains on the drafts only)."""
        if self.target_logits is None:
            raise DrafterError("loss_inputs: this output has no target logits (training_forward ran with "
                               "targets=False); run it with targets=True to compute a loss")
        if not base:
            return LossInputs(self.draft_logits, self.target_logits, self.target_tokens, self.valid,
                              position_weights, self.confidence_logits)
        if self.base_logits is None:
            raise DrafterError("loss_inputs(base=True): this drafter's output has no base logits "
                               "(only drafters with a causal head over a parallel backbone have them)")
        conf = self.confidence_logits.detach() if self.confidence_logits is not None else None
        return LossInputs(self.base_logits, self.target_logits, self.target_tokens, self.valid,
                          position_weights, conf)


@dataclass
class TargetKV:
    """The target's own keys/values of some of its layers for one batch's committed positions,
    as the engine's KV cache holds them: views into the cache, never copies (the engine builds
    it, ``engine.cache.views.target_kv``; a drafter declaring ``Capability.TARGET_KV`` reads it).
    Keys are as the target's attention reads them (k-norm and RoPE at absolute positions applied).

    ``valid`` marks the slots that hold committed tokens (a batch cache's padding and rejected
    holes are False); None: every one of the S slots does, in position order 0..S-1."""

    layers: list[int]  # target decoder layers (0-based), in the order of ``kv``
    kv: list[KV]  # per layer: k, v [B, h_kv, S, d]
    valid: Tensor | None = None  # [B, S] bool (None: all S slots are committed positions 0..S-1)

    @property
    def slots(self) -> int:
        return self.kv[0][0].shape[2] if self.kv else 0


@dataclass
class Recycled:
    """ReTrace: the last round's rejected drafts as inputs of the next block (one round).

    Slot s of the next block gets the drafter's own state of the draft that predicted the token
    slot s predicts (``present`` where such a draft exists), and every slot the verification's
    verdict at the first rejected draft: embed(the target's token there) − embed(the draft)."""

    states: Tensor  # [B, bs, H] the drafter's slot states of rejected drafts, aligned (zeros where absent)
    present: Tensor  # [B, bs] bool
    signal: Tensor  # [B, H]


@dataclass
class DraftState:
    """A batch's drafter context: everything is per committed position, so rollback = crop.

    ``carry`` is carryover context (methods-notes §3): K/V rows of the target's states of the
    drafts the last verification rejected, at their original positions length.. . They are
    valid for one round only: never counted in ``length``, dropped by ``consume``,
    ``consume_own`` and ``rollback``; only the next ``propose`` reads them."""

    length: int = 0  # committed context positions (tokens 0..length-1 consumed)
    kv: list[KV] = field(default_factory=list)  # per attention layer: k, v [B, h_kv, length, d]
    feats: Tensor | None = None  # [B, length, F] per-position features a drafter keeps
    carry: list[KV] | None = None  # per attention layer: k, v [B, h_kv, carry_rows, d] (one round)
    carry_rows: int = 0  # rows in ``carry`` (0: no carryover context)
    # the target's own K/V of the committed context (``Capability.TARGET_KV``), attached by the
    # engine before each ``propose`` (``with_target_kv``): views into its cache, valid for that
    # round only, dropped by ``consume`` and ``rollback``
    target_kv: TargetKV | None = None
    # ReTrace (``Capability.RECYCLES``): the rejected suffix of the last round, read by the next
    # ``propose`` only (``with_recycled``), dropped by ``consume`` and ``rollback``
    recycled: Recycled | None = None


@dataclass
class Proposal:
    """One round's draft (verifier vocabulary: these are the draft tokens), in target terms
    whatever the drafter's readout: with a draft vocabulary, -inf logits / 0 probs outside it.

    G ≤ the γ asked for; G = 0 (tokens [B, 0], logits/probs [B, 0, V]) is a drafter saying it
    has nothing to propose (prompt lookup without a match): the engines then take a plain step
    for that request. Learned drafters always propose the γ asked for."""

    tokens: Tensor  # [B, G] long, draft tokens x_n .. x_{n+G-1} (target ids)
    logits: Tensor  # [B, G, V] drafter logits each token was sampled from (before processing)
    probs: Tensor  # [B, G, V] q: the processed distribution each token was sampled from
    confidences: Tensor | None = None  # [B, G] σ(c_k): P(draft k accepted | prefix accepted)
    states: Tensor | None = None  # [B, G, H] the drafter's own state of each draft slot (DLoop)

    def rows(self, i: int, g: int) -> Proposal:
        """Row i's first g drafts, [1, g] (a drafter's batched proposal split per request)."""
        conf, states = self.confidences, self.states
        return Proposal(self.tokens[i:i + 1, :g], self.logits[i:i + 1, :g], self.probs[i:i + 1, :g],
                        conf[i:i + 1, :g] if conf is not None else None, states[i:i + 1, :g] if states is not None else None)

    def log_q(self, picked: Tensor) -> Tensor:
        """log q(picked) [B, G] of target ids picked [B, G] under each slot's drafter logits."""
        return torch.log_softmax(self.logits.float(), dim=-1).gather(-1, picked.unsqueeze(-1)).squeeze(-1)

    @staticmethod
    def concat(props: list[Proposal]) -> Proposal:
        """Consecutive proposals (DLoop stages) as one, along the draft axis (confidences kept
        where every stage has them; states dropped); proposals of one kind join as that kind does."""
        if len(props) == 1:
            return props[0]
        kind = type(props[0])
        return kind.join(props) if all(type(p) is kind for p in props) else Proposal.join(props)

    @staticmethod
    def join(props: list[Proposal]) -> Proposal:
        """``concat`` of two or more proposals, their tensors read and joined now."""
        conf = [p.confidences for p in props]
        return Proposal(torch.cat([p.tokens for p in props], 1), torch.cat([p.logits for p in props], 1),
                        torch.cat([p.probs for p in props], 1),
                        torch.cat(conf, 1) if all(c is not None for c in conf) else None)


class LazyProposal(Proposal):
    """A ``Proposal`` whose ``logits``/``probs`` [B, G, V] are built when a rule first reads them
    (``build_logits``/``build_probs``, the subclass's): greedy verification compares tokens and
    reads neither, and at a large V writing them is a large share of a cheap drafter's round."""

    def __init__(self, tokens: Tensor, confidences: Tensor | None = None, states: Tensor | None = None):
        self.tokens, self.confidences, self.states = tokens, confidences, states  # [B, G], [B, G], [B, G, H]
        self._logits: Tensor | None = None
        self._probs: Tensor | None = None

    def build_logits(self) -> Tensor:  # [B, G, V]
        raise NotImplementedError

    def build_probs(self) -> Tensor:  # [B, G, V]
        raise NotImplementedError

    @property  # type: ignore[override]
    def logits(self) -> Tensor:  # [B, G, V]
        if self._logits is None:
            self._logits = self.build_logits()
        return self._logits

    @logits.setter
    def logits(self, value: Tensor) -> None:
        self._logits = value

    @property  # type: ignore[override]
    def probs(self) -> Tensor:  # [B, G, V]
        if self._probs is None:
            self._probs = self.build_probs()
        return self._probs

    @probs.setter
    def probs(self, value: Tensor) -> None:
        self._probs = value
