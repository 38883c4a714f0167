"""EDR's expected rounds against brute-force enumeration, its collapse to the summed TV for an
autoregressive drafter, the occupancy identity, and the surrogate's exact gradient."""

from __future__ import annotations

import itertools

import pytest
import torch

from components.losses.edr import edr_surrogate, outcome_probs, round_values


def brute_rounds(c: list[list[float]], n: int) -> float:
    """E[#rounds] by enumerating an independent coin per (anchor, draft): a round at s reads
    its coins in order until one fails (or γ pass), then moves to s + accepted + 1."""
    gamma = len(c[0])
    coins = [(s, k) for s in range(n) for k in range(gamma)]
    total = 0.0
    for outcome in itertools.product([True, False], repeat=len(coins)):
        heads = dict(zip(coins, outcome))
        prob = 1.0
        for (s, k), h in heads.items():
            prob *= c[s][k] if h else 1.0 - c[s][k]
        s, rounds = 0, 0
        while s < n:
            rounds += 1
            j = 0
            while j < gamma and heads[(s, j)]:
                j += 1
            s += j + 1
        total += prob * rounds
    return total


@pytest.mark.parametrize("seed", range(4))
def test_expected_rounds_are_the_brute_force_enumeration(seed):
    g = torch.Generator().manual_seed(seed)
    n, gamma = (4, 2) if seed % 2 else (3, 3)
    c = torch.rand(1, n, gamma, generator=g, dtype=torch.float64)
    values, occupancy = round_values(c, torch.tensor([n]))
    assert values[0, 0].item() == pytest.approx(brute_rounds(c[0].tolist(), n), abs=1e-12)
    assert occupancy.sum().item() == pytest.approx(values[0, 0].item(), abs=1e-12)  # E = Σ_s ω(s)


def test_an_autoregressive_drafter_collapses_to_the_summed_tv():
    """c[s, k] a function of the position s + k + 1 alone, blocks as long as the sequence:
    E[#rounds] = 1 + Σ_{t<n} (1 − c_t)."""
    n = 9
    c_t = torch.rand(n + n + 1, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    accept = torch.stack([c_t[s + 1:s + 1 + n] for s in range(n)])[None]  # [1, n, γ = n]
    values, _ = round_values(accept, torch.tensor([n]))
    assert values[0, 0].item() == pytest.approx(1 + (1 - c_t[1:n]).sum().item(), abs=1e-12)


def test_rows_of_other_lengths_and_entries_past_them_do_not_mix():
    g = torch.Generator().manual_seed(2)
    c = torch.rand(2, 6, 3, generator=g, dtype=torch.float64)
    values, occupancy = round_values(c, torch.tensor([6, 4]))
    alone, _ = round_values(c[1:, :4], torch.tensor([4]))
    assert values[1, 0].item() == pytest.approx(alone[0, 0].item(), abs=1e-12)
    assert torch.all(occupancy[1, 4:] == 0) and torch.all(values[1, 4:] == 0)
    assert round_values(c[:1], torch.tensor([0]))[0][0, 0].item() == 0.0  # no anchor: no round
    assert torch.allclose(outcome_probs(c).sum(-1), torch.ones(2, 6, dtype=torch.float64))


def test_the_surrogate_is_valued_and_differentiated_as_the_expected_rounds():
    g = torch.Generator().manual_seed(3)
    c = torch.rand(3, 7, 4, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 5, 2])
    exact = c.clone().requires_grad_(True)
    values, _ = round_values(exact, lengths)
    values[:, 0].sum().backward()
    surrogate = c.clone().requires_grad_(True)
    value = edr_surrogate(surrogate, lengths)
    value.sum().backward()
    assert torch.allclose(value.detach(), values[:, 0].detach(), atol=1e-12)
    assert torch.allclose(surrogate.grad, exact.grad, atol=1e-12)
    assert torch.all(surrogate.grad[1, 5:] == 0) and torch.all(surrogate.grad[2, 2:] == 0)  # past each row's anchors
