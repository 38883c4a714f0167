"""Chain verification rules: the verifier's side of one speculative-decoding round, batched.

Vocabulary (used everywhere in specline):

* **draft tokens** -- the drafter's proposal for one round, ``draft_tokens [B, γ]``, of which
  the first ``draft_lens[b]`` are real for request ``b`` (the rest is padding);
* **accepted tokens** -- the kept prefix of the draft, ``num_accepted[b]`` tokens;
* **recovered token** -- the target-side sample at the first rejection (residual sample);
* **bonus token** -- the target's sample after a fully accepted draft.

``output = accepted + [next_token]`` where ``next_token`` is the recovered or the bonus token,
so every round emits ``num_accepted + 1`` tokens.

Target distributions come as ``[B, γ+1, V]``: slot ``k`` is the target's distribution for draft
slot ``k`` (i.e. after the verified context plus ``k`` draft tokens); slot ``draft_lens[b]`` is
the bonus slot. Draft distributions ``q [B, γ, V]`` are the distributions the draft tokens were
actually sampled from. Rules:

* ``verify_greedy``       -- exact match against the target's argmax;
* ``verify_gumbel``       -- exact match against the target's Gumbel-max sample with shared noise;
* ``verify_speculative``  -- token-wise speculative sampling (Leviathan / Chen et al.);
* ``verify_block``        -- block verification (Sun et al. 2024), accepts jointly.

Randomness is drawn from an optional ``torch.Generator`` on the inputs' device as uniform
``coins [B, γ]`` and an exponential ``race [B, V]``; the ``*_core`` functions take these
explicitly so that the plain-Python references in ``reference.py`` can replay them exactly.
A categorical sample from unnormalised weights ``w`` is ``argmax(w / race)``, the exponential
race (the Gumbel-max trick without logs): no CPU sync, no normalisation, no loop over V.

What this module does not know: models, KV caches, temperatures (see ``sampling.py``) and
trees (see ``tree_verify.py``). Probabilities must already be processed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from components.spec.argmax import argmax_last

__all__ = [
    "VerifyResult",
    "block_survival",
    "block_weights",
    "draw_coins",
    "draw_race",
    "emitted_tokens",
    "match_prefix",
    "sample_from_weights",
    "verify_block",
    "verify_block_core",
    "verify_greedy",
    "verify_gumbel",
    "verify_speculative",
    "verify_speculative_core",
]

_TINY = 1e-30


@dataclass
class VerifyResult:
    """Outcome of verifying one round for a batch of B requests."""

    num_accepted: Tensor  # [B] long, accepted draft tokens per request (0..draft_len)
    next_token: Tensor    # [B] long, recovered token if a rejection happened, else bonus token
    accepted: Tensor      # [B, γ] bool, draft slot kept (a prefix; False past draft_len)


def emitted_tokens(result: VerifyResult, draft_tokens: Tensor) -> Tensor:
    """Tokens emitted this round [B, γ+1] long: accepted drafts, then next_token, then -1 padding.

    draft_tokens: [B, γ] long. Row b has ``num_accepted[b] + 1`` valid entries.
    """
    bsz, gamma = draft_tokens.shape
    out = torch.full((bsz, gamma + 1), -1, dtype=torch.long, device=draft_tokens.device)
    out[:, :gamma] = torch.where(result.accepted, draft_tokens, out[:, :gamma])
    return out.scatter(1, result.num_accepted[:, None], result.next_token[:, None])


def draw_coins(shape: tuple[int, ...], device: torch.device,
               generator: torch.Generator | None = None) -> Tensor:
    """Uniform [0, 1) coins of the given shape (float32)."""
    return torch.rand(shape, device=device, generator=generator)


def draw_race(shape: tuple[int, ...], device: torch.device,
              generator: torch.Generator | None = None) -> Tensor:
    """Exponential(1) race times of the given shape (float32), clamped away from 0."""
    race = torch.empty(shape, device=device).exponential_(generator=generator)
    return race.clamp_min(torch.finfo(race.dtype).tiny)


def sample_from_weights(weights: Tensor, race: Tensor) -> Tensor:
    """Categorical sample [...] long from non-negative unnormalised weights [..., V].

    race: [..., V] Exponential(1). argmax(w / E) picks i with probability w_i / sum(w).
    """
    return (weights / race).argmax(dim=-1)


def _valid_slots(draft_lens: Tensor, gamma: int) -> Tensor:
    """[B, γ] bool: slot k < draft_lens[b]."""
    return torch.arange(gamma, device=draft_lens.device)[None, :] < draft_lens[:, None]


def _leading_true(mask: Tensor) -> Tensor:
    """Length [B] long of the all-True prefix of mask [B, γ]."""
    return mask.long().cumprod(dim=-1).sum(dim=-1)


def match_prefix(
    draft_tokens: Tensor,   # [B, γ] long
    draft_lens: Tensor,     # [B] long
    target_tokens: Tensor,  # [B, γ+1] long, the target's own choice at each slot
) -> VerifyResult:
    """Exact-matching verification: keep drafts while they equal the target's choice."""
    gamma = draft_tokens.shape[1]
    if gamma == 0:  # plain rows only (a round without drafts): the target's choice at slot 0
        none = target_tokens.new_zeros(target_tokens.shape[0])
        return VerifyResult(num_accepted=none, next_token=target_tokens[:, 0], accepted=draft_tokens.bool())
    if draft_tokens.device.type == "cpu" and target_tokens.device.type == "cpu":
        return _match_prefix_numpy(draft_tokens, draft_lens, target_tokens)
    return _match_prefix_torch(draft_tokens, draft_lens, target_tokens)


