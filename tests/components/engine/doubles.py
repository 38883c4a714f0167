"""Stand-ins built for the purpose, so that what a test asserts does not rest on what the
fixture target's float-sensitive training happened to produce on this CPU.

* ``MarkovTarget`` -- the fixture target's forward (KV cache, hidden states, positions: all real)
  whose logits are replaced by a table indexed by the input token: two tokens A and B carry
  almost all the mass, with known, unequal probabilities (``two_token_table``);
* ``ScriptedDrafter`` -- drafts the known continuation of a request (right), or that plus one
  (wrong), with fixed confidences, whatever the target's weights;
* ``SecondGuessDrafter`` -- every slot's favourite is wrong and its runner-up right, so a chain
  or a one-node tree accepts nothing and a full binary tree accepts its whole depth;
* ``TargetKVReader`` -- prompt lookup declaring ``Capability.TARGET_KV`` (the H-Spec drafter's
  engine side, before that drafter exists): at every ``propose`` it checks the target K/V it
  was handed against the target's own batch-1 forward over the committed tokens;
* ``counting_forwards`` -- the real target, each forward's input width recorded.
"""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import Proposal, TargetKV, row_settings
from components.drafters.capabilities import Capability
from components.engine.model_free import (
    PromptLookupDrafter,
    TokenDrafter,
    TokenState,
    one_hot_proposal,
)

# P(next = A | previous token) among {A, B}; the rest of the vocabulary gets e^-12 each
P_AFTER_A, P_AFTER_B, P_AFTER_OTHER = 0.75, 0.3, 0.7
OTHER_LOGIT = -12.0


def two_token_table(vocab_size: int, a: int, b: int) -> Tensor:  # → [V, V] float32
    """Next-token logits per input token: after A, P(A) = 0.75 of {A, B}; after B, 0.3; after
    any other token, 0.7. Top-2 sampling sees exactly these; temperature T divides the gaps."""
    table = torch.full((vocab_size, vocab_size), OTHER_LOGIT)
    table[:, a], table[:, b] = math.log(P_AFTER_OTHER), math.log(1 - P_AFTER_OTHER)
    table[a, a], table[a, b] = math.log(P_AFTER_A), math.log(1 - P_AFTER_A)
    table[b, a], table[b, b] = math.log(P_AFTER_B), math.log(1 - P_AFTER_B)
    return table


class MarkovTarget:
    """``target`` with logits ``table[input_ids]`` [B, T, V]: a first-order Markov chain over
    tokens whose distribution is known exactly; everything else is the real target's."""

    def __init__(self, target: Any, table: Tensor):
        self.target, self.table = target, table  # table [V, V]
        self.model = _TableModel(self)  # what ``TargetDrafter`` calls

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)

    def logits(self, input_ids: Tensor) -> Tensor:  # [B, T] → [B, T, V]
        return self.table.to(input_ids.device)[input_ids]

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Any:
        out = self.target.forward(input_ids, **kwargs)
        return dataclasses.replace(out, logits=self.logits(input_ids).to(out.logits.dtype))

    __call__ = forward


class _TableModel:
    def __init__(self, owner: MarkovTarget):
        self.owner = owner

    def __call__(self, input_ids: Tensor, **kwargs: Any) -> SimpleNamespace:
        return SimpleNamespace(logits=self.owner.logits(input_ids))


def markov_target(target: Any, avoid: list[int]) -> tuple[MarkovTarget, int, int]:
    """A ``MarkovTarget`` over ``target`` and its tokens A, B (neither of them in ``avoid``)."""
    a, b = [t for t in range(target.vocab_size - 1, -1, -1) if t not in set(avoid)][:2]
    return MarkovTarget(target, two_token_table(target.vocab_size, a, b)), a, b


