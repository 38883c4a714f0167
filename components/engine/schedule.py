"""Draft length per round for a batch: fixed γ, or DSpark-style adaptive under load.

The batch engine verifies every row in one padded pass of B·(G+1) tokens, G = the longest
draft in the batch, so a round's cost depends on G, not on each row's own length. The adaptive
policy therefore picks one cap G per round, before drafting, maximising expected tokens per
second (the DSpark scheduler's objective, ``components.spec.cost``, for a padded pass)::

    E[tokens](G) = Σ_b (1 + Σ_{k≤G} a_{b,k})            a_{b,k}: P(first k drafts of b accepted)
    time(G)      = s·T(B·(G+1)) + o + [G > 0]·t_draft    T: profiled target forward time
    G*           = argmax_G E[tokens](G) / time(G)        G = 0 is plain decoding

G = 0 skips the drafter altogether, so when the batch is large enough that a wider pass costs
more than the accepted tokens are worth, speculation switches itself off instead of slowing the
batch. Survival a_{b,k} comes from the drafter's confidence head (DSpark: σ(c_k), cumulated) of
the request's last proposal, else from the acceptance seen so far (per draft position, over all
requests). Draft time t_draft, the table's scale s (measured forward / T) and the per-round
overhead o (cache bookkeeping, the drafter consuming the verified states, Python) are running
means of what the engine measured; o matters because plain decoding pays it once per token.

Knows timings and acceptance numbers only; nothing about models, rules or caches.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from components.spec.cost import ProfileTable

DEFAULT_PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@torch.no_grad()
def profile_forward_time(target: Any, sizes: tuple[int, ...] = DEFAULT_PROFILE_SIZES, context: int = 64,
                         reps: int = 5) -> ProfileTable:
    """T(n): median seconds of one target forward over n new tokens (as ``n/16`` rows of up to
    16 tokens) on top of a ``context``-token cache per row, made non-decreasing in n (a wider
    pass never costs less; timing noise on a busy host would otherwise invert neighbours) by
    taking the smallest time measured at n or above.
    Measured on ``target`` as it is."""
    dev, times = target.device, []
    for n in sizes:
        rows = max(1, n // 16) if n >= 16 else 1
        width = -(-n // rows)
        prefix = torch.randint(0, target.vocab_size, (rows, context), device=dev)
        new = torch.randint(0, target.vocab_size, (rows, width), device=dev)
        samples = []
        for _ in range(reps + 1):
            cache = target.forward(prefix, use_cache=True).cache
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
            target.forward(new, cache=cache, use_cache=True)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            samples.append(time.perf_counter() - t0)
        times.append(sorted(samples[1:])[reps // 2])
    # T(n) = min over m ≥ n of the measured T(m): robust to a slow early (cold) measurement
    monotone = torch.tensor(times, dtype=torch.float64).flip(0).cummin(dim=0).values.flip(0)
    return ProfileTable(list(sizes), monotone)


class FixedDraftLength:
    """Always the engine's γ (times its DLoop stages)."""

    def cap(self, survival: Tensor, max_drafts: int) -> int:  # survival [B, γ]
        return max_drafts

    def observe(self, accepted: list[int], drafted: list[int], draft_seconds: float, forward_seconds: float,
                round_seconds: float, verify_tokens: int) -> None:
        pass


@dataclass
class AdaptiveDraftLength:
    """Per-round cap G on the drafts, from survival estimates and a forward-time table."""

    forward_time: ProfileTable  # seconds of a target pass over n tokens
    draft_seconds: float = 0.0  # running mean per drafting round (learned from observe)
    scale: float = 1.0  # measured forward seconds / T(n) (running mean)
    overhead: float = 0.0  # seconds per round outside drafting and the target forward (running mean)
    ema: float = 0.1
    accept_counts: list[float] = field(default_factory=list)  # per position: accepted
    reach_counts: list[float] = field(default_factory=list)  # per position: drafted and reached
    last_choice: int = -1

    def empirical_survival(self, gamma: int) -> Tensor:  # [γ] from the acceptance seen so far
        alphas = [(self.accept_counts[k] + 1.0) / (self.reach_counts[k] + 2.0) if k < len(self.reach_counts)
                  else 0.5 for k in range(gamma)]
        return torch.tensor(alphas, dtype=torch.float64).cumprod(dim=0)

    def cap(self, survival: Tensor, max_drafts: int) -> int:
        """survival [B, ≥max_drafts] → the cap G in 0..max_drafts with the best tokens/second."""
        a = survival[:, :max_drafts].double().clamp(0, 1).cummin(dim=-1).values
        bsz = a.shape[0]
        gained = torch.cat([torch.zeros(1, dtype=torch.float64), a.sum(dim=0).cumsum(dim=0)])  # [G+1]
        caps = torch.arange(max_drafts + 1, dtype=torch.float64)
        seconds = self.scale * self.forward_time(bsz * (caps + 1)) + self.overhead \
            + (caps > 0).double() * self.draft_seconds
        self.last_choice = int(((bsz + gained) / seconds).argmax())
        return self.last_choice

    def observe(self, accepted: list[int], drafted: list[int], draft_seconds: float, forward_seconds: float,
                round_seconds: float, verify_tokens: int) -> None:
        """One round's outcome: accepted/drafted per drafting row and its measured seconds."""
        table = float(self.forward_time(float(verify_tokens)))
        self.scale = self._mean(self.scale, forward_seconds / max(table, 1e-9))
        self.overhead = self._mean(self.overhead, max(0.0, round_seconds - forward_seconds - draft_seconds))
        if not drafted:
            return
        self.draft_seconds = draft_seconds if self.draft_seconds == 0 else self._mean(self.draft_seconds,
                                                                                     draft_seconds)
        for a, d in zip(accepted, drafted):
            while len(self.reach_counts) < d:
                self.reach_counts.append(0.0)
                self.accept_counts.append(0.0)
            for k in range(min(a + 1, d)):  # positions 0..a reached; 0..a-1 accepted
                self.reach_counts[k] += 1
                self.accept_counts[k] += float(k < a)


    def _mean(self, old: float, new: float) -> float:
        return (1 - self.ema) * old + self.ema * new


def survival_from_confidences(confidences: Tensor | None) -> Tensor | None:
    """Confidence-head outputs [1, γ] (P(draft k accepted | prefix accepted)) → survival [1, γ]."""
    if confidences is None:
        return None
    return confidences.double().clamp(0, 1).cumprod(dim=-1)
