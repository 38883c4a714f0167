"""Sampling transforms shared by the target and the drafter: logits -> processed distribution.

Temperature, top-k and top-p are applied in that order (the Hugging Face / vLLM order) to a
tensor of logits ``[..., V]`` and turned into probabilities or log-probabilities. Temperature 0
means greedy: the processed distribution is one-hot at the argmax (the first one on ties).

Which combinations are lossless
-------------------------------
Every verification rule in ``components.spec.verify`` / ``tree_verify`` is lossless *with
respect to the target distribution it is given*. So the output of speculative decoding follows
the **processed** target distribution ``p = process(target_logits)``, exactly as if the target
sampled on its own with those settings, provided that:

* the same processing (temperature, top-k, top-p) is applied to the target logits before
  verification as the user asked for; any combination of the three is then lossless;
* for speculative sampling, block verification and tree rejection sampling, ``q`` is the
  distribution the draft tokens were *actually sampled from*. The drafter may use any
  processing of its own (another temperature, top-k, greedy), but the ``q`` passed to the
  verifier must be that processed distribution. Passing an unprocessed ``q`` while sampling
  from a processed one breaks losslessness (the rule divides by the wrong ``q``);
* greedy (temperature 0): ``p`` is one-hot, every rule reduces to exact matching, and the
  output equals the target's own greedy output whatever ``q`` is;
* Gumbel coupling uses ``log p`` of the processed target (filtered tokens are ``-inf`` and
  never win the argmax); the drafter's processing only changes the acceptance rate.

What this module does not know: which rule verifies, the vocabulary's meaning, or where the
logits came from. It never loops over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["SamplingParams", "log_probs_from_logits", "probs_from_logits", "process_logits"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-batch sampling settings. Tensors allow per-request values."""

    temperature: float | Tensor = 1.0  # scalar or [B]; 0 = greedy
    top_k: int | Tensor = 0            # scalar or [B] long; 0 = off
    top_p: float | Tensor = 1.0        # scalar or [B]; 1.0 = off


GREEDY = SamplingParams(temperature=0.0)  # the argmax, no randomness (the one shared constant)

def _per_row(value: float | Tensor, logits: Tensor) -> Tensor:
    """Broadcast a scalar or [B] setting to logits [B, ..., V] as [B, 1, ..., 1]."""
    t = torch.as_tensor(value, device=logits.device)
    if t.dim() == 0:
        return t.reshape([1] * logits.dim())
    return t.reshape([t.shape[0]] + [1] * (logits.dim() - 1))


def _apply_temperature(logits: Tensor, temperature: float | Tensor) -> tuple[Tensor, Tensor]:
    """Scale logits [..., V] by 1/T; returns (scaled logits, greedy row mask [..., 1])."""
    temp = _per_row(temperature, logits).to(logits.dtype)
    greedy = temp <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temp), temp)
    return scaled, greedy.expand(*logits.shape[:-1], 1)


def _top_k_top_p_mask(logits: Tensor, top_k: int | Tensor, top_p: float | Tensor) -> Tensor:
    """Bool mask [..., V] of tokens kept by top-k then top-p (one sort over the vocabulary)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device)
    k = _per_row(top_k, logits).long()
    keep_sorted = (k <= 0) | (rank < k)
    masked = sorted_logits.masked_fill(~keep_sorted, float("-inf"))
    probs = masked.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive cumsum
    p = _per_row(top_p, logits).to(probs.dtype)
    keep_sorted = keep_sorted & ((mass_before < p) | (rank == 0))
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def process_logits(
    logits: Tensor,  # [B, ..., V] raw logits
    params: SamplingParams = SamplingParams(),
) -> Tensor:
    """Processed logits [B, ..., V]: scaled by 1/T, filtered tokens set to -inf.

    Greedy rows (T = 0) keep only their argmax (0 there, -inf elsewhere).
    """
    scaled, greedy = _apply_temperature(logits.float(), params.temperature)
    if _is_active(params.top_k, 0) or _is_active(params.top_p, 1.0):
        keep = _top_k_top_p_mask(scaled, params.top_k, params.top_p)
        scaled = scaled.masked_fill(~keep, float("-inf"))
    if bool(greedy.any()):
        top = logits.argmax(dim=-1, keepdim=True)
        one_hot = torch.full_like(scaled, float("-inf")).scatter(-1, top, 0.0)
        scaled = torch.where(greedy, one_hot, scaled)
    return scaled


def _is_active(value: float | Tensor, off: float) -> bool:
    """Whether a top-k/top-p setting filters anything (scalar or per-row tensor)."""
    if isinstance(value, Tensor):
        return bool((value != off).any())
    return value != off


def probs_from_logits(logits: Tensor, params: SamplingParams = SamplingParams()) -> Tensor:
    """Processed probabilities [B, ..., V] from logits [B, ..., V]."""
    return process_logits(logits, params).softmax(dim=-1)


def log_probs_from_logits(logits: Tensor, params: SamplingParams = SamplingParams()) -> Tensor:
    """Processed log-probabilities [B, ..., V] (-inf for filtered tokens) from logits [B, ..., V]."""
    return process_logits(logits, params).log_softmax(dim=-1)
