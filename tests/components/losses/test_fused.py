"""The fused α / TV / log q(token) kernel against the torch path it stands in for."""

import pytest
import torch

from components.losses.confidence import tv_ce_confidence_loss
from components.losses.fused import fused_available, fused_tv_ce
from components.losses.overlap import alpha_tv_reference
from components.target.kernels import why_unavailable

pytestmark = pytest.mark.skipif(why_unavailable() is not None, reason=f"kernel: {why_unavailable()}")


def inputs(v: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    target = (torch.randn(6, 5, v, generator=g) * 3).to(dtype)
    draft = (torch.randn(6, 5, v, generator=g) * 3).to(dtype)
    draft[0, 0] = target[0, 0]  # p = q: ties everywhere, TV 0
    tokens = torch.randint(0, v, (6, 5), generator=g)
    tokens[1, :] = v - 1  # the last column (past the vector loop when v % 8 != 0)
    upstream = torch.randn(3, 6, 5, generator=g)
    return target, draft, tokens, upstream


def reference(target, draft, tokens, temperature):
    alpha, tv = alpha_tv_reference(torch.softmax(target.float() / temperature, -1), draft)
    log_q = torch.log_softmax(draft, -1).gather(-1, tokens[..., None])[..., 0]
    return alpha, tv, log_q


@pytest.mark.parametrize("v", [8, 1003, 4096])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_values_and_gradient_equal_the_torch_path_in_float32(v, temperature):
    target, draft, tokens, up = inputs(v)
    fast_in, slow_in = draft.clone().requires_grad_(), draft.clone().requires_grad_()
    fast, slow = fused_tv_ce(target, fast_in, tokens, temperature), reference(target, slow_in, tokens, temperature)
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    if temperature == 1.0:
        assert float(fast[1][0, 0].detach()) < 1e-5  # identical distributions
    (sum((w * x).sum() for w, x in zip(up, fast))).backward()
    (sum((w * x).sum() for w, x in zip(up, slow))).backward()
    torch.testing.assert_close(fast_in.grad, slow_in.grad, rtol=1e-4, atol=1e-6)


def test_bfloat16_logits_are_read_as_they_are_and_get_a_bfloat16_gradient():
    target, draft, tokens, up = inputs(1003, torch.bfloat16)
    fast_in = draft.clone().requires_grad_()
    slow_in = draft.clone().requires_grad_()
    fast = fused_tv_ce(target, fast_in, tokens)
    slow = reference(target, slow_in.float(), tokens, 1.0)  # the torch path upcasts
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    (sum((w * x).sum() for w, x in zip(up, fast))).backward()
    (sum((w * x).sum() for w, x in zip(up, slow))).backward()
    assert fast_in.grad.dtype == torch.bfloat16
    # the same float32 gradient rounded to bfloat16 (to nearest): within one bfloat16 step
    torch.testing.assert_close(fast_in.grad.float(), slow_in.grad.float(), rtol=2 ** -7, atol=1e-6)


def test_the_default_loss_is_the_same_fused_or_not():
    target, draft, tokens, _ = inputs(1003, seed=1)
    valid = torch.rand(6, 5, generator=torch.Generator().manual_seed(2)) < 0.8
    tokens = torch.where(valid, tokens, torch.full_like(tokens, -100))  # ignored ids at invalid positions
    conf = torch.randn(6, 5)
    grads, losses = [], []
    for fused in (True, False):
        d, c = draft.clone().requires_grad_(), conf.clone().requires_grad_()
        out = tv_ce_confidence_loss(target, d, target_tokens=tokens, confidence_logits=c, valid=valid, fused=fused)
        out.loss.backward()
        losses.append(out)
        grads.append((d.grad, c.grad))
    torch.testing.assert_close(losses[0].loss, losses[1].loss, rtol=1e-5, atol=1e-6)
    assert set(losses[0].terms) == {"tv", "ce", "confidence"}
    for key in losses[1].terms:
        torch.testing.assert_close(losses[0].terms[key], losses[1].terms[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(losses[0].alpha, losses[1].alpha, rtol=1e-5, atol=1e-6)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_where_it_runs_and_what_it_refuses():
    target, draft, tokens, _ = inputs(16)
    assert fused_available(target, draft) and fused_available(target.bfloat16(), draft)
    assert not fused_available(target.double(), draft) and not fused_available(target.half(), draft)
    with pytest.raises(ValueError, match=r"\[0, 16\)"):
        fused_tv_ce(target, draft, tokens + 16)
