"""What a drafter can do beyond the core interface, declared once and checked by name.

The core interface (:class:`components.drafters.base.Drafter`: ``init_state``, ``consume``,
``propose``, ``rollback``, ``training_forward``) is what every drafter has. The features below
need more, and a drafter says which it has in ``Drafter.capabilities()`` (a class may make it
depend on its config, e.g. carryover exists only when the drafter was built with
``drafter.carryover=true``). Engines, objectives and exporters never probe attributes
(``hasattr``/``isinstance``): a feature that needs a capability calls :func:`require` when it is
built, which fails with the drafter's name and the missing capability; a fast path that is
optional asks :func:`has`.

Each capability names the methods it stands for; the Protocols below give their signatures
(``declared_signature`` reads one, with its declared result, e.g. for a wrapper that must stand in
for it), and ``tests/components/drafters/test_drafters_capabilities.py`` checks every
registered drafter implements what it declares.

This module knows nothing about particular drafter families, engines or objectives.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Sequence
from enum import Enum
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

from components.drafters.errors import DrafterError

if TYPE_CHECKING:
    import torch

    from components.drafters.exchange import (
        DraftBatch,
        DraftState,
        DraftTrainOutput,
        Proposal,
        TargetKV,
    )
    from components.drafters.layers import KV
    from components.spec.sampling import SamplingParams
    from components.spec.trees import CausalHead


class Capability(str, Enum):
    """One optional ability of a drafter; the value is its name in error messages."""

    BATCHED_PROPOSE = "batched_propose"  # propose_many: one draft pass over many rows' states
    BATCHED_CONSUME = "batched_consume"  # consume_many: one context pass over many rows' states
    OWN_CONTEXT = "own_context"  # consume_own + Proposal.states: DLoop's later stages
    CARRYOVER = "carryover"  # with_carry: the next draft reads the rejected drafts' target states
    CAUSAL_TREE_HEAD = "causal_tree_head"  # causal_tree_head: path-dependent scores for token trees
    BLOCK_INTERNALS = "block_internals"  # BlockInternals: the block backbone the objectives unroll
    SLOT_HEADS = "slot_heads"  # markov_head / confidence_head modules the exporters write
    HEAD_START = "head_start"  # head_start: draft layers initialised from the target's last layers
    LEARNS_RESPONSES = "learns_responses"  # observe: finished responses teach it (suffix decoding's global tree)
    PREVIEWS = "previews"  # preview: the next draft's confidences known before drafting (draft-then-decide)
    BASE_LOGITS = "base_logits"  # train_readout_base: the backbone's logits before a causal head (curricula)
    ROUND_LIMIT = "round_limit"  # max_speculative_tokens: the most one round (block, pass) can draft
    TARGET_KV = "target_kv"  # with_target_kv: reads the target's own K/V cache in place (H-Spec)
    RECYCLES = "recycles"  # with_recycled: the next block reads the last round's rejected drafts (ReTrace)
    LAYER_KERNEL = "layer_kernel"  # kernel_layers/use_layer_kernel: its block's layers through a fused layer call

    @property
    def methods(self) -> tuple[str, ...]:
        """The attributes a drafter declaring this capability must have."""
        return _METHODS[self]


_METHODS: dict[Capability, tuple[str, ...]] = {
    Capability.BATCHED_PROPOSE: ("propose_many",),
    Capability.BATCHED_CONSUME: ("consume_many",),
    Capability.OWN_CONTEXT: ("consume_own",),
    Capability.CARRYOVER: ("with_carry", "carry_embed"),
    Capability.CAUSAL_TREE_HEAD: ("causal_tree_head",),
    Capability.BLOCK_INTERNALS: ("backbone", "max_speculative_tokens", "target_context", "block_states",
                                 "draft_states", "block_output", "sample_readout", "train_readout"),
    Capability.SLOT_HEADS: ("markov_head", "confidence_head"),
    Capability.HEAD_START: ("head_start",),
    Capability.LEARNS_RESPONSES: ("observe",),
    Capability.PREVIEWS: ("preview",),
    Capability.BASE_LOGITS: ("train_readout_base",),
    Capability.ROUND_LIMIT: ("max_speculative_tokens",),
    Capability.TARGET_KV: ("target_kv_layers", "with_target_kv"),
    Capability.RECYCLES: ("with_recycled", "recycle"),
    Capability.LAYER_KERNEL: ("kernel_layers", "use_layer_kernel"),
}


class CapabilityError(DrafterError):
    """A feature was asked of a drafter that does not declare what the feature needs."""


def has(drafter: Any, capability: Capability) -> bool:
    """Whether ``drafter`` declares ``capability`` (for optional fast paths)."""
    return capability in drafter.capabilities()


def require(drafter: Any, feature: str, *capabilities: Capability, hint: str = "") -> None:
    """Raises :class:`CapabilityError` naming the feature, the drafter and each missing capability.

    Call it where the feature is built (an engine's or objective's constructor), not in a round."""
    missing = [c.value for c in capabilities if c not in drafter.capabilities()]
    if missing:
        name = getattr(getattr(drafter, "cfg", None), "name", type(drafter).__name__)
        declared = ", ".join(sorted(c.value for c in drafter.capabilities())) or "none"
        raise CapabilityError(f"{feature} needs capability {', '.join(missing)}; drafter '{name}' "
                              f"({type(drafter).__name__}) declares: {declared}" + (f". {hint}" if hint else ""))


def declared_signature(method: str) -> inspect.Signature | None:
    """The signature a capability's ``method`` declares in its Protocol below, without ``self``
    (annotations as written: ``return_annotation`` is e.g. ``"list[Proposal]"``); None for an
    attribute (``carry_embed``) or a name no Protocol gives."""
    for proto in _protocols():
        fn = proto.__dict__.get(method)
        if inspect.isfunction(fn):
            sig = inspect.signature(fn)
            return sig.replace(parameters=list(sig.parameters.values())[1:])
    return None


def _protocols() -> list[type]:
    return [v for v in globals().values() if isinstance(v, type) and Protocol in v.__mro__[1:]]


# ----------------------------------------------------------------------------- signatures
class BatchedPropose(Protocol):
    def propose_many(self, states: list[DraftState], last_tokens: Tensor,  # last_tokens [R] long
                     sampling: SamplingParams | list[SamplingParams],
                     num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """One proposal [1, γ_i] per row, each equal to ``propose`` on that row alone."""


class BatchedConsume(Protocol):
    def consume_many(self, states: list[DraftState], tokens: list[Tensor],  # each [1, T_i] long
                     hidden: list[Tensor]) -> list[DraftState]:  # each [1, T_i, n, H]
        """``consume`` per row, in one pass."""


class OwnContext(Protocol):
    def consume_own(self, state: DraftState, states: Tensor) -> DraftState:  # states [B, k, H]
        """DLoop: the drafter's own slot states of unverified positions become context."""


