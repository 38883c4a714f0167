"""The one drafter interface that the trainer and the engine use, and the data it exchanges
(defined in ``exchange.py``, re-exported here).

A drafter reads target hidden states at ``layer_ids`` (layer i = output of decoder layer i,
0-based = HF ``hidden_states[i+1]``), shares the target's frozen embedding table and LM head
(never registered as its own parameters; a draft vocabulary's own head is), and proposes γ tokens per round: γ is
``num_speculative_tokens`` in config and code (``gamma`` in formula code, the survey's symbol);
a block drafter's ``block_size`` is the block layout, and ``max_speculative_tokens`` the most one
block drafts. The adaptive engine's per-round cap G ≤ γ · ``loop_stages`` (``max_cap``).

Engine protocol, for a sequence whose tokens ``x_0..x_{n-1}`` are verified and whose target
hidden states exist for ``x_0..x_{n-2}`` (the last token, the bonus/recovered one, has not been
through the target yet)::

    state = drafter.init_state(B)
    state = drafter.consume(state, tokens[:, :n-1], hidden[:, :n-1])  # context grows to n-1
    prop  = drafter.propose(state, last_token=x[:, n-1])              # drafts x_n .. x_{n+γ-1}
                                                                      # (or fewer; none: a plain step)
    ... verify, then consume the newly verified positions (or rollback(state, accepted_len)
    after consuming speculative ones); with carryover, then
    state = drafter.with_carry(state, hidden_rejected, state.length)  # read by the next propose

Trainer protocol: ``drafter.training_forward(DraftBatch) -> DraftTrainOutput`` whose
``loss_inputs()`` is exactly what :mod:`components.losses` consumes. Draft j of a block anchored
at position a always predicts token ``x_{a+j+1}``; its target distribution is the frozen head on
the target's last hidden state at ``a+j``.

Vocabulary: with ``drafter.draft_vocab_size`` a drafter owns a draft vocabulary
(``drafter.vocab``, :mod:`components.drafters.vocab`) and reads out over R = DV tokens, else
through the shared head over R = V. Proposals are always in the target's terms (target ids,
distributions over V); training outputs are in the readout's (R columns, draft ids, the
target's distribution restricted to the draft vocabulary).

This module knows nothing about particular drafter families, checkpoints files or engines.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from components.config import DrafterConfig
from components.drafters.errors import DrafterError
from components.drafters.exchange import (  # noqa: F401  (re-exported: the data of the interface)
    DraftBatch,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    Proposal,
    Recycled,
    SharedParts,
    TargetInfo,
    TargetKV,
)
from components.drafters.vocab import DraftVocab
from components.spec.argmax import argmax_last
from components.spec.sampling import GREEDY, SamplingParams, probs_from_logits

if TYPE_CHECKING:
    from components.drafters.capabilities import Capability

DEFAULT_SAMPLING = SamplingParams()  # temperature 1, no top-k/top-p
LAYER_ID_CONVENTION = "layer i = output of decoder layer i (0-based) = HF hidden_states[i+1]"


# ----------------------------------------------------------------------------- helpers
def is_greedy(sampling: SamplingParams) -> bool:
    """A scalar temperature of 0: a readout takes the argmax and uses no randomness."""
    return not isinstance(sampling.temperature, Tensor) and sampling.temperature <= 0


def sample_tokens(
    logits: Tensor,  # [B, ..., V]
    sampling: SamplingParams,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:  # tokens [B, ...] long, probs [B, ..., V]
    """Draws one token per row from the processed distribution (greedy rows take the argmax).

    All-greedy settings (a scalar temperature 0) skip processing and the draw: the argmax and
    its one-hot, exactly what processing + multinomial would give, without touching ``generator``."""
    if is_greedy(sampling):
        tokens = argmax_last(logits)
        probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
        return tokens, probs.scatter_(-1, tokens.unsqueeze(-1), 1.0)
    probs = probs_from_logits(logits, sampling)
    flat = probs.reshape(-1, probs.shape[-1])
    tokens = torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])
    return tokens, probs


def row_settings(rows: int, sampling: SamplingParams | list[SamplingParams], num_speculative_tokens: int | list[int] | None,
                 generators: list[torch.Generator | None] | None,
                 default_drafts: int) -> tuple[list[int], list[SamplingParams], list[torch.Generator | None]]:
    """A ``propose_many`` call's arguments per row: (γ, sampling, generator) lists of ``rows``,
    from values shared by all rows or given one per row."""
    per_row = num_speculative_tokens if isinstance(num_speculative_tokens, list) else [num_speculative_tokens or default_drafts] * rows
    samplings = sampling if isinstance(sampling, list) else [sampling] * rows
    return per_row, samplings, generators if generators is not None else [None] * rows


def sample_rows(logits: Tensor, samplings: list[SamplingParams],
                generators: list[torch.Generator | None]) -> tuple[Tensor, Tensor]:
    """``sample_tokens`` for rows that each have their own sampling and generator: logits
    [R, ..., V] → tokens [R, ...], probs [R, ..., V]; row i draws exactly what
    ``sample_tokens(logits[i:i+1], samplings[i], generators[i])`` draws (all-greedy rows: one call)."""
    if all(is_greedy(s) for s in samplings):
        return sample_tokens(logits, samplings[0], None)
    draws = [sample_tokens(logits[i:i + 1], samplings[i], generators[i]) for i in range(logits.shape[0])]
    return torch.cat([t for t, _ in draws]), torch.cat([p for _, p in draws])


class RowDraws:
    """The draws of an autoregressive ``propose_many`` (one step over all rows at a time): each
    step's readout logits [R, D] (D = DV with a draft vocabulary, else V) are sampled per row
    (``sample_rows``; a row past its own γ takes the argmax, drawing nothing its batch-1
    ``propose`` would not), and the steps are split back into one ``Proposal`` [1, γ_i] per row,
    in target ids over V."""

    def __init__(self, samplings: list[SamplingParams], per_row: list[int],
                 generators: list[torch.Generator | None], vocab: DraftVocab | None = None):
        self.samplings, self.per_row, self.generators, self.vocab = samplings, per_row, generators, vocab
        self.tokens: list[Tensor] = []  # per step [R] target ids
        self.logits: list[Tensor] = []  # per step [R, D]
        self.probs: list[Tensor] = []  # per step [R, D]

    def draw(self, logits: Tensor) -> Tensor:
        """This step's readout logits [R, D] → the rows' tokens [R] (target ids)."""
        step = len(self.tokens)
        rows = [s if step < n else GREEDY for s, n in zip(self.samplings, self.per_row)]
        tokens, probs = sample_rows(logits, rows, self.generators)
        tokens = self.vocab.to_target(tokens) if self.vocab is not None else tokens
        self.tokens.append(tokens)
        self.logits.append(logits)
        self.probs.append(probs)
        return tokens

    def proposals(self) -> list[Proposal]:
        prop = target_proposal(self.vocab, torch.stack(self.tokens, 1), torch.stack(self.logits, 1),
                               torch.stack(self.probs, 1))
        return [prop.rows(i, n) for i, n in enumerate(self.per_row)]


def target_proposal(vocab: DraftVocab | None, tokens: Tensor, logits: Tensor, probs: Tensor,
                    confidences: Tensor | None = None, states: Tensor | None = None) -> Proposal:
    """A proposal in target terms from target-id tokens [B, γ] and readout logits/probs [B, γ, D]:
    with a draft vocabulary they are spread into V (-inf logits, 0 probs outside it)."""
    if vocab is not None:  # spread into V when a rule first reads them
        return vocab.proposal(tokens, logits, probs, confidences, states)
    return Proposal(tokens, logits, probs, confidences, states)


def block_tokens(
    batch: DraftBatch,
    anchors: Tensor,  # [B, A] long, -1 = unused
    gamma: int,
) -> tuple[Tensor, Tensor]:  # tokens [B, A, γ] long (0 where invalid), valid [B, A, γ] bool
    """The recorded tokens x_{a+1..a+γ} of blocks anchored at ``anchors`` and their validity:
    inside the sequence, supervised (``batch.loss_mask``), and prefix-closed (a draft is valid
    only if every earlier draft of its block is)."""
    b, t = batch.input_ids.shape
    nxt = anchors.clamp_min(0).unsqueeze(-1) + torch.arange(1, gamma + 1, device=anchors.device)  # [B, A, γ]
    inside = (nxt < t) & (anchors >= 0).unsqueeze(-1)
    nxt_c = nxt.clamp_max(t - 1).view(b, -1)
    loss_mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
    valid = inside & torch.gather(loss_mask.bool(), 1, nxt_c).view_as(nxt)
    valid = torch.cumprod(valid.to(torch.int32), dim=-1).bool()
    tokens = torch.gather(batch.input_ids, 1, nxt_c).view_as(nxt)
    return torch.where(valid, tokens, torch.zeros_like(tokens)), valid


def block_targets(
    batch: DraftBatch,
    anchors: Tensor,  # [B, A] long, -1 = unused
    gamma: int,
    shared: SharedParts,
    logits: bool = True,
    vocab: DraftVocab | None = None,
) -> tuple[Tensor | None, Tensor, Tensor]:  # target logits [N, γ, R] | None, tokens [N, γ], valid [N, γ]
    """Targets of blocks anchored at ``anchors``: draft j predicts x_{a+j+1}; its target
    distribution is the frozen head on the target's last hidden state at a+j. ``logits=False``
    skips the head (tokens and validity only, e.g. to count greedy acceptance). With a draft
    ``vocab`` the logits are the head's rows of the draft vocabulary (the target restricted to it,
    renormalised by any softmax), tokens are draft ids, and ``valid`` ends at the first data token
    outside it (see :mod:`components.drafters.vocab` for why)."""
    tokens, valid = block_tokens(batch, anchors, gamma)
    tokens, valid = tokens.view(-1, gamma), valid.view(-1, gamma)
    if vocab is not None:
        tokens, valid = vocab.restrict_tokens(tokens, valid)
    if not logits:
        return None, tokens, valid
    b, t = batch.input_ids.shape
    pos_c = (anchors.clamp_min(0).unsqueeze(-1) + torch.arange(gamma, device=anchors.device)).clamp_max(t - 1)
    # blocks overlap (64 anchors × γ on a response of ~100 tokens reads each position ~4 times):
    # the frozen head, the largest product of a step, runs once per position they read
    flat = (pos_c + torch.arange(b, device=anchors.device).view(b, 1, 1) * t).view(-1)  # [B·A·γ] rows of [B·T]
    rows, where = torch.unique(flat, return_inverse=True)  # [U], [B·A·γ]
    h = batch.last_hidden.reshape(b * t, -1)[rows]  # [U, H]
    with torch.no_grad():
        normed = shared.final_norm(h)
        target_logits = vocab.target_logits(shared.lm_head, normed) if vocab is not None else shared.lm_head(normed)
    return target_logits[where].view(-1, gamma, target_logits.shape[-1]), tokens, valid


def train_output(
    draft_logits: Tensor,  # [N, γ, R] drafts of the blocks at anchors
    batch: DraftBatch,
    anchors: Tensor,  # [B, A] long, -1 = unused (N = B·A)
    shared: SharedParts,
    targets: bool = True,
    vocab: DraftVocab | None = None,
    confidence_logits: Tensor | None = None,  # [N, γ]
    base_logits: Tensor | None = None,  # [N, γ, R] the backbone's logits before a causal head
) -> DraftTrainOutput:
    """The drafts with their targets (``block_targets``) and, with a draft vocabulary, the
    validity before its cut (``reachable``)."""
    gamma = draft_logits.shape[1]
    target_logits, tokens, valid = block_targets(batch, anchors, gamma, shared, targets, vocab)
    reachable = block_tokens(batch, anchors, gamma)[1].view(-1, gamma) if vocab is not None else None
    return DraftTrainOutput(draft_logits, target_logits, tokens, valid, confidence_logits, reachable, base_logits)


def rows_at_anchors(
    per_position: Tensor,  # [B, T, γ, R] drafts of the block anchored at every position
    batch: DraftBatch,
    default: Tensor,  # [B, A] anchors used when batch.anchors is None
    shared: SharedParts,
    targets: bool = True,
    vocab: DraftVocab | None = None,
) -> DraftTrainOutput:
    """Keeps the blocks at ``batch.anchors`` (or ``default``) and attaches their targets
    (``targets=False``: no target logits, see :meth:`Drafter.training_forward`)."""
    anchors = batch.anchors if batch.anchors is not None else default
    gamma, v = per_position.shape[2:]
    draft = gather_positions(per_position, anchors).reshape(-1, gamma, v)
    return train_output(draft, batch, anchors, shared, targets, vocab)


def gather_positions(x: Tensor, positions: Tensor) -> Tensor:
    """x [B, T, ...] at positions [B, ...] (clamped into range) → [B, ..., rest of x]."""
    b, t = x.shape[:2]
    idx = positions.clamp(0, t - 1).reshape(b, -1)
    rest = x.shape[2:]
    out = torch.gather(x, 1, idx.view(b, -1, *([1] * len(rest))).expand(-1, -1, *rest))
    return out.view(*positions.shape, *rest)


# ----------------------------------------------------------------------------- interface
class Drafter(nn.Module, ABC):
    """The interface. Subclasses register with ``@register_drafter(name)`` in registry.py."""

    registry_name: str = ""  # set by @register_drafter
    default_num_layers: int = 1
    default_sample_from_anchor: bool = True

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__()
        self.spec = spec
        self.cfg = spec.config
        self.sizes = spec.sizes
        self._shared = [shared]  # a list: not registered as submodules, never saved
        dv = spec.config.draft_vocab_size  # a draft vocabulary (None: read out over the full one)
        self.vocab: DraftVocab | None = DraftVocab(spec.target.vocab_size, dv, spec.sizes.hidden_size) if dv else None

    @property
    def shared(self) -> SharedParts:
        return self._shared[0]

    @shared.setter
    def shared(self, parts: SharedParts) -> None:  # e.g. an int8 readout head (drafters.quantize)
        self._shared[0] = parts

    @property
    def layer_ids(self) -> list[int]:
        return list(self.cfg.layer_ids or [])

    @property
    def num_speculative_tokens(self) -> int:
        """γ: draft tokens per round by default (resolved by ``registry.resolve_spec``)."""
        return int(self.cfg.num_speculative_tokens)

    @staticmethod
    def default_layer_ids(num_target_layers: int, cfg: DrafterConfig) -> list[int]:
        return spread_layer_ids(num_target_layers, cfg.num_taps)

    @staticmethod
    def default_num_speculative_tokens(cfg: DrafterConfig) -> int:
        """γ when the config leaves ``num_speculative_tokens`` unset."""
        return 1

    @staticmethod
    def max_speculative_tokens_for(cfg: DrafterConfig) -> int | None:
        """The largest γ one round (one DLoop stage) can draft; None: no bound."""
        return None

    # -- what subclasses implement
    @abstractmethod
    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        """Teacher-forced drafts for the losses (all blocks of the batch).

        ``targets=False`` leaves ``target_logits`` None (the frozen head is not run): for callers
        that only compare drafts with the data tokens, e.g. greedy acceptance counts."""

    @abstractmethod
    def consume(self, state: DraftState, tokens: Tensor, hidden: Tensor) -> DraftState:
        """Appends verified positions: tokens [B, T] long, their target taps hidden [B, T, n, H]."""

    @abstractmethod
    def propose(self, state: DraftState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        """Drafts after ``last_token`` [B] (at position state.length); the state is unchanged."""

    @abstractmethod
    def sequential_passes(self, gamma: int) -> int:
        """Dependent drafter network passes one round of γ drafts costs (heads excluded)."""

    # -- shared behaviour
    def capabilities(self) -> frozenset[Capability]:
        """What this drafter can do beyond the core interface (``drafters.capabilities``);
        features check it with ``require``/``has`` instead of probing attributes."""
        return frozenset()

    def init_state(self, batch_size: int) -> DraftState:
        return DraftState()

    def rollback(self, state: DraftState, length: int) -> DraftState:
        """The state as it was when ``length`` positions were committed (crops every tensor)."""
        if not 0 <= length <= state.length:
            raise DrafterError(f"rollback to {length} outside the committed context 0..{state.length}")
        kv = [(k[:, :, :length], v[:, :, :length]) for k, v in state.kv]
        feats = state.feats[:, :length] if state.feats is not None else None
        return DraftState(length, kv, feats)

    def consume_own(self, state: DraftState, states: Tensor) -> DraftState:
        """DLoop: appends the drafter's own states [B, k, H] of unverified positions as context."""
        raise DrafterError(f"drafter '{self.cfg.name}' cannot use its own states as context (DLoop)")

    def with_carry(self, state: DraftState, hidden_rej: Tensor, start_position: int) -> DraftState:
        """Carryover: the state plus temporary context rows from the target taps hidden_rej
        [B, k, n, H] of the last round's rejected drafts, at positions start_position.. (read by
        the next ``propose`` only; k = 0 gives no carryover context)."""
        raise DrafterError(f"drafter '{self.cfg.name}' ({type(self).__name__}) cannot read rejected target "
                           "states (carryover): only block drafters (dflash, dspark) built with "
                           "drafter.carryover=true can")

    def num_parameters(self) -> int:
        """Trainable parameters, excluding the target's shared frozen parts."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def identity(self) -> str:
        """What measurements of this drafter (round profiles) are keyed by: its class and size,
        the target's shared parts included, and the formats its products are packed in where a
        kernel streams them (``target.fast.stream_linears``: e.g. q8_0), which change its time."""
        packed = sorted({m.packed.format for m in self.modules() if getattr(m, "packed", None) is not None})
        return f"{type(self).__name__}:{sum(p.numel() for p in self.parameters())}" + "".join(f":{f}" for f in packed)

    def embed(self, ids: Tensor) -> Tensor:  # [B, ...] long target ids -> [B, ..., H]
        return self.shared.embed_tokens(ids)

    def lm_head(self, h: Tensor) -> Tensor:  # [..., H] -> [..., R] readout logits
        return self.readout_head(h)

    # -- the readout vocabulary (components.drafters.vocab)
    @property
    def readout_size(self) -> int:
        """R: the tokens drafts are read out over (DV with a draft vocabulary, else V)."""
        return self.vocab.size if self.vocab is not None else self.spec.target.vocab_size

    @property
    def readout_head(self) -> nn.Module:
        """H → R: the draft-vocabulary head, else the target's shared LM head."""
        return self.vocab.readout() if self.vocab is not None else self.shared.lm_head

    def use_readout_head(self, head: nn.Module) -> None:
        """Reads out through an inference copy (e.g. int8, drafters.quantize); the target's own head
        and the draft head's float weights (what checkpoints save) are left as they are."""
        if self.vocab is not None:
            self.vocab.use(head)
        else:
            self.shared = dataclasses.replace(self.shared, lm_head=head)

    def set_draft_vocab(self, target_ids: Tensor) -> Drafter:
        """Gives a drafter built with ``drafter.draft_vocab_size`` its vocabulary, sorted target ids
        [DV]; the draft head starts as the target's LM-head rows of them. Returns self."""
        if self.vocab is None:
            raise DrafterError(f"drafter '{self.cfg.name}' was built without drafter.draft_vocab_size")
        self.vocab.assign(target_ids, self.shared.lm_head.weight)
        return self

    def to_target(self, ids: Tensor) -> Tensor:  # [...] readout ids -> [...] target ids
        return self.vocab.to_target(ids) if self.vocab is not None else ids

    def full_logits(self, logits: Tensor) -> Tensor:  # [..., R] -> [..., V], -inf outside a draft vocabulary
        return self.vocab.widen(logits, float("-inf")) if self.vocab is not None else logits

    def draw(self, logits: Tensor, sampling: SamplingParams,
             generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
        """Readout logits [..., R] → (tokens [...] in target ids, probs [..., R]) (``sample_tokens``)."""
        tokens, probs = sample_tokens(logits, sampling, generator)
        return self.to_target(tokens), probs

    def proposal(self, tokens: Tensor, logits: Tensor, probs: Tensor, confidences: Tensor | None = None,
                 states: Tensor | None = None) -> Proposal:
        """tokens [B, γ] target ids, readout logits/probs [B, γ, R] → a Proposal over V."""
        return target_proposal(self.vocab, tokens, logits, probs, confidences, states)

    def describe(self) -> dict[str, Any]:
        return {"name": self.cfg.name, "layer_ids": self.layer_ids, "parameters": self.num_parameters(),
                "num_speculative_tokens": self.num_speculative_tokens, "readout_vocab": self.readout_size,
                "sequential_passes": self.sequential_passes(self.num_speculative_tokens)}


def spread_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """DFlash's spread: round(1 + i(L-4)/(n-1)) (layers 1..L-3); [L//2] for n = 1.

    Targets too shallow for n distinct layers in 1..L-3 use 0..L-2 instead, with fewer taps.
    """
    L = num_target_layers
    if n == 1:
        return [L // 2]
    lo, hi = 1, L - 3
    if hi - lo + 1 < n:
        lo, hi = 0, max(0, L - 2)
    n = min(n, hi - lo + 1)
    if n == 1:
        return [lo]
    return sorted({round(lo + i * (hi - lo) / (n - 1)) for i in range(n)})


def resolved(cfg: DrafterConfig, **values: Any) -> DrafterConfig:
    """A copy of cfg with the given fields filled in."""
    return dataclasses.replace(cfg, **values)
