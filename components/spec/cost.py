"""Cost model of speculative decoding: acceptance lengths, speedups, forward-time curves.

Quantities (the survey's notation):

* acceptance length τ -- expected tokens per round *including* the bonus token:
  τ = 1 + Σ_k Π_{i≤k} α_i from per-position conditional acceptance rates α, or 1 + Σ_k a_k from
  survival probabilities a_k = P(first k drafts accepted); for a tree, 1 + Σ_v P(path to v);
* speedup = τ / (n_draft·c + 1), c = one drafter pass relative to one target pass;
* batched speedup = τ(N)·T(B) / (T(B(N+1)) + T_draft) with a forward-time curve T(n);
* drafter KV-cache bytes = 2 (K and V) · dtype bytes · tokens · layers · kv heads · head dim.

The draft-length scheduler that uses these (DSpark's, one cap per padded batch pass) is
``components.engine.adaptive.AdaptiveDraftLength``.

Forward-time and SPS curves are callables ``n -> value`` on tensors; ``ProfileTable`` turns a
profiled table into one by linear interpolation. What this module does not know: models,
hardware (it only sees the numbers it is given) and verification rules.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "ProfileTable",
    "acceptance_length",
    "acceptance_length_constant",
    "acceptance_length_from_survival",
    "acceptance_rate",
    "batched_speedup",
    "drafter_kv_cache_bytes",
    "gumbel_match_probability",
    "roofline_forward_time",
    "speedup",
    "tree_acceptance_length",
]

Curve = Callable[[Tensor], Tensor]


def acceptance_length(alphas: Tensor) -> Tensor:
    """τ [...] from conditional per-position acceptance rates alphas [..., γ]."""
    return 1.0 + alphas.cumprod(dim=-1).sum(dim=-1)


def acceptance_length_from_survival(survival: Tensor) -> Tensor:
    """τ [...] from survival probabilities survival [..., γ], a_k = P(first k drafts accepted)."""
    return 1.0 + survival.sum(dim=-1)


def acceptance_length_constant(alpha: float, gamma: int) -> float:
    """τ for a constant acceptance rate: (1 - α^(γ+1)) / (1 - α), or γ + 1 at α = 1."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def tree_acceptance_length(path_probs: Tensor) -> Tensor:
    """τ [...] of a tree from the acceptance probability of each node's path, [..., N]."""
    return 1.0 + path_probs.sum(dim=-1)


def acceptance_rate(p: Tensor, q: Tensor) -> Tensor:
    """Speculative-sampling acceptance α = Σ min(p, q) = 1 - TV(p, q); p, q [..., V] -> [...]."""
    return torch.minimum(p, q).sum(dim=-1)


def gumbel_match_probability(p: Tensor, q: Tensor) -> Tensor:
    """P[argmax(log p + g) = argmax(log q + g)] under shared Gumbel noise; p, q [..., V] -> [...].

    Σ_j 1 / Σ_i max(p_i/p_j, q_i/q_j) (Daliri et al.). Builds [..., V, V]: small V only.
    """
    p, q = p.double(), q.double()
    both = (p > 0) & (q > 0)
    pj = torch.where(both, p, torch.ones_like(p))[..., None, :]
    qj = torch.where(both, q, torch.ones_like(q))[..., None, :]
    denom = torch.maximum(p[..., :, None] / pj, q[..., :, None] / qj).sum(dim=-2)  # [..., V] over j
    return torch.where(both, 1.0 / denom, torch.zeros_like(denom)).sum(dim=-1)


def speedup(tau: float | Tensor, n_draft: float | Tensor, c: float | Tensor) -> float | Tensor:
    """Walltime speedup τ / (n_draft·c + 1) while verification costs one decoding step."""
    return tau / (n_draft * c + 1.0)


class ProfileTable:
    """A profiled curve (e.g. forward time or steps/s vs tokens in the pass), interpolated.

    Linear interpolation between points; outside the table the end values are held
    (``x_max`` tells callers where the measurements stop).
    """

    def __init__(self, xs: Sequence[float] | Tensor, ys: Sequence[float] | Tensor) -> None:
        self.xs = torch.as_tensor(xs, dtype=torch.float64)  # [K] increasing
        self.ys = torch.as_tensor(ys, dtype=torch.float64)  # [K]
        if self.xs.dim() != 1 or self.xs.shape != self.ys.shape or self.xs.numel() < 1:
            raise ValueError("ProfileTable needs two 1-D sequences of the same non-zero length")
        if bool((self.xs[1:] <= self.xs[:-1]).any()):
            raise ValueError("ProfileTable xs must be strictly increasing")

    @property
    def x_max(self) -> float:
        return float(self.xs[-1])

    def __call__(self, n: Tensor | float) -> Tensor:
        x = torch.as_tensor(n, dtype=torch.float64).clamp(self.xs[0], self.xs[-1])
        hi = torch.searchsorted(self.xs, x, right=True).clamp(1, max(self.xs.numel() - 1, 1))
        lo = hi - 1
        if self.xs.numel() == 1:
            return self.ys[0].expand_as(x).clone()
        span = self.xs[hi] - self.xs[lo]
        t = (x - self.xs[lo]) / span
        return self.ys[lo] + t * (self.ys[hi] - self.ys[lo])


def roofline_forward_time(
    n: Tensor | float, weight_bytes: float, bandwidth: float, flops_per_token: float,
    peak_flops: float,
) -> Tensor:
    """Idealised forward time of a pass over n tokens: max(weights / bandwidth, n·flops / peak)."""
    n = torch.as_tensor(n, dtype=torch.float64)
    return torch.maximum(torch.full_like(n, weight_bytes / bandwidth), n * flops_per_token / peak_flops)


def batched_speedup(
    tau: Tensor | float, num_nodes: Tensor | float, batch: int, forward_time: Curve,
    draft_time: Tensor | float = 0.0,
) -> Tensor:
    """Speedup over plain decoding at the same batch: τ(N)·T(B) / (T(B(N+1)) + T_draft)."""
    nodes = torch.as_tensor(num_nodes, dtype=torch.float64)
    plain = forward_time(torch.as_tensor(float(batch), dtype=torch.float64))
    verify = forward_time(batch * (nodes + 1.0))
    return torch.as_tensor(tau, dtype=torch.float64) * plain / (verify + draft_time)


def drafter_kv_cache_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, num_tokens: int,
    dtype_bytes: int = 2, batch: int = 1,
) -> int:
    """Bytes of a drafter's own KV cache: 2 (K, V) · dtype · tokens · layers · heads · dim · batch."""
    return 2 * dtype_bytes * num_tokens * num_layers * num_kv_heads * head_dim * batch
