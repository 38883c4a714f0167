"""Hybrid drafting: per request and round, suffix decoding's draft when its score clears a
threshold, else the trained drafter's (the rule of Arctic Inference's vLLM plugin, which takes
the suffix tokens when their score is at least the model method's ``num_speculative_tokens``).

``HybridDrafter(trained, suffix, threshold)`` is one drafter behind the engine protocol
(``core.EngineDrafter``) over two: a trained drafter (``components.drafters``: it reads the
target's hidden states at its ``layer_ids``, which are the hybrid's) and a
``suffix.SuffixDrafter`` (committed ids only). Per round, on a committed state::

    choose  -- the suffix side's candidate (``SuffixDrafter.candidate``: at most the suffix
               drafter's own γ_s tokens, from the request's tree or the global one) and its
               score, Σ of its tokens' estimated probabilities (the acceptance length it
               expects); score ≥ ``threshold`` → the suffix draft (one-hot q), else the trained
               drafter's proposal. Threshold 0: the suffix whenever it has a match; ∞: never
               (the suffix drafter's own ``min_score`` is not used: the threshold replaces it).
    consume -- both sides take every committed token whichever drafted: the trained drafter
               the verified positions' target hidden states (its context is the target's, as
               if it had drafted every round), the suffix side the ids.

Which side drafted each round is counted in ``drafted_by``. The threshold is in the suffix
score's units; Arctic's is γ (the suffix must expect as many accepted tokens as the model
would draft), which ``eval.hybrid_suffix_threshold`` defaults to.

Stages. The engine asks each DLoop stage for at most γ drafts (the trained drafter's block). A
suffix round proposes its candidate's first tokens; with DLoop stages the next stages move
along the rest of the candidate (``consume_own`` of a suffix stage reads no states; its one-hot
q passes any gate ≤ 0), so a suffix round drafts up to min(γ_s, γ·stages), and without stages
at most γ. A model round's later stages are the trained drafter's own (``consume_own`` of its
``Proposal.states``). A round never switches sides between stages: the trained drafter has no
states of suffix tokens, and the suffix side does not see the model's drafts.

Carryover. After either kind of round the engine attaches the target's states of the first γ
rejected drafts (``chain.carry_over``) and the hybrid hands them to the trained drafter
(``with_carry``): the rows counted are the rows attached. After a suffix round they are the
target's states of rejected *suffix* drafts, at the positions the carryover objective trains
(a+m+1..) but of a continuation the drafter did not propose: a shift of input, not of layout.
The next round's first block reads them if the model drafts it; a suffix round ignores them,
and ``consume`` drops them either way.

The adaptive cap (``adaptive``). The batch engine picks a round's cap before drafting and asks
the stages for at most that many drafts in all, whoever drafts: suffix drafts are capped like
the model's, because the cap prices the verify pass's width and the round's time, which do not
depend on who drafted; a cap of 0 (a plain round) does not call the hybrid at all. Suffix
proposals carry no confidences (as ``SuffixDrafter``'s), so after a suffix round that row's next
cap reads the acceptance seen over all rows, both kinds of round mixed. A suffix round costs
less to draft than a model round (a lookup, no drafter pass); the hybrid's round profile
(``adaptive_engine``) times whatever mix its synthetic requests draw, and the policy prices the
(batch, cap) it has played at the round times it measured.

Token trees (``tree``, ddtree): a suffix round's one-hot marginals make its tree the suffix
chain itself; causal trees are refused (no tree head is declared).

Draft-then-decide (``PREVIEWS``). The batch engine asks ``preview`` before it picks a round's
cap: a suffix round's confidences are known from the lookup alone, so the cap is priced on this
round's own match; a model round's are not known before its pass, so the trained drafter's of
its latest round stand in (the engine's estimate otherwise).

Capabilities (``drafters.capabilities``): ``OWN_CONTEXT`` always (suffix rounds continue over
stages; a trained drafter that does not declare it gets no later stages: its proposals' states
are dropped, so the engine never asks it for ``consume_own``); ``CARRYOVER``,
``BATCHED_PROPOSE``, ``BATCHED_CONSUME``, ``TARGET_KV`` and ``RECYCLES`` when the trained
drafter declares them (a suffix round's proposal has no slot states, so nothing is recycled
after it); never a tree head or block internals (objectives and exporters work on the trained
drafter itself). The target's K/V views (``with_target_kv``, before each round) go to the
trained side's state, whoever then drafts: a suffix round does not read them, and ``consume``
drops them either way.

Batch 1 per state, as both sides. Knows both sides through the engine protocol and the suffix
drafter's ``candidate``/``observe``/``forget``; nothing about verification, caches, the cap's
policy or tokenization. Not thread-safe (the suffix side is not).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import DEFAULT_SAMPLING, Proposal, TargetKV, row_settings
from components.drafters.capabilities import Capability, has
from components.engine.suffix import (
    Candidate,
    SuffixDrafter,
    SuffixState,
    suffix_proposal,
)
from components.spec.sampling import SamplingParams

SUFFIX, MODEL = "suffix", "model"  # the sides, as ``drafted_by`` counts them
PASSED_ON = (Capability.CARRYOVER, Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.TARGET_KV,
             Capability.RECYCLES)


@dataclass
class HybridState:
    """One request's state on both sides (batch 1).

    A committed state (``stage`` False) has ``suffix_draft`` None until ``propose`` chooses the
    suffix side on it; it then holds that round's whole suffix candidate (the one field
    ``propose`` writes, read by ``consume_own``). A DLoop later stage's throw-away state
    (``stage`` True) drafts for the side its round began with: the rest of the suffix
    candidate when ``suffix_draft`` is set, else the trained drafter on its own states."""

    trained: Any  # the trained drafter's state: committed positions (+ carry rows, one round)
    suffix: SuffixState  # the committed ids
    suffix_draft: list[int] | None = None  # this round's suffix tokens from this state's proposal on
    suffix_conf: list[float] | None = None  # their confidences (``SuffixDrafter.confidences``)
    stage: bool = False  # a later DLoop stage's state (never committed)
    model_conf: Tensor | None = None  # [1, γ'] the trained drafter's latest confidences, for ``preview``


class HybridDrafter:
    """Suffix decoding's draft when its score ≥ ``threshold``, else ``trained``'s (module docstring)."""

    def __init__(self, trained: Any, suffix: SuffixDrafter, threshold: float):
        """``trained``: a drafter of the engine protocol (it reads target taps); ``suffix``: its
        own γ_s bounds a suffix round's draft; ``threshold`` ≥ 0 in score units (∞: never)."""
        if not threshold >= 0:  # also refuses NaN
            raise ValueError(f"threshold must be >= 0 (score units; inf: never the suffix), got {threshold}")
        self.trained, self.suffix, self.threshold = trained, suffix, float(threshold)
        self.drafted_by: Counter[str] = Counter()  # rounds drafted per side (SUFFIX, MODEL)

    @property
    def layer_ids(self) -> list[int]:
        return list(self.trained.layer_ids)

    @property
    def num_speculative_tokens(self) -> int:
        """γ per stage: the trained drafter's (the engine's settings and carry bound follow it)."""
        return int(self.trained.num_speculative_tokens)

    @property
    def carry_embed(self) -> Tensor:  # [n·H] (declared with CARRYOVER only)
        return self.trained.carry_embed

    @property
    def target_kv_layers(self) -> list[int]:  # (declared with TARGET_KV only)
        """The target layers whose K/V the trained drafter reads."""
        return list(self.trained.target_kv_layers)

    def capabilities(self) -> frozenset[Capability]:
        """OWN_CONTEXT, LEARNS_RESPONSES (the suffix side's), PREVIEWS and what of ``PASSED_ON``
        the trained drafter declares."""
        return frozenset({Capability.OWN_CONTEXT, Capability.LEARNS_RESPONSES, Capability.PREVIEWS} |
                         {c for c in PASSED_ON if has(self.trained, c)})

    def identity(self) -> str:
        """What round profiles of it are keyed by: both sides'."""
        return f"{type(self).__name__}:{self.trained.identity()}+{self.suffix.identity()}"

    # ------------------------------------------------------------------ committed context
    def init_state(self, batch_size: int) -> HybridState:
        return HybridState(self.trained.init_state(batch_size), self.suffix.init_state(batch_size))

    def consume(self, state: HybridState, tokens: Tensor, hidden: Tensor | None) -> HybridState:
        """Both sides after the committed ``tokens`` [1, T] (hidden [1, T, n, H] for the trained side)."""
        return HybridState(self.trained.consume(state.trained, tokens, hidden),
                           self.suffix.consume(state.suffix, tokens, None), model_conf=state.model_conf)

    def consume_many(self, states: list[HybridState], tokens: list[Tensor], hidden: list[Tensor]) -> list[HybridState]:
        """``consume`` per row, the trained side in one ``consume_many`` (declared by it)."""
        trained = self.trained.consume_many([s.trained for s in states], tokens, hidden)
        return [HybridState(t, self.suffix.consume(s.suffix, ids, None), model_conf=s.model_conf)
                for s, t, ids in zip(states, trained, tokens)]

    def rollback(self, state: HybridState, length: int) -> HybridState:
        return HybridState(self.trained.rollback(state.trained, length), self.suffix.rollback(state.suffix, length),
                           model_conf=state.model_conf)

    def with_carry(self, state: HybridState, hidden_rej: Tensor, start_position: int) -> HybridState:
        """Carryover rows (hidden_rej [1, k, n, H], k ≤ γ) for the trained side, whoever drafted."""
        return dataclasses.replace(state, trained=self.trained.with_carry(state.trained, hidden_rej, start_position))

    @property
    def recycle(self) -> Any:  # (declared with RECYCLES only)
        return self.trained.recycle

    def with_recycled(self, state: HybridState, proposal: Proposal, accepted: int, next_token: Tensor) -> HybridState:
        """The round's rejected drafts for the trained side (a suffix round's proposal has no slot
        states: nothing is recycled after it)."""
        return dataclasses.replace(state, trained=self.trained.with_recycled(state.trained, proposal, accepted,
                                                                             next_token))

    def with_target_kv(self, state: HybridState, kv: TargetKV) -> HybridState:
        """Views of the target's K/V over the committed context (``kv``) for the trained side,
        whoever drafts this round (the engine keeps the state returned as the committed one)."""
        return dataclasses.replace(state, trained=self.trained.with_target_kv(state.trained, kv))

    # ------------------------------------------------------------------ drafting
    def propose(self, state: HybridState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        """At most γ drafts after ``last_token`` [1]: the suffix side's or the trained drafter's."""
        gamma = num_speculative_tokens or self.num_speculative_tokens
        prop = self._suffix_stage(state, last_token, gamma)
        return prop if prop is not None else self._model_stage(state, self.trained.propose(
            state.trained, last_token, sampling, generator, num_speculative_tokens=gamma))

    def propose_many(self, states: list[HybridState], last_tokens: Tensor,  # last_tokens [R]
                     sampling: SamplingParams | list[SamplingParams], num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """``propose`` per row; the rows the model drafts in one ``propose_many`` of the trained
        drafter (declared by it), each with its own sampling, γ and generator."""
        per_row, samplings, gens = row_settings(len(states), sampling, num_speculative_tokens, generators,
                                                self.num_speculative_tokens)
        props = [self._suffix_stage(s, last_tokens[i:i + 1], per_row[i]) for i, s in enumerate(states)]
        rows = [i for i, p in enumerate(props) if p is None]
        if rows:
            drafted = self.trained.propose_many([states[i].trained for i in rows], last_tokens[rows],
                                                [samplings[i] for i in rows], [per_row[i] for i in rows],
                                                generators=[gens[i] for i in rows])
            for i, prop in zip(rows, drafted):
                props[i] = self._model_stage(states[i], prop)
        return props  # type: ignore[return-value]  # every row filled

    def consume_own(self, state: HybridState, states: Tensor) -> HybridState:
        """DLoop: the next stage's state. A suffix round's moves past the k tokens just drafted
        (states [1, k, 0] carry nothing else); a model round's is the trained drafter's own
        (states [1, k, H])."""
        if state.suffix_draft is not None:
            k = states.shape[1]
            return HybridState(state.trained, state.suffix, state.suffix_draft[k:], state.suffix_conf[k:], stage=True)
        return HybridState(self.trained.consume_own(state.trained, states), state.suffix, None, stage=True)

    def _suffix_stage(self, state: HybridState, last_token: Tensor, gamma: int) -> Proposal | None:
        """The suffix side's proposal of at most ``gamma`` tokens if this round is (or becomes,
        on a committed state) a suffix round; None: the model drafts."""
        if not state.stage:
            best = self.suffix.candidate(state.suffix, last_token, self.suffix.num_speculative_tokens)
            chosen = self._clears(best)
            state.suffix_draft = best.tokens if chosen else None
            state.suffix_conf = self.suffix.confidences(best) if chosen else None
            self.drafted_by[SUFFIX if chosen else MODEL] += 1
        if state.suffix_draft is None:
            return None
        tokens, rest = state.suffix_draft[:gamma], state.suffix_draft[gamma:]
        prop = suffix_proposal(tokens, state.suffix_conf[:gamma], self.suffix.vocab_size, self.suffix.device)
        prop.states = torch.zeros(1, len(tokens), 0, device=prop.tokens.device) if rest else None  # [1, k, 0]
        return prop

    def _model_stage(self, state: HybridState, prop: Proposal) -> Proposal:
        """The trained drafter's proposal, its states kept only where it drafts on them
        (OWN_CONTEXT); on a committed state its confidences are kept for ``preview``."""
        if prop.states is not None and not has(self.trained, Capability.OWN_CONTEXT):
            prop.states = None
        if not state.stage:
            state.model_conf = prop.confidences
        return prop

    def preview(self, state: HybridState, recent: Tensor) -> Tensor | None:  # recent [1, k+1] -> [1, g]
        """This round's confidences before drafting: the suffix candidate's when it will clear
        the threshold (a lookup over the ids of ``recent``, as ``SuffixDrafter.preview``), else
        the trained drafter's of its latest round (None before it has drafted)."""
        best = self.suffix.candidate(state.suffix, recent[0, -1:], self.suffix.num_speculative_tokens,
                                     recent[0, :-1].tolist())
        if self._clears(best):
            return torch.tensor([self.suffix.confidences(best)], dtype=torch.float32)
        return state.model_conf

    def _clears(self, best: Candidate) -> bool:
        """Whether the suffix side's candidate drafts this round: a match scoring ≥ the threshold."""
        return bool(best.tokens) and best.score >= self.threshold

    # ------------------------------------------------------------------ the suffix side's global tree
    def observe(self, response: Sequence[int], key: Hashable | None = None) -> None:
        """Teaches the suffix side's global tree a finished response (``SuffixDrafter.observe``)."""
        self.suffix.observe(response, key)

    def forget(self, key: Hashable) -> None:
        """Drops the response kept under ``key`` (``SuffixDrafter.forget``)."""
        self.suffix.forget(key)
