"""Shared Gumbel noise for drafter-invariant sampling (Gumbel coupling, Daliri et al. 2024).

Sampling from ``softmax(l)`` is ``argmax(l + g)`` with i.i.d. Gumbel noise ``g``. If the drafter
and the target use the *same* noise for the same output position, verification becomes exact
matching and the text depends only on the target and the noise, not on the drafter.

For that to hold across rounds, the noise must be a function of (request seed, absolute token
position, token id) and not of how the sequence was cut into rounds. ``gumbel_noise`` provides
exactly that with a counter-based integer hash (no generator state), so the noise for position
``t`` is the same whether ``t`` was a draft slot, a bonus slot, or a tree node at depth ``t - T``.

What this module does not know: the models, the verification rule, or temperatures (apply
those to the logits first, see ``sampling.py``). The hash is a statistical mixer, not a
cryptographic one; it has 32 bits of resolution per uniform, which truncates the Gumbel tail at
about 22.9 (and -3.1 below) -- far beyond anything that changes an argmax in practice.
"""

from __future__ import annotations

import torch
from torch import Tensor

from components.spec.argmax import argmax_last

__all__ = ["gumbel_argmax", "gumbel_noise"]

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
# Odd multipliers below 2**31, so a 32-bit value times one of them fits in int64 without overflow.
_MUL1 = 0x7FEB352D
_MUL2 = 0x2C1B3C6D
_MUL3 = 0x297A2D39


def _mix32(x: Tensor) -> Tensor:
    """Bijective 32-bit integer mixer, *in place*, on a fresh int64 tensor of values in [0, 2**32)."""
    for shift, mul in ((16, _MUL1), (15, _MUL2), (16, _MUL3)):
        x.bitwise_xor_(x >> shift).mul_(mul).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 15)


def _keys(seeds: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """Two 32-bit keys [B, L, 1] per (request, position) from seeds [B] and positions [B, L];
    the second is odd, so token -> k1 + token * k2 is injective mod 2**32."""
    seeds = seeds.long()
    lo, hi = seeds & _MASK32, (seeds >> 32) & _MASK32
    k = _mix32(lo ^ _mix32((hi + _GOLDEN) & _MASK32))
    k1 = _mix32((k[:, None] + (positions.long() & 0x7FFFFFFF) * _GOLDEN) & _MASK32)
    k2 = _mix32((k1 + _GOLDEN) & _MASK32) | 1
    return k1[..., None], k2[..., None]


def _uniform_bits_to_gumbel(bits: Tensor) -> Tensor:
    """32-bit integers [...] (int64) -> standard Gumbel [...] float32, via u = (bits + 0.5) / 2**32.

    E = -log(u) is computed from u when u < 1/2 and as -log1p(-(1 - u)) from 1 - u otherwise,
    both exact in float32, so no float64 is needed and u never rounds to 0 or 1. In-place ops
    keep the number of full-size temporaries at three.
    """
    low = bits < 2**31
    side = torch.where(low, bits, _MASK32 - bits).float().add_(0.5).mul_(1.0 / 2**32)  # u or 1-u
    expo = side.log().neg_()                                  # -log(u) where low
    torch.where(low, expo, side.neg_().log1p_().neg_(), out=expo)  # -log1p(-(1-u)) elsewhere
    return expo.log_().neg_()


def gumbel_noise(
    seeds: Tensor,      # [B] long, one seed per request
    positions: Tensor,  # [B, L] long, absolute token positions being predicted
    vocab_size: int,
    chunk_elements: int | None = None,
) -> Tensor:
    """Standard Gumbel noise [B, L, V] (float32), a pure function of (seed, position, token).

    vocab_size must be below 2**31 (so token * key stays inside int64). The work is done in
    chunks of (request, position) rows of about ``chunk_elements`` values (default: 2**20 on
    CPU, where cache-sized temporaries are several times faster; everything at once on GPU).
    """
    device = seeds.device
    k1, k2 = _keys(seeds.to(device), positions.to(device))
    k1, k2 = k1.reshape(-1, 1), k2.reshape(-1, 1)
    tok = torch.arange(vocab_size, device=device)
    out = torch.empty(k1.shape[0], vocab_size, device=device)
    if chunk_elements is None:
        chunk_elements = 2**20 if device.type == "cpu" else 2**62
    rows = max(1, chunk_elements // max(vocab_size, 1))
    for lo in range(0, k1.shape[0], rows):
        bits = _mix32((k1[lo : lo + rows] + tok * k2[lo : lo + rows]) & _MASK32)
        out[lo : lo + rows] = _uniform_bits_to_gumbel(bits)
    return out.view(*positions.shape, vocab_size)


def gumbel_argmax(
    log_probs: Tensor,  # [..., V] processed log-probabilities (or logits) of target or drafter
    noise: Tensor,      # [..., V] Gumbel noise for the same positions
) -> Tensor:
    """Gumbel-max sample [...] long: argmax(log p + g); what both sides compute under coupling."""
    return argmax_last(log_probs + noise)