class ScriptedDrafter(TokenDrafter):
    """Proposes the continuation of the reference (prompt + expected output) whose prefix the
    context is: right, or each token plus one (``wrong``: the first draft is always rejected);
    ``confidence``: the confidence head's P(draft k accepted | prefix accepted), every slot."""

    def __init__(self, references: list[list[int]], vocab_size: int, num_speculative_tokens: int,
                 confidence: float | None = None, wrong: bool = False):
        super().__init__(vocab_size, num_speculative_tokens)
        self.references = [list(r) for r in references]
        self.confidence, self.wrong = confidence, wrong

    def continuation(self, state: TokenState, last_token: Tensor, gamma: int) -> list[int]:
        context = state.tokens + [int(last_token[0])]
        ref = next((r for r in self.references if r[:len(context)] == context), [])
        return (ref[len(context):len(context) + gamma] + [0] * gamma)[:gamma]

    def propose(self, state: TokenState, last_token: Tensor, sampling: Any = None,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        tokens = self.continuation(state, last_token, gamma)
        if self.wrong:
            tokens = [(t + 1) % self.vocab_size for t in tokens]
        prop = one_hot_proposal(tokens, self.vocab_size, self.device)
        if self.confidence is not None:
            prop.confidences = torch.full((1, gamma), float(self.confidence), device=self.device)  # [1, γ]
        return prop


class SecondGuessDrafter(ScriptedDrafter):
    """Per slot k, q = 0.6 on (right_k + 1), 0.4 on right_k, ~0 elsewhere (right: the reference)."""

    def propose(self, state: TokenState, last_token: Tensor, sampling: Any = None,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        right = torch.tensor([self.continuation(state, last_token, gamma)], device=self.device)  # [1, γ]
        probs = torch.full((1, gamma, self.vocab_size), 1e-9, device=self.device)
        probs.scatter_(2, ((right + 1) % self.vocab_size)[..., None], 0.6)
        probs.scatter_(2, right[..., None], 0.4)
        probs = probs / probs.sum(-1, keepdim=True)  # [1, γ, V]
        return Proposal((right + 1) % self.vocab_size, probs.log(), probs, None)


@dataclasses.dataclass
class KVTokenState(TokenState):
    """Committed ids plus this round's views of the target's K/V (``consume`` drops them)."""

    target_kv: TargetKV | None = None


class TargetKVReader(PromptLookupDrafter):
    """Prompt lookup (real drafts, some rejected: holes in a batch's cache) that declares
    ``Capability.TARGET_KV`` for the first and last layers of ``target`` and, at every
    ``propose``, checks what it was handed: views [1, h_kv, S, d] whose committed slots are as
    many as its committed tokens, in position order equal to ``target``'s own batch-1 forward
    over them (``errors``: the largest difference per propose). Checks only while it declares
    the capability (``test_engine_capabilities.without``). ``batched``: also declares
    ``BATCHED_PROPOSE`` (``propose`` per row). ``pad``: the lookup's draft padded to the γ asked
    for with its last token (never nothing: a token tree needs a draft); else ``quiet``: nothing
    where the context's length is a multiple of 3 (the batch engine defers such plain rounds'
    updates to the row's next drafting round)."""

    def __init__(self, target: Any, batched: bool = False, num_speculative_tokens: int = 4, pad: bool = False,
                 quiet: bool = False):
        super().__init__(target.vocab_size, num_speculative_tokens)
        self.target, self.batched, self.pad, self.quiet = target, batched, pad, quiet
        self.target_kv_layers = [0, target.num_layers - 1]
        self.layer_ids = (0,)  # a tap it ignores: the batch engine then defers its plain rounds' updates
        self.attached = 0  # with_target_kv calls
        self.checked: list[tuple[int, int]] = []  # per checked propose: (committed positions, holes in its view)
        self.errors: list[float] = []

    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.TARGET_KV} | ({Capability.BATCHED_PROPOSE} if self.batched else set()))

    def with_target_kv(self, state: TokenState, kv: TargetKV) -> KVTokenState:
        self.attached += 1
        return KVTokenState(state.length, state.tokens, kv)

    def propose(self, state: TokenState, last_token: Tensor, sampling: Any = None,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        if Capability.TARGET_KV in self.capabilities():
            self.check(state)
        if self.quiet and (state.length + 1) % 3 == 0:
            return one_hot_proposal([], self.vocab_size, self.device)
        prop = super().propose(state, last_token, sampling, generator, num_speculative_tokens)
        gamma = num_speculative_tokens or self.num_speculative_tokens
        if not self.pad or prop.tokens.shape[1] == gamma:
            return prop
        drafted = prop.tokens[0].tolist() or [int(last_token[0])]
        return one_hot_proposal((drafted + drafted[-1:] * gamma)[:gamma], self.vocab_size, self.device)

    def propose_many(self, states: list[TokenState], last_tokens: Tensor, sampling: Any,
                     num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        per_row, samplings, gens = row_settings(len(states), sampling, num_speculative_tokens, generators,
                                                self.num_speculative_tokens)
        return [self.propose(s, last_tokens[i:i + 1], samplings[i], gens[i], per_row[i]) for i, s in enumerate(states)]

    def check(self, state: TokenState) -> None:
        kv = state.target_kv if isinstance(state, KVTokenState) else None
        if kv is None:
            raise AssertionError("propose on a state without the target's K/V")
        assert kv.layers == self.target_kv_layers
        valid = kv.valid[0] if kv.valid is not None else torch.ones(kv.slots, dtype=torch.bool)  # [S]
        if int(valid.sum()) != state.length:
            raise AssertionError(f"the views hold {int(valid.sum())} committed slots, the drafter {state.length} tokens")
        own = self.target.forward(torch.tensor([state.tokens]), use_cache=True).cache
        err = 0.0
        for i, (k, v) in zip(kv.layers, kv.kv):
            assert k.shape[0] == v.shape[0] == 1 and k.shape[2] == valid.shape[0]  # [1, h_kv, S, d]
            err = max(err, float((k[:, :, valid] - own.layers[i].keys).abs().max()),
                      float((v[:, :, valid] - own.layers[i].values).abs().max()))
        self.errors.append(err)
        self.checked.append((state.length, int((~valid).sum())))


def counting_forwards(monkeypatch: Any, target: Any) -> list[int]:
    """The input width of every forward of ``target`` from now on (the forward itself unchanged)."""
    widths: list[int] = []
    forward = target.forward

    def counted(input_ids: Tensor, *args: Any, **kwargs: Any) -> Any:
        widths.append(input_ids.shape[1])
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(target, "forward", counted)
    return widths
