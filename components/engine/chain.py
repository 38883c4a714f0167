"""The chain round's steps, as functions over one ``EngineSettings``: the batch-1 engine
(``single.py``) runs them for one request, the batch engine (``batch/``) for each of its rows.

gpt-fast style verbs, one step each::

    prefill  -- one target forward over the prompt (taps at drafter.layer_ids, KV cache kept);
                its last logits give the first new token; the drafter consumes every prompt
                position (their target hidden states exist);
    draft    -- drafter.propose after the last token (the drafter state is not changed, but
                that a ``Capability.TARGET_KV`` drafter's is first handed views of the target
                cache, ``core.attach_target_kv``); with DLoop, further blocks on the drafter's
                own states behind the log-probability gate (``draft_chain``); the drafter may
                propose fewer than asked, or nothing;
    verify   -- one target forward over [last_token, drafts] continuing the cache; the rule
                decides the accepted tokens and the next (recovered or bonus) token. With no
                drafts the round is a plain step: the forward is over [last_token] and the next
                token is the rule's own target sample (``Rule.sample_target``), as a plain round
                of the batch engine draws it;
    accept   -- crop the target cache to the committed length and feed the verified positions'
                hidden states, already computed by ``verify``, to the drafter. Accepted tokens
                are never recomputed;
    commit   -- carry the rejected drafts' states over (``carry_over``), append the emitted
                tokens, count the round (``commit_round``; the batch engine calls it per row):
                a round of 0 drafts counts as a plain round (``GenerationResult.add_round``).

``chain_round`` is the four in a row for one request (the batch-1 engine's round); the batch
engine calls ``draft_chain`` and ``commit_round`` per row around one verify pass of its own.

Carryover bookkeeping, for a round anchored at a = n-1 (x_{n-1} at position a) that drafts
d_1..d_G and accepts m < G: verify's input [x_{n-1}, d_1..d_G] sits at positions a..a+G, so
d_{m+1}.. are verify-hidden rows m+1.. at positions a+m+1..; after consuming x_{n-1}, d_1..d_m
the drafter holds a+m+1 positions and the next block is anchored at a+m+1 (the recovered
token). The first min(G-m, γ) rejected rows are attached at positions a+m+1.. -- the layout
the carryover objective trains (rows at a+m+1..a+γ, re-draft anchored at a+m+1). A full accept
attaches none. DLoop's later stages drop them (see ``DFlashDrafter.consume_own``): carryover
rows are read by the next round's first block only, at most γ of them (one block).

Knows the drafter protocol (``core.EngineDrafter``), the rules' interface and the settings;
of the target cache only how to crop it and hand views of it to a drafter that reads it;
nothing about batching, trees, tokenization or drafter families.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor

from components.drafters.base import Proposal
from components.drafters.capabilities import Capability, has
from components.engine.cache.slab import preallocate
from components.engine.core import (
    EngineDrafter,
    GenerationResult,
    SequenceState,
    attach_target_kv,
    crop_cache,
    positions,
    sync_device,
)
from components.engine.rules import RoundRandomness, Rule
from components.engine.settings import EngineSettings
from components.spec.verify import VerifyResult


def num_drafts_for(cap: int, remaining: int) -> int:
    """What a drafting round asks the drafter for under ``cap``: at least one draft, none past
    the request's last token (a round emits up to num_drafts + 1 tokens). The drafter may
    propose fewer, or none (then the round is a plain step)."""
    return max(1, min(cap, remaining - 1))


def prefill(target: Any, drafter: EngineDrafter, settings: EngineSettings, rule: Rule, prompt: Tensor,
            rnd: RoundRandomness) -> SequenceState:
    """prompt [1, P] → the sequence after the first new token (sampled from the prefill)."""
    out = target.forward(prompt, layer_ids=list(drafter.layer_ids), use_cache=True, last_logits=True)
    p = prompt.shape[1]
    first = rule.sample_target(out.logits[:, -1:], positions(p, 1, prompt.device), rnd)[:, 0]
    state = drafter.consume(drafter.init_state(1), prompt, out.hidden)
    cache = preallocate(out.cache) if settings.preallocate else out.cache
    return SequenceState(cache, state, first, p + 1, [int(first)])


def chain_round(target: Any, drafter: EngineDrafter, settings: EngineSettings, rule: Rule, seq: SequenceState,
                remaining: int, rnd: RoundRandomness, res: GenerationResult) -> SequenceState:
    """One draft-verify-accept round of one request, timed into ``res`` (the batch-1 engine's)."""
    dev = seq.last_token.device
    t0 = time.perf_counter()
    prop, drafts = draft_chain(drafter, settings, rule, seq, num_drafts_for(settings.max_cap, remaining), rnd)
    sync_device(dev)
    t1 = time.perf_counter()
    result, hidden, cache = verify_chain(target, drafter, rule, seq, prop, drafts, rnd)
    seq = accept_chain(drafter, settings, seq, drafts, result, hidden, cache, res, prop)
    sync_device(dev)
    res.draft_seconds += t1 - t0
    res.verify_seconds += time.perf_counter() - t1
    return seq


def draft_chain(drafter: EngineDrafter, settings: EngineSettings, rule: Rule, seq: SequenceState, num_drafts: int,
                rnd: RoundRandomness, cache: Any = None, row: int | None = None) -> tuple[Proposal, Tensor]:
    """Proposal and the draft tokens [1, G] to verify (predicting positions n..), G ≤ num_drafts.

    A drafter declaring ``Capability.TARGET_KV`` is first handed views of the target cache
    (``seq.cache``, or a batch's ``cache`` and the sequence's ``row`` in it), and that state
    becomes ``seq.draft_state`` (``core.attach_target_kv``; the next ``consume`` drops them).
    With DLoop, the drafts may span several blocks of at most γ; later blocks run on a
    throw-away drafter state extended with the earlier blocks' own states, so
    ``seq.draft_state`` changes no further. Fewer than ``num_drafts`` when the gate closes or the
    drafter proposes fewer than asked; a block of none ends the drafting (G = 0 when the
    first block is empty: the round is a plain step)."""
    seq.draft_state = attach_target_kv(drafter, seq.draft_state, seq.cache if cache is None else cache, row)
    state, last, start = seq.draft_state, seq.last_token, seq.length
    props, drafts = [], []
    while True:
        g = min(settings.num_speculative_tokens, num_drafts - sum(d.shape[1] for d in drafts))
        prop = drafter.propose(state, last, rule.draft_sampling(rnd), rnd.generator, num_speculative_tokens=g)
        got = prop.tokens.shape[1]  # ≤ g; 0: the drafter has nothing to propose
        if got == 0 and props:
            break
        picked = rule.pick_drafts(prop, positions(start, got, last.device), rnd)
        props.append(prop)
        drafts.append(picked)
        start += got
        if not _loop_again(settings, len(props), start - seq.length, num_drafts, prop, picked):
            break
        state = drafter.consume_own(state, prop.states)
        last = picked[:, -1]
    return Proposal.concat(props), torch.cat(drafts, dim=1)


def _loop_again(settings: EngineSettings, stages: int, drafted: int, num_drafts: int, prop: Proposal,
                picked: Tensor) -> bool:
    """DLoop's gate: another stage if allowed, room is left, the stage drafted something, and
    Σ log q(drafts) ≥ gate."""
    if stages >= settings.loop_stages or drafted >= num_drafts or prop.states is None or picked.shape[1] == 0:
        return False
    return float(prop.log_q(picked).sum()) >= settings.loop_gate


def verify_chain(target: Any, drafter: EngineDrafter, rule: Rule, seq: SequenceState, prop: Proposal | None, drafts: Tensor,
                 rnd: RoundRandomness) -> tuple[VerifyResult, Tensor | None, Any]:
    """One target forward over [x_{n-1}, drafts] [1, G+1] → (result, hidden [1, G+1, n, H], cache).

    G = 0: a plain step, the next token the rule's own target sample at position n (what
    ``target_only_generate`` and the batch engine's plain rows draw; greedy: the argmax,
    Gumbel: the same position-keyed noise), 0 drafts accepted; ``prop`` is not read then."""
    ids = torch.cat([seq.last_token[:, None], drafts], dim=1)
    out = target.forward(ids, layer_ids=list(drafter.layer_ids), cache=seq.cache, use_cache=True)
    where = positions(seq.length, ids.shape[1], ids.device)  # [1, G+1]
    if drafts.shape[1] == 0:
        token = rule.sample_target(out.logits[:, :1], where, rnd)[:, 0]  # [1]
        return VerifyResult(torch.zeros_like(token), token, drafts.bool()), out.hidden, out.cache
    return rule.verify(drafts, out.logits, prop, where, rnd), out.hidden, out.cache


def accept_chain(drafter: EngineDrafter, settings: EngineSettings, seq: SequenceState, drafts: Tensor,
                 result: VerifyResult, hidden: Tensor | None, cache: Any, res: GenerationResult,
                 proposal: Proposal | None = None) -> SequenceState:
    """drafts [1, G], hidden [1, G+1, n, H]: commits x_{n-1} + the accepted drafts (crops the
    cache, feeds their hidden states to the drafter, ``commit_round``); G = 0: x_{n-1} alone,
    a plain round. ``proposal``: the round's (for a drafter that recycles rejected drafts)."""
    a = int(result.num_accepted[0])
    crop_cache(cache, seq.length + a)  # positions now in the cache: x_0 .. x_{n-1+a}
    tokens = torch.cat([seq.last_token[:, None], drafts[:, :a]], dim=1)  # [1, a+1]
    kept = hidden[:, : a + 1] if hidden is not None else None
    state = drafter.consume(seq.draft_state, tokens, kept)  # drops any earlier carry
    seq, _ = commit_round(drafter, settings, seq, state, drafts, a, result.next_token, hidden, res, cache, proposal)
    return seq


def carry_over(drafter: EngineDrafter, settings: EngineSettings, state: Any, hidden: Tensor | None, num_drafts: int,
               accepted: int, committed: int) -> tuple[Any, int]:
    """(drafter state, rows carried): with carryover, the target's states of the first γ
    rejected drafts (hidden [1, ≥num_drafts+1, n, H]; rows accepted+1..num_drafts) attached at
    positions ``committed``.. (module docstring)."""
    if not settings.carryover or hidden is None or num_drafts == 0:
        return state, 0
    rejected = hidden[:, accepted + 1:1 + num_drafts][:, :settings.num_speculative_tokens]  # [1, carried, n, H]
    if rejected.shape[1] == 0:
        return state, 0
    return drafter.with_carry(state, rejected, committed), rejected.shape[1]


def commit_round(drafter: EngineDrafter, settings: EngineSettings, seq: SequenceState, state: Any,
                 drafts: Tensor | None, accepted: int, next_token: Tensor, hidden: Tensor | None,
                 res: GenerationResult, cache: Any = None,
                 proposal: Proposal | None = None) -> tuple[SequenceState, list[int]]:
    """The sequence after a round that accepted ``accepted`` of ``drafts`` [1, G] (None or G = 0:
    a plain round, which carries nothing over) and chose ``next_token`` [1]; ``state``: the
    drafter state after consuming them (None: plain decoding). Attaches carryover rows and, for a
    drafter declaring ``Capability.RECYCLES`` (ReTrace), the round's rejected drafts
    (``proposal``'s, read by the next block only); counts the round in ``res``; returns the new
    sequence and the tokens emitted."""
    if drafts is not None and drafts.shape[1] == 0:
        drafts = None
    num_drafts = 0 if drafts is None else drafts.shape[1]
    carried = 0
    if state is not None:
        state, carried = carry_over(drafter, settings, state, hidden, num_drafts, accepted, seq.length + accepted)
        if drafts is not None and proposal is not None and has(drafter, Capability.RECYCLES):
            # a rule may pick other tokens than drawn
            verified = Proposal(drafts, proposal.logits, proposal.probs, proposal.confidences, proposal.states)
            state = drafter.with_recycled(state, verified, accepted, next_token)
    emitted = ([] if drafts is None else drafts[0, :accepted].tolist()) + [int(next_token[0])]
    res.add_round(accepted if drafts is not None else None, num_drafts, seq.carry_rows)
    new = SequenceState(cache, state, next_token, seq.length + accepted + 1, seq.new_tokens + emitted, carried)
    return new, emitted