class Carryover(Protocol):
    carry_embed: Tensor  # [n·H]

    def with_carry(self, state: DraftState, hidden_rej: Tensor,  # hidden_rej [B, k, n, H]
                   start_position: int) -> DraftState:
        """The state plus one round's context rows from the rejected drafts' target taps."""


class ReadsTargetKV(Protocol):
    target_kv_layers: list[int]  # the target layers whose K/V the drafter reads

    def with_target_kv(self, state: DraftState, kv: TargetKV) -> DraftState:
        """The state plus read access to the target's K/V of ``target_kv_layers`` over the
        committed context (views the engine made of its cache; read by the next ``propose``)."""


class Recycles(Protocol):
    recycle: Any  # the gated residual that fuses recycled states into the block's input embeddings

    def with_recycled(self, state: DraftState, proposal: Proposal, accepted: int,
                      next_token: Tensor) -> DraftState:  # next_token [B] long
        """The state (after consuming the round's committed tokens) plus the round's rejected
        drafts (``proposal.states`` past the ``accepted`` ones), aligned with the next block's slots."""


class LearnsResponses(Protocol):
    def observe(self, response: Sequence[int], key: Hashable | None = None) -> None:
        """Keeps a finished response (its new tokens) to draft from in later requests."""


class Previews(Protocol):
    def preview(self, state: DraftState, recent: Tensor) -> Tensor | None:  # recent [1, k+1] long
        """The confidences [1, g] of the draft ``propose`` would make once the ids of ``recent``
        (committed since ``state`` last consumed, then the last token) are consumed: g = 0, it
        would propose nothing; None, not known before drafting. A cheap lookup, not a pass."""


class BaseLogits(Protocol):
    def train_readout_base(self, z: Tensor, prev: Tensor  # z [N, γ, H], prev [N, γ] long
                           ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Teacher-forced logits [N, γ, R] after the causal head, confidence logits [N, γ] | None,
        and the backbone's own logits [N, γ, R] before it (never None for a declaring drafter)."""


class CausalTreeHead(Protocol):
    def causal_tree_head(self, z: Tensor) -> CausalHead:  # z [γ, H] -> scores of a node's children
        """Path-dependent child scores read from one proposal's slot states."""


class BlockInternals(Protocol):
    """The block backbone as the DLoop and carryover objectives unroll it (DFlash family)."""

    backbone: Any  # BlockBackbone: fc, fuse, features_kv, context_kv
    max_speculative_tokens: int  # draft slots per block

    def target_context(self, hidden: Tensor) -> list[KV]: ...  # taps [B, T, n, H] -> K/V per layer
    def block_states(self, input_ids: Tensor, anchors: Tensor, context: list[KV],
                     visible: Tensor) -> Tensor: ...  # -> z [B, A, bs, H]
    def draft_states(self, z: Tensor) -> Tensor: ...  # [B, A, bs, H] -> [B, A, γ, H]
    def block_output(self, batch: DraftBatch, anchors: Tensor, z: Tensor,
                     targets: bool = True) -> DraftTrainOutput: ...
    def train_readout(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None]: ...
    def sample_readout(self, z: Tensor, last_token: Tensor, sampling: SamplingParams,
                       generator: torch.Generator | None) -> Proposal: ...
