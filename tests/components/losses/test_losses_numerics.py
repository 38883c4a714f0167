"""Half-precision inputs and extreme logits: finite losses and gradients, close to float32."""

import pytest
import torch

import components.losses as L

NAMES = sorted(L.LOSSES)


def inputs_for(target, draft, tokens, valid, conf):
    return L.LossInputs(
        draft_logits=draft,
        target_logits=target,
        target_tokens=tokens,
        valid=valid,
        position_weights=L.decay_weights(draft.shape[1], 4.0),
        confidence_logits=conf,
    )


def half_batch(dtype, scale=4.0, seed=11):
    g = torch.Generator().manual_seed(seed)
    shape = (4, 6, 257)
    target = torch.randn(shape, generator=g) * scale
    draft = torch.randn(shape, generator=g) * scale
    tokens = torch.randint(0, shape[-1], shape[:2], generator=g)
    valid = torch.rand(shape[:2], generator=g) > 0.2
    valid[:, 0] = True
    conf = torch.randn(shape[:2], generator=g)
    return target, draft, tokens, valid, conf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", NAMES)
def test_half_precision_is_finite_and_close_to_float32(name, dtype):
    target, draft, tokens, valid, conf = half_batch(dtype)
    loss = L.build_loss(name)
    full = loss(inputs_for(target, draft, tokens, valid, conf)).loss
    d_half = draft.to(dtype).requires_grad_(True)
    c_half = conf.to(dtype).requires_grad_(True)
    half = loss(inputs_for(target.to(dtype), d_half, tokens, valid, c_half))
    assert half.loss.dtype == torch.float32
    g = torch.autograd.grad(half.loss, c_half if name == "confidence" else d_half)[0]
    assert torch.isfinite(half.loss) and torch.isfinite(g).all() and g.dtype == dtype
    # the only difference is rounding the logits to 8 (bf16) or 11 (fp16) mantissa bits
    tol = 5e-3 if dtype == torch.bfloat16 else 1e-3
    h, f = float(half.loss.detach()), float(full.detach())
    assert abs(h - f) <= tol * max(1.0, abs(f))


@pytest.mark.parametrize("name", NAMES)
def test_extreme_logits_stay_finite(name):
    """Peaked, nearly disjoint distributions (α ~ 1e-30) in fp16: no log(0), no NaN."""
    target, draft, tokens, valid, conf = half_batch(torch.float16, scale=1.0, seed=12)
    target = target.clone()
    target[..., 0] += 200.0  # the target is sure of token 0 ...
    draft = draft.clone()
    draft[..., 1] += 200.0  # ... the drafter of token 1
    d = draft.half().requires_grad_(True)
    c = conf.half().requires_grad_(True)
    out = L.build_loss(name)(inputs_for(target.half(), d, tokens, valid, c))
    g = torch.autograd.grad(out.loss, c if name == "confidence" else d)[0]
    assert torch.isfinite(out.loss) and torch.isfinite(g).all()