def _match_prefix_torch(draft_tokens: Tensor, draft_lens: Tensor, target_tokens: Tensor) -> VerifyResult:
    """``match_prefix`` in torch ops, on any device (no host sync)."""
    gamma = draft_tokens.shape[1]
    match = (draft_tokens == target_tokens[:, :gamma]) & _valid_slots(draft_lens, gamma)
    n = _leading_true(match)
    keep = torch.arange(gamma, device=n.device)[None, :] < n[:, None]
    next_token = target_tokens.gather(1, n[:, None]).squeeze(1)
    return VerifyResult(num_accepted=n, next_token=next_token, accepted=keep)


def _match_prefix_numpy(draft_tokens: Tensor, draft_lens: Tensor, target_tokens: Tensor) -> VerifyResult:
    """``match_prefix`` on CPU tensors through numpy: the same result, in a few microseconds where
    torch's small ops cost tens each (a round of decoding pays it once)."""
    drafts, lens, chosen = draft_tokens.numpy(), draft_lens.numpy(), target_tokens.numpy()
    gamma = drafts.shape[1]
    slots = np.arange(gamma)
    match = (drafts == chosen[:, :gamma]) & (slots[None, :] < lens[:, None])
    n = np.where(match.all(axis=1), gamma, np.argmin(match, axis=1)).astype(np.int64)  # the all-True prefix
    keep = slots[None, :] < n[:, None]
    next_token = chosen[np.arange(chosen.shape[0]), n]
    return VerifyResult(num_accepted=torch.from_numpy(n), next_token=torch.from_numpy(next_token),
                        accepted=torch.from_numpy(keep))


def verify_greedy(
    draft_tokens: Tensor,  # [B, γ] long
    draft_lens: Tensor,    # [B] long
    target: Tensor,        # [B, γ+1, V] target logits, log-probs or probs
) -> VerifyResult:
    """Greedy verification: the output equals the target's own greedy decoding."""
    return match_prefix(draft_tokens, draft_lens, argmax_last(target))


def verify_gumbel(
    draft_tokens: Tensor,      # [B, γ] long, drafted as argmax(log q + noise[:, :γ])
    draft_lens: Tensor,        # [B] long
    target_log_probs: Tensor,  # [B, γ+1, V] processed target log-probs (or logits)
    noise: Tensor,             # [B, γ+1, V] Gumbel noise shared with the drafter
) -> VerifyResult:
    """Gumbel coupling: output = the target's own Gumbel-max samples under this noise.

    Lossless and drafter-invariant: the result depends only on the target and the noise.
    """
    return match_prefix(draft_tokens, draft_lens, argmax_last(target_log_probs + noise))


