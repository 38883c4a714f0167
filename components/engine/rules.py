"""Acceptance rules as the engine sees them: how the target samples, how drafts are picked, how
a round is verified. One small strategy object per rule, looked up by name in ``RULES``.

Positions: ``positions [B, L]`` are the absolute indices (prompt included, 0-based) of the tokens
being predicted; Gumbel coupling keys its shared noise on them, so the noise of a token does not
depend on how the sequence was cut into rounds.

* ``greedy``      -- target argmax; drafts proposed greedily; exact matching (``verify_greedy``);
* ``gumbel``      -- target Gumbel-max sample under position-keyed noise; drafts re-picked as the
  Gumbel-max of the drafter's processed logits under the *same* noise; exact matching
  (``verify_gumbel``). The output is a function of (target, seed) only;
* ``speculative`` -- target samples from its processed distribution; drafts sampled by the
  drafter; token-wise speculative sampling (``verify_speculative``);
* ``block``       -- as ``speculative`` with block verification (``verify_block``); chains only.

Each rule declares where it may be used (``samples``, ``trees``, ``coupled``: the table
``components.ruleset.RULE_USES`` says the same for the config, a test holds them equal) and
verifies a token tree itself (``verify_tree``) when it can.

Gumbel caveat: the drafter protocol has no noise argument, so an autoregressive drafter's slot k
logits were conditioned on its *own* slot k-1 choice, which may differ from the re-picked token.
That only lowers acceptance; the output is unchanged (exact matching against the target).

This module knows nothing about models, caches or drafters' internals: logits and proposals in,
tokens and ``VerifyResult``/``TreeVerifyResult`` out. It never loops over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from components.drafters.base import Proposal
from components.spec.argmax import argmax_last
from components.spec.gumbel import gumbel_argmax, gumbel_noise
from components.spec.sampling import (
    GREEDY,
    SamplingParams,
    log_probs_from_logits,
    probs_from_logits,
)
from components.spec.tree_verify import (
    TreeVerifyResult,
    tree_noise_positions,
    verify_tree_greedy,
    verify_tree_gumbel,
    verify_tree_sampling,
)
from components.spec.verify import (
    VerifyResult,
    verify_block,
    verify_greedy,
    verify_gumbel,
    verify_speculative,
)


@dataclass
class RoundRandomness:
    """Everything random in one generation: the sampling settings and the sources of noise."""

    sampling: SamplingParams
    generator: torch.Generator  # coins / races / multinomial draws (speculative, block)
    seeds: Tensor  # [B] long, Gumbel-coupling seeds (one per request)


class Rule:
    """Base strategy: sampled target, drafter's own drafts (subclasses override what differs)."""

    name = ""
    verifies_rows = False  # True: ``verify_rows`` takes many requests at once
    samples = True  # draws from the target's distribution (temperature > 0)
    trees = False  # True: ``verify_tree`` verifies a token tree
    coupled = False  # True: the output is f(target, seed) whatever the drafts (a lone batch row may verify a tree)

    def draft_sampling(self, rnd: RoundRandomness) -> SamplingParams:
        """The settings the drafter proposes with."""
        return rnd.sampling

    def sample_target(self, logits: Tensor, positions: Tensor, rnd: RoundRandomness) -> Tensor:
        """The target's own choice [B, L] long from logits [B, L, V] at positions [B, L]."""
        probs = probs_from_logits(logits, rnd.sampling)
        flat = probs.reshape(-1, probs.shape[-1])
        return torch.multinomial(flat, 1, generator=rnd.generator).view(probs.shape[:-1])

    def pick_drafts(self, proposal: Proposal, positions: Tensor, rnd: RoundRandomness) -> Tensor:
        """Draft tokens [B, γ] to verify, predicting positions [B, γ]."""
        return proposal.tokens

    def verify(self, drafts: Tensor, logits: Tensor, proposal: Proposal, positions: Tensor,
               rnd: RoundRandomness) -> VerifyResult:
        """drafts [B, γ], target logits [B, γ+1, V] at positions [B, γ+1] → VerifyResult."""
        raise NotImplementedError

    def verify_rows(self, drafts: Tensor, draft_lens: Tensor, logits: Tensor) -> VerifyResult:
        """Many requests' rows in one call (rules with ``verifies_rows``: no per-request
        randomness): drafts [R, G] (row r's first draft_lens[r] real; 0 = a plain round),
        logits [R, G+1, V] → VerifyResult, the next token being the target's own choice after
        the accepted prefix. Other rules verify each request alone (``verify``, ``sample_target``)."""
        raise NotImplementedError(f"rule '{self.name}' verifies one request at a time")

    def verify_tree(self, tokens: Tensor, parents: Tensor, depths: Tensor, logits: Tensor, length: int,
                    rnd: RoundRandomness) -> TreeVerifyResult:
        """One request's tree (rules with ``trees``): tokens, parents, depths [1, N] (depth 1 = a
        child of x_{n-1}), target logits per slot [1, N+1, V], ``length`` = n committed tokens
        → the accepted path and the next token (``spec.tree_verify``)."""
        raise NotImplementedError(f"rule '{self.name}' verifies chains only")


