"""Fast paths for α = Σ min(p, q), TV(p, q) = ½ Σ |p − q| and log Σ min(·, ·) in log space.

Plain autograd through `softmax → minimum/abs → sum` allocates about eight `[N, γ, V]`
temporaries per call (sign, masks, products, the softmax backward), and on large vocabularies
the cost of a loss is the number of such passes. `overlap_tv` computes both values in one
forward with three full-size buffers and a hand-written backward with one:

    ∂α/∂q_v = 1[q_v < p_v] = (1 + s_v)/2,   ∂TV/∂q_v = −s_v/2,   s = sign(p − q)

(ties get ½, as torch.minimum's backward does). The constant part is annihilated by the
softmax Jacobian, so ∂/∂q = s·(g_α − g_TV)/2 per row, and ∂/∂ℓ = q ⊙ (∂/∂q − ⟨q, ∂/∂q⟩).
Gradients flow to the draft logits only; p is a constant.

`log_overlap` computes L = log Σ_v min(e^{a_v}, e^{b_v}) with a = log p + shift_p, b = log q +
shift_q (the LK likelihood log α, and BV's prefix terms with their running ratio and minimum)
with four full-size buffers instead of about ten: with w = softmax(min(a, b)) and
s = sign(a − b), ∂L/∂b_v = w_v (1 + s_v)/2, ∂L/∂a_v = w_v − ∂L/∂b_v (ties split ½ like
torch.minimum), and the shifts get the row sums.

`alpha_tv_reference` and `log_overlap_reference` are the plain autograd versions both are
tested against (tests/components/losses/test_losses_overlap.py). This module knows nothing
about masks, weights or reductions.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable


class _OverlapTV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, p: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        q = torch.softmax(logits, dim=-1)  # [N, γ, V]
        buf = torch.minimum(p, q)
        alpha = buf.sum(-1)  # Σ min(p, q): accurate when α is small
        torch.sub(p, q, out=buf)
        tv = 0.5 * torch.linalg.vector_norm(buf, ord=1, dim=-1)  # accurate when TV is small
        ctx.save_for_backward(buf.sign_(), q)
        return alpha, tv

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_alpha: Tensor, g_tv: Tensor) -> tuple[None, Tensor]:
        sign, q = ctx.saved_tensors
        grad = sign * (0.5 * (g_alpha - g_tv)).unsqueeze(-1)  # ∂/∂q up to a row constant
        grad.mul_(q)
        grad.addcmul_(q, grad.sum(-1, keepdim=True), value=-1.0)  # softmax backward
        return None, grad


def overlap_tv(
    p: Tensor,  # [N, γ, V] target probabilities (a constant)
    draft_logits: Tensor,  # [N, γ, V] float32/float64 draft logits
) -> tuple[Tensor, Tensor]:  # ([N, γ], [N, γ])
    """(α, TV) per position, both differentiable w.r.t. the draft logits."""
    return _OverlapTV.apply(p.detach(), draft_logits)


def alpha_tv_reference(p: Tensor, draft_logits: Tensor) -> tuple[Tensor, Tensor]:
    """The same two values through plain autograd (slower; for tests)."""
    q = torch.softmax(draft_logits, dim=-1)
    return torch.minimum(p, q).sum(-1), 0.5 * (p - q).abs().sum(-1)


class _LogOverlap(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, log_p: Tensor, log_q: Tensor, shift_p: Tensor, shift_q: Tensor
    ) -> Tensor:
        a = log_p + shift_p.unsqueeze(-1)  # [N, γ, V]
        b = log_q + shift_q.unsqueeze(-1)
        w = torch.minimum(a, b)
        sign = torch.sub(a, b, out=a).sign_()  # reuses a's buffer
        del b
        top = w.amax(-1, keepdim=True)
        w.sub_(top).exp_()
        total = w.sum(-1, keepdim=True)
        w.div_(total)  # softmax of min(a, b) over the vocabulary
        ctx.save_for_backward(sign, w)
        return (top + total.log()).squeeze(-1)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g: Tensor) -> tuple[Tensor | None, ...]:
        sign, w = ctx.saved_tensors
        grad_b = sign.add(1.0).mul_(w).mul_(0.5 * g.unsqueeze(-1))  # ∂L/∂b · g
        grad_shift_q = grad_b.sum(-1)
        grad_log_p = None
        if ctx.needs_input_grad[0]:
            grad_log_p = torch.mul(w, g.unsqueeze(-1)).sub_(grad_b)
        return grad_log_p, grad_b, g - grad_shift_q, grad_shift_q


def log_overlap(
    log_p: Tensor,  # [N, γ, V] target log-probs (finite)
    log_q: Tensor,  # [N, γ, V] draft log-probs
    shift_p: Tensor | None = None,  # [N, γ] log-scale of p, default 0
    shift_q: Tensor | None = None,  # [N, γ] log-scale of q, default 0
) -> Tensor:  # [N, γ]
    """log Σ_v min(e^{shift_p} p_v, e^{shift_q} q_v), differentiable in all inputs."""
    zero = log_q.new_zeros(log_q.shape[:-1])
    shift_p = zero if shift_p is None else shift_p
    shift_q = zero if shift_q is None else shift_q
    return _LogOverlap.apply(log_p, log_q, shift_p, shift_q)


def log_overlap_reference(
    log_p: Tensor, log_q: Tensor, shift_p: Tensor | None = None, shift_q: Tensor | None = None
) -> Tensor:
    """The same value through plain autograd (slower; for tests)."""
    a = log_p if shift_p is None else log_p + shift_p.unsqueeze(-1)
    b = log_q if shift_q is None else log_q + shift_q.unsqueeze(-1)
    return torch.logsumexp(torch.minimum(a, b), dim=-1)