def _gather_token_probs(probs: Tensor, tokens: Tensor) -> Tensor:
    """probs [B, γ', V] at tokens [B, γ] (γ ≤ γ') -> [B, γ]."""
    return probs[:, : tokens.shape[1]].gather(-1, tokens[..., None]).squeeze(-1)


def _slot_rows(probs: Tensor, slot: Tensor) -> Tensor:
    """Row probs[b, slot[b]] for probs [B, S, V], slot [B] -> [B, V]."""
    return probs[torch.arange(probs.shape[0], device=probs.device), slot]


def _draft_row(draft_probs: Tensor, slot: Tensor, draft_lens: Tensor) -> Tensor:
    """q at slot [B] as [B, V], or zeros where slot == draft_len (the bonus slot: q ≡ 0)."""
    bsz, gamma, vocab = draft_probs.shape
    if gamma == 0:
        return draft_probs.new_zeros(bsz, vocab)
    row = _slot_rows(draft_probs, slot.clamp_max(gamma - 1))
    return row * (slot < draft_lens).to(row.dtype)[:, None]


def _residual_sample(target_row: Tensor, residual: Tensor, race: Tensor) -> Tensor:
    """Sample [B] from residual [B, V]; fall back to target_row [B, V] where it has no mass."""
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return sample_from_weights(torch.where(empty, target_row, residual), race)


def verify_speculative_core(
    draft_tokens: Tensor,  # [B, γ] long
    draft_lens: Tensor,    # [B] long
    target_probs: Tensor,  # [B, γ+1, V] processed target probabilities
    draft_probs: Tensor,   # [B, γ, V] distributions the drafts were sampled from
    coins: Tensor,         # [B, γ] uniform [0, 1)
    race: Tensor,          # [B, V] Exponential(1)
) -> VerifyResult:
    """Token-wise speculative sampling with explicit randomness (see verify_speculative)."""
    gamma = draft_tokens.shape[1]
    p_x = _gather_token_probs(target_probs, draft_tokens)
    q_x = _gather_token_probs(draft_probs, draft_tokens)
    # accept iff coin < p/q, written without a division (q_x = 0 accepts iff p_x > 0)
    ok = (coins * q_x < p_x) & _valid_slots(draft_lens, gamma)
    n = _leading_true(ok)
    keep = torch.arange(gamma, device=n.device)[None, :] < n[:, None]
    p_n = _slot_rows(target_probs, n)
    residual = (p_n - _draft_row(draft_probs, n, draft_lens)).clamp_min(0)
    return VerifyResult(n, _residual_sample(p_n, residual, race), keep)


