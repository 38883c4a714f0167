"""Cost model: the survey's worked examples, the tree-size figure and Gumbel agreement (the
draft-length scheduler is the engine's, tested in
``tests/components/engine/adaptive/test_policy.py``)."""

import pytest
import torch

from components.spec.cost import (
    ProfileTable,
    acceptance_length,
    acceptance_length_constant,
    acceptance_length_from_survival,
    acceptance_rate,
    batched_speedup,
    drafter_kv_cache_bytes,
    gumbel_match_probability,
    roofline_forward_time,
    speedup,
    tree_acceptance_length,
)
from components.spec.gumbel import gumbel_argmax, gumbel_noise
from components.spec.trees import build_best_first_tree


def h100_8b(n):
    """The survey's 8B-on-H100 roofline: 16 GB of bf16 weights, 3.35 TB/s, 989 TFLOP/s."""
    return roofline_forward_time(n, weight_bytes=16e9, bandwidth=3.35e12,
                                 flops_per_token=2 * 8e9, peak_flops=989e12)


def test_survey_roofline_numbers():
    t1 = float(h100_8b(1))
    assert round(t1 * 1e3, 1) == 4.8                      # ≈ 4.8 ms per pass
    assert 208 <= 1 / t1 < 210                             # ≤ 208 tokens/s (at 4.8 ms)
    assert round(2 * 8e9 / 989e12 * 1e3, 3) == 0.016      # the math alone: 0.016 ms
    assert float(h100_8b(8)) == t1                         # 8 tokens cost the same
    knee = 989 / 3.35
    assert round(knee) == 295 and float(h100_8b(296)) > t1 >= float(h100_8b(295))


def test_survey_acceptance_length_and_speedup():
    tau = acceptance_length_constant(0.8, 5)
    assert round(tau, 2) == 3.69
    assert abs(float(acceptance_length(torch.full((5,), 0.8))) - tau) < 1e-6
    assert round(speedup(tau, n_draft=5, c=0.05), 2) == 2.95    # autoregressive drafter
    assert round(speedup(tau, n_draft=1, c=0.05), 2) == 3.51    # parallel drafter
    assert acceptance_length_constant(1.0, 7) == 8.0


def test_tau_from_survival_equals_tau_from_conditional_rates():
    alphas = torch.rand(10, 6, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(acceptance_length(alphas),
                          acceptance_length_from_survival(alphas.cumprod(-1)))
    assert torch.allclose(tree_acceptance_length(alphas.cumprod(-1)), acceptance_length(alphas))


def test_survey_drafter_kv_cache_example():
    per_request = drafter_kv_cache_bytes(num_layers=5, num_kv_heads=8, head_dim=128,
                                         num_tokens=32768, dtype_bytes=2)
    assert per_request == 671_088_640                     # 0.67 GB per request
    assert round(drafter_kv_cache_bytes(5, 8, 128, 32768, 2, batch=128) / 1e9) == 86
    assert int(16e9 // per_request) + 1 == 24              # overtakes the 16 GB of weights at 24
    assert int(80e9 // per_request) == 119                 # the whole 80 GB HBM at 119


def test_survey_tree_size_figure():
    """Best tree size per batch: B=1 grows to the knee, 8 -> ~36, 32 -> ~8, 128 -> a 2-chain,
    and a 64-node tree at B=128 is almost 4x slower than plain decoding."""
    alpha, depth, width = 0.8, 64, 24
    ranks = torch.arange(width, dtype=torch.float64)
    log_q = (torch.log(torch.tensor(alpha)) + ranks * torch.log(torch.tensor(1 - alpha)))
    tree = build_best_first_tree(log_q.float().expand(depth, -1), 400)
    taus = tree_acceptance_length(torch.cat([torch.zeros(1), tree.scores.exp().cumsum(0)])[:, None])
    nodes = torch.arange(401, dtype=torch.float64)
    best = {}
    for batch in (1, 8, 32, 128):
        s = batched_speedup(taus, nodes, batch, h100_8b, draft_time=0.05 * h100_8b(batch))
        best[batch] = int(s.argmax())
        if batch == 128:
            assert 0.2 < float(s[64]) < 0.3
            assert tree.parents[:2].tolist() == [-1, 0]  # the best 2-node tree is a chain
    assert best[1] == 294                                # right up to the knee (295 tokens)
    assert best[8] == 36 and best[32] == 8 and best[128] == 2


def test_profile_table_interpolates_and_matches_callable():
    table = ProfileTable([1, 10, 100], [2.0, 2.0, 20.0])
    assert torch.allclose(table(torch.tensor([1.0, 5.0, 55.0, 100.0, 500.0])),
                          torch.tensor([2.0, 2.0, 11.0, 20.0, 20.0], dtype=torch.float64))
    xs = torch.arange(1, 2001, dtype=torch.float64)
    prof = ProfileTable(xs, h100_8b(xs))
    got = batched_speedup(3.0, torch.tensor([4.0, 30.0]), 16, prof)
    want = batched_speedup(3.0, torch.tensor([4.0, 30.0]), 16, h100_8b)
    assert torch.allclose(got, want)
    with pytest.raises(ValueError):
        ProfileTable([1, 1], [0, 0])


def test_gumbel_match_probability_formula_and_bounds():
    gen = torch.Generator().manual_seed(1)
    vocab, bsz = 8, 20000
    for _ in range(3):
        p = torch.randn(vocab, generator=gen).mul(1.5).softmax(-1)
        q = torch.randn(vocab, generator=gen).mul(1.5).softmax(-1)
        match = float(gumbel_match_probability(p, q))
        alpha = float(acceptance_rate(p, q))
        tv = 1 - alpha
        assert (1 - tv) / (1 + tv) - 1e-9 <= match <= alpha + 1e-9
        noise = gumbel_noise(torch.arange(bsz), torch.zeros(bsz, 1, dtype=torch.long), vocab)[:, 0]
        empirical = (gumbel_argmax(p.log(), noise) == gumbel_argmax(q.log(), noise)).double().mean()
        assert abs(float(empirical) - match) < 0.015
    assert abs(float(gumbel_match_probability(p, p)) - 1.0) < 1e-9
