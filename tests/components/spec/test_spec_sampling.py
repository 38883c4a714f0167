"""Sampling transforms: temperature, top-k, top-p (per batch and per row), greedy."""

import torch

from components.spec.sampling import SamplingParams, log_probs_from_logits, probs_from_logits


def _reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """One row [V], plainly: scale, keep the k best, keep the smallest top set reaching top_p."""
    if temperature == 0:
        out = torch.zeros_like(logits)
        out[logits.argmax()] = 1.0
        return out
    scaled = logits / temperature
    order = scaled.argsort(descending=True).tolist()
    kept = order[:top_k] if top_k > 0 else order
    probs = torch.softmax(scaled[kept], -1).tolist()
    final, mass = [], 0.0
    for tok, pr in zip(kept, probs):
        if mass >= top_p:
            break
        final.append(tok)
        mass += pr
    out = torch.zeros_like(logits)
    out[final] = torch.softmax(scaled[final], -1)
    return out


def test_matches_plain_reference_per_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(60, 3, 20, generator=gen) * 2
    temps = torch.tensor([0.0, 0.5, 1.0, 1.7] * 15)
    ks = torch.tensor([0, 1, 5, 12, 20] * 12)
    ps = torch.tensor([1.0, 0.9, 0.5, 0.99, 0.3, 0.75] * 10)
    got = probs_from_logits(logits, SamplingParams(temps, ks, ps))
    for b in range(60):
        for k in range(3):
            want = _reference(logits[b, k], float(temps[b]), int(ks[b]), float(ps[b]))
            assert torch.allclose(got[b, k], want, atol=1e-6), (b, k)


def test_scalar_settings_and_log_probs():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5, 30, generator=gen)
    plain = probs_from_logits(logits)
    assert torch.allclose(plain, logits.softmax(-1), atol=1e-6)
    hot = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert torch.equal(hot.argmax(-1), logits.argmax(-1)) and torch.equal(hot.sum(-1), torch.ones(4, 5))
    topk = log_probs_from_logits(logits, SamplingParams(temperature=0.7, top_k=4))
    assert torch.equal(torch.isfinite(topk).sum(-1), torch.full((4, 5), 4))
    assert torch.allclose(topk.exp().sum(-1), torch.ones(4, 5), atol=1e-6)
    top_p = probs_from_logits(logits, SamplingParams(top_p=0.6))
    kept = top_p > 0
    mass = (plain * kept).sum(-1)
    smallest = torch.where(kept, plain, torch.ones_like(plain)).amin(-1)
    assert bool((mass >= 0.6 - 1e-6).all())            # enough mass kept
    assert bool((mass - smallest < 0.6 + 1e-6).all())  # and no more tokens than needed