def verify_speculative(
    draft_tokens: Tensor,  # [B, γ] long
    draft_lens: Tensor,    # [B] long
    target_probs: Tensor,  # [B, γ+1, V] processed target probabilities
    draft_probs: Tensor,   # [B, γ, V] distributions the drafts were sampled from
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Speculative sampling: accept x w.p. min(1, p(x)/q(x)) left to right; at the first
    rejection sample the recovered token from normalised (p - q)+; after a full accept sample
    the bonus token from p. Lossless: emitted tokens follow p."""
    bsz, gamma = draft_tokens.shape
    dev = target_probs.device
    coins = draw_coins((bsz, gamma), dev, generator)
    race = draw_race((bsz, target_probs.shape[-1]), dev, generator)
    return verify_speculative_core(draft_tokens, draft_lens, target_probs, draft_probs, coins, race)


def block_weights(
    p_x: Tensor,    # [B, γ] target probability of each draft token
    q_x: Tensor,    # [B, γ] drafter probability of each draft token
    valid: Tensor,  # [B, γ] bool, real draft slots
) -> Tensor:
    """Running weights w [B, γ+1] (float64), w_0 = 1, w_k = min(1, w_{k-1} p_k(x_k)/q_k(x_k)).

    Vectorised: with S_k = sum_{i≤k} log r_i (S_0 = 0), log w_k = S_k - max_{j≤k} S_j.
    """
    log_r = p_x.double().log() - q_x.double().clamp_min(_TINY).log()
    log_r = torch.where(valid, log_r, torch.zeros_like(log_r))
    s = torch.cat([log_r.new_zeros(log_r.shape[0], 1), log_r.cumsum(dim=-1)], dim=-1)
    return (s - s.cummax(dim=-1).values).exp()


def block_survival(
    w: Tensor,             # [B, γ+1] running weights (float64)
    draft_lens: Tensor,    # [B] long
    target_probs: Tensor,  # [B, γ+1, V]
    draft_probs: Tensor,   # [B, γ, V]
) -> Tensor:
    """Survival probabilities h [B, γ+1] of each prefix length k = 0..γ (h_0 unused).

    h_k = m_k / (m_k + 1 - w_k) with residual mass m_k = sum_x (w_k p_{k+1}(x) - q_{k+1}(x))+,
    and q ≡ 0 after the draft (so h_{draft_len} = w_{draft_len}); h_k = 1 where w_k = 1.
    """
    gamma = draft_probs.shape[1]
    wk = w[:, :gamma, None].to(target_probs.dtype)
    mass = (wk * target_probs[:, :gamma]).sub_(draft_probs).clamp_min_(0).sum(dim=-1).double()
    mass = torch.cat([mass, w[:, gamma:]], dim=-1)  # slot γ: q ≡ 0 -> mass = w_γ
    at_end = torch.arange(gamma + 1, device=w.device)[None, :] == draft_lens[:, None]
    mass = torch.where(at_end, w, mass)
    h = mass / (mass + 1.0 - w).clamp_min(_TINY)
    return torch.where(w >= 1.0, torch.ones_like(h), h)


def verify_block_core(
    draft_tokens: Tensor,  # [B, γ] long
    draft_lens: Tensor,    # [B] long
    target_probs: Tensor,  # [B, γ+1, V] processed target probabilities
    draft_probs: Tensor,   # [B, γ, V] distributions the drafts were sampled from
    coins: Tensor,         # [B, γ] uniform [0, 1); coin k-1 tests prefix length k
    race: Tensor,          # [B, V] Exponential(1)
) -> VerifyResult:
    """Block verification with explicit randomness (see verify_block)."""
    gamma = draft_tokens.shape[1]
    valid = _valid_slots(draft_lens, gamma)
    p_x = _gather_token_probs(target_probs, draft_tokens)
    q_x = _gather_token_probs(draft_probs, draft_tokens)
    w = block_weights(p_x, q_x, valid)
    h = block_survival(w, draft_lens, target_probs, draft_probs)
    survived = (coins.double() < h[:, 1:]) & valid
    lengths = torch.arange(1, gamma + 1, device=w.device)[None, :]
    n = (survived.long() * lengths).amax(dim=-1) if gamma > 0 else draft_lens.new_zeros(w.shape[0])
    keep = lengths - 1 < n[:, None]
    p_n = _slot_rows(target_probs, n)
    w_n = w.gather(1, n[:, None]).to(p_n.dtype)
    residual = (w_n * p_n - _draft_row(draft_probs, n, draft_lens)).clamp_min(0)
    return VerifyResult(n, _residual_sample(p_n, residual, race), keep)


def verify_block(
    draft_tokens: Tensor,  # [B, γ] long
    draft_lens: Tensor,    # [B] long
    target_probs: Tensor,  # [B, γ+1, V] processed target probabilities
    draft_probs: Tensor,   # [B, γ, V] distributions the drafts were sampled from
    generator: torch.Generator | None = None,
) -> VerifyResult:
    """Block verification (Sun et al., 2024): keep the longest prefix whose survival coin
    succeeds, then sample from the normalised residual (w_n p_{n+1} - q_{n+1})+.

    Lossless, and for a given draft it maximises the expected number of accepted tokens among
    lossless rules, so it never accepts fewer on average than ``verify_speculative``.
    """
    bsz, gamma = draft_tokens.shape
    dev = target_probs.device
    coins = draw_coins((bsz, gamma), dev, generator)
    race = draw_race((bsz, target_probs.shape[-1]), dev, generator)
    return verify_block_core(draft_tokens, draft_lens, target_probs, draft_probs, coins, race)