class GreedyRule(Rule):
    name = "greedy"
    verifies_rows = True
    samples = False
    trees = coupled = True

    def draft_sampling(self, rnd: RoundRandomness) -> SamplingParams:
        return GREEDY

    def sample_target(self, logits: Tensor, positions: Tensor, rnd: RoundRandomness) -> Tensor:
        return argmax_last(logits)

    def verify(self, drafts: Tensor, logits: Tensor, proposal: Proposal, positions: Tensor,
               rnd: RoundRandomness) -> VerifyResult:
        return verify_greedy(drafts, _full_lens(drafts), logits)

    def verify_rows(self, drafts: Tensor, draft_lens: Tensor, logits: Tensor) -> VerifyResult:
        return verify_greedy(drafts, draft_lens, logits)

    def verify_tree(self, tokens: Tensor, parents: Tensor, depths: Tensor, logits: Tensor, length: int,
                    rnd: RoundRandomness) -> TreeVerifyResult:
        return verify_tree_greedy(tokens, parents, logits)


class GumbelRule(Rule):
    name = "gumbel"
    trees = coupled = True

    @staticmethod
    def noise(positions: Tensor, vocab_size: int, rnd: RoundRandomness) -> Tensor:  # [B, L, V]
        return gumbel_noise(rnd.seeds.to(positions.device), positions, vocab_size)

    def sample_target(self, logits: Tensor, positions: Tensor, rnd: RoundRandomness) -> Tensor:
        noise = self.noise(positions, logits.shape[-1], rnd)
        return gumbel_argmax(log_probs_from_logits(logits, rnd.sampling), noise)

    def pick_drafts(self, proposal: Proposal, positions: Tensor, rnd: RoundRandomness) -> Tensor:
        noise = self.noise(positions, proposal.logits.shape[-1], rnd)
        return gumbel_argmax(log_probs_from_logits(proposal.logits, self.draft_sampling(rnd)), noise)

    def verify(self, drafts: Tensor, logits: Tensor, proposal: Proposal, positions: Tensor,
               rnd: RoundRandomness) -> VerifyResult:
        noise = self.noise(positions, logits.shape[-1], rnd)
        return verify_gumbel(drafts, _full_lens(drafts), log_probs_from_logits(logits, rnd.sampling), noise)

    def verify_tree(self, tokens: Tensor, parents: Tensor, depths: Tensor, logits: Tensor, length: int,
                    rnd: RoundRandomness) -> TreeVerifyResult:
        positions = tree_noise_positions(torch.tensor([length], device=logits.device), depths)
        noise = self.noise(positions, logits.shape[-1], rnd)
        return verify_tree_gumbel(tokens, parents, log_probs_from_logits(logits, rnd.sampling), noise)


class SpeculativeRule(Rule):
    name = "speculative"
    trees = True

    def verify(self, drafts: Tensor, logits: Tensor, proposal: Proposal, positions: Tensor,
               rnd: RoundRandomness) -> VerifyResult:
        p = probs_from_logits(logits, rnd.sampling)
        return verify_speculative(drafts, _full_lens(drafts), p, proposal.probs.to(p.dtype), rnd.generator)

    def verify_tree(self, tokens: Tensor, parents: Tensor, depths: Tensor, logits: Tensor, length: int,
                    rnd: RoundRandomness) -> TreeVerifyResult:
        """A deterministic tree: the target-sample walk (lossless; its output depends on the tree)."""
        return verify_tree_sampling(tokens, parents, probs_from_logits(logits, rnd.sampling), None,
                                    generator=rnd.generator)


class BlockRule(Rule):
    name = "block"

    def verify(self, drafts: Tensor, logits: Tensor, proposal: Proposal, positions: Tensor,
               rnd: RoundRandomness) -> VerifyResult:
        p = probs_from_logits(logits, rnd.sampling)
        return verify_block(drafts, _full_lens(drafts), p, proposal.probs.to(p.dtype), rnd.generator)


RULES: dict[str, Rule] = {r.name: r for r in (GreedyRule(), GumbelRule(), SpeculativeRule(), BlockRule())}


def get_rule(name: str) -> Rule:
    if name not in RULES:
        raise ValueError(f"engine rule '{name}' is not one of {sorted(RULES)}")
    return RULES[name]


def _full_lens(drafts: Tensor) -> Tensor:  # drafts [B, γ] → [B] long, every slot real
    return torch.full((drafts.shape[0],), drafts.shape[1], dtype=torch.long, device=drafts.device)
