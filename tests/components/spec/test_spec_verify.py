"""Chain verification semantics: block vs token-wise acceptance (exact, by enumeration), the
survey's toy example, greedy limits, edge cases and seeded determinism."""

import itertools
from fractions import Fraction

import torch

from components.spec.sampling import SamplingParams, probs_from_logits
from components.spec.verify import (
    block_survival,
    block_weights,
    emitted_tokens,
    verify_block,
    verify_greedy,
    verify_speculative,
)


def _all_drafts(p, q):
    """Every draft of length γ over V tokens, with its probability under q (context-free)."""
    gamma, vocab = q.shape
    drafts = torch.tensor(list(itertools.product(range(vocab), repeat=gamma)))
    prob = q[torch.arange(gamma), drafts].prod(-1)
    return drafts, prob


def expected_accepted_block(p, q):
    """Exact E[accepted draft tokens] of block verification: p [γ+1, V], q [γ, V] per position."""
    drafts, prob = _all_drafts(p, q)
    m, gamma = drafts.shape
    lens = torch.full((m,), gamma)
    pb, qb = p.double().expand(m, -1, -1), q.double().expand(m, -1, -1)
    p_x = pb[:, :gamma].gather(-1, drafts[..., None]).squeeze(-1)
    q_x = qb.gather(-1, drafts[..., None]).squeeze(-1)
    h = block_survival(block_weights(p_x, q_x, torch.ones_like(drafts, dtype=torch.bool)), lens, pb, qb)[:, 1:]
    # longest surviving prefix: P(n = k) = h_k Π_{j>k} (1 - h_j)
    tail = torch.cat([torch.flip(torch.cumprod(torch.flip(1 - h, [1]), 1), [1])[:, 1:],
                      torch.ones(m, 1, dtype=h.dtype)], 1)
    p_n = h * tail
    return float((prob.double() * (p_n * torch.arange(1, gamma + 1)).sum(-1)).sum())


def expected_accepted_tokenwise(p, q):
    alpha = torch.minimum(p[:-1], q).sum(-1).double()
    return float(alpha.cumprod(0).sum())


def test_survey_toy_example_exact():
    """p = (1/3, 2/3), q = (2/3, 1/3) at every position, γ = 2: 10/9 vs 11/9 tokens per round."""
    p = torch.tensor([[1 / 3, 2 / 3]] * 3, dtype=torch.float64)
    q = torch.tensor([[2 / 3, 1 / 3]] * 2, dtype=torch.float64)
    assert abs(expected_accepted_tokenwise(p, q) - 10 / 9) < 1e-12
    assert abs(expected_accepted_block(p, q) - 11 / 9) < 1e-12
    assert Fraction(11, 9) > Fraction(10, 9)


def test_survey_toy_example_sampled():
    gen = torch.Generator().manual_seed(0)
    bsz = 60000
    p = torch.tensor([[1 / 3, 2 / 3]] * 3).expand(bsz, -1, -1)
    q = torch.tensor([[2 / 3, 1 / 3]] * 2).expand(bsz, -1, -1)
    drafts = torch.multinomial(q.reshape(-1, 2), 1, generator=gen).view(bsz, 2)
    lens = torch.full((bsz,), 2)
    block = verify_block(drafts, lens, p, q, gen).num_accepted.double().mean()
    tokenwise = verify_speculative(drafts, lens, p, q, gen).num_accepted.double().mean()
    assert abs(float(block) - 11 / 9) < 0.015
    assert abs(float(tokenwise) - 10 / 9) < 0.015


def test_block_accepts_at_least_tokenwise_in_expectation():
    gen = torch.Generator().manual_seed(1)
    gaps = []
    for _ in range(40):
        gamma, vocab = 3, 3
        p = torch.randn(gamma + 1, vocab, generator=gen).mul(2).softmax(-1).double()
        q = torch.randn(gamma, vocab, generator=gen).mul(2).softmax(-1).double()
        gaps.append(expected_accepted_block(p, q) - expected_accepted_tokenwise(p, q))
    assert min(gaps) > -1e-9
    assert max(gaps) > 1e-3  # and it is strictly better somewhere


def test_single_token_block_equals_tokenwise():
    """With γ = 1 both rules accept w.p. α = Σ min(p, q)."""
    gen = torch.Generator().manual_seed(2)
    p = torch.randn(2, 7, generator=gen).softmax(-1).double()
    q = torch.randn(1, 7, generator=gen).softmax(-1).double()
    assert abs(expected_accepted_block(p, q) - expected_accepted_tokenwise(p, q)) < 1e-12


def test_identical_drafter_accepts_everything():
    gen = torch.Generator().manual_seed(3)
    bsz, gamma, vocab = 500, 4, 9
    p = torch.randn(bsz, gamma + 1, vocab, generator=gen).softmax(-1)
    drafts = torch.multinomial(p[:, :gamma].reshape(-1, vocab), 1, generator=gen).view(bsz, gamma)
    lens = torch.randint(0, gamma + 1, (bsz,), generator=gen)
    for rule in (verify_speculative, verify_block):
        res = rule(drafts, lens, p, p[:, :gamma], gen)
        assert torch.equal(res.num_accepted, lens)


def test_temperature_zero_sampling_equals_greedy():
    """With T = 0 the processed p and q are one-hot: sampled rules reduce to greedy matching."""
    gen = torch.Generator().manual_seed(4)
    bsz, gamma, vocab = 400, 5, 6
    greedy = SamplingParams(temperature=0.0)
    target_logits = torch.randn(bsz, gamma + 1, vocab, generator=gen)
    draft_logits = target_logits[:, :gamma] + torch.randn(bsz, gamma, vocab, generator=gen)
    p, q = probs_from_logits(target_logits, greedy), probs_from_logits(draft_logits, greedy)
    drafts = q.argmax(-1)
    lens = torch.randint(0, gamma + 1, (bsz,), generator=gen)
    want = verify_greedy(drafts, lens, target_logits)
    for rule in (verify_speculative, verify_block):
        got = rule(drafts, lens, p, q, gen)
        assert torch.equal(got.num_accepted, want.num_accepted)
        assert torch.equal(got.next_token, want.next_token)
        assert torch.equal(got.accepted, want.accepted)
    assert bool((want.num_accepted > 0).any()) and bool((want.num_accepted < lens).any())


def test_greedy_output_is_target_greedy_sequence():
    target = torch.tensor([[[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.0, 0.2, 0.8], [0.3, 0.3, 0.4]]])
    drafts = torch.tensor([[1, 0, 1]])  # target argmax: 1, 0, 2, 2
    res = verify_greedy(drafts, torch.tensor([3]), target)
    assert res.num_accepted.tolist() == [2] and res.next_token.tolist() == [2]
    assert emitted_tokens(res, drafts).tolist() == [[1, 0, 2, -1]]
    full = verify_greedy(torch.tensor([[1, 0, 2]]), torch.tensor([3]), target)
    assert emitted_tokens(full, torch.tensor([[1, 0, 2]])).tolist() == [[1, 0, 2, 2]]  # bonus
    short = verify_greedy(drafts, torch.tensor([1]), target)  # only the first draft is real
    assert short.num_accepted.tolist() == [1] and short.next_token.tolist() == [0]
    assert short.accepted.tolist() == [[True, False, False]]


def test_empty_drafts_sample_bonus_from_target():
    gen = torch.Generator().manual_seed(5)
    bsz, vocab = 30000, 5
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).expand(bsz, 1, vocab)
    q = torch.zeros(bsz, 0, vocab)
    drafts = torch.zeros(bsz, 0, dtype=torch.long)
    lens = torch.zeros(bsz, dtype=torch.long)
    for rule in (verify_speculative, verify_block):
        res = rule(drafts, lens, p, q, gen)
        assert res.accepted.shape == (bsz, 0) and int(res.num_accepted.sum()) == 0
        freq = torch.bincount(res.next_token, minlength=vocab).double() / bsz
        assert torch.allclose(freq, p[0, 0].double(), atol=0.01)


def test_seeded_determinism():
    gen = torch.Generator().manual_seed(6)
    bsz, gamma, vocab = 64, 4, 11
    p = torch.randn(bsz, gamma + 1, vocab, generator=gen).softmax(-1)
    q = torch.randn(bsz, gamma, vocab, generator=gen).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(bsz, gamma)
    lens = torch.full((bsz,), gamma)
    for rule in (verify_speculative, verify_block):
        a = rule(drafts, lens, p, q, torch.Generator().manual_seed(42))
        b = rule(drafts, lens, p, q, torch.Generator().manual_seed(42))
        assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)


def test_zero_target_probability_is_never_accepted():
    """A draft token the (filtered) target gives zero mass must be rejected by both rules."""
    gen = torch.Generator().manual_seed(7)
    bsz, vocab = 2000, 6
    logits = torch.randn(bsz, 2, vocab, generator=gen)
    p = probs_from_logits(logits, SamplingParams(top_k=2))
    q = torch.full((bsz, 1, vocab), 1.0 / vocab)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(bsz, 1)
    lens = torch.ones(bsz, dtype=torch.long)
    p_x = p[:, 0].gather(-1, drafts).squeeze(-1)
    for rule in (verify_speculative, verify_block):
        res = rule(drafts, lens, p, q, gen)
        assert not bool(res.accepted[p_x == 0].any())
        recovered = p[:, 0].gather(-1, res.next_token[:, None]).squeeze(-1)
        assert bool((recovered[res.num_accepted == 0] > 0).all())


def test_rows_without_drafts_take_the_targets_choice():
    """γ = 0 (a round of plain rows): nothing accepted, the next token the target's own at slot 0,
    as with drafts padded to width 0 through the general path."""
    logits = torch.randn(3, 1, 50, generator=torch.Generator().manual_seed(0))
    res = verify_greedy(torch.zeros(3, 0, dtype=torch.long), torch.zeros(3, dtype=torch.long), logits)
    assert res.num_accepted.tolist() == [0, 0, 0] and res.accepted.shape == (3, 0)
    assert torch.equal(res.next_token, logits[:, 0].argmax(-1))
    one = verify_greedy(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                        torch.cat([logits, logits, logits], dim=1))  # drafts padded, none real
    assert torch.equal(one.next_token, res.next_token) and one.num_accepted.tolist() == [0, 0, 0]


def test_match_prefix_numpy_path_equals_torch_ops():
    """On CPU tensors prefix matching runs in numpy; every field equals the torch-op path's, over
    ragged lengths (0..γ), full matches, mismatches at every slot and a γ of 1."""
    from components.spec.verify import _match_prefix_numpy, _match_prefix_torch

    gen = torch.Generator().manual_seed(3)
    for gamma in (1, 2, 5):
        target = torch.randint(0, 3, (400, gamma + 1), generator=gen)
        drafts = torch.where(torch.rand(400, gamma, generator=gen) < 0.7, target[:, :gamma],
                             torch.randint(0, 3, (400, gamma), generator=gen))
        lens = torch.randint(0, gamma + 1, (400,), generator=gen)
        got, want = _match_prefix_numpy(drafts, lens, target), _match_prefix_torch(drafts, lens, target)
        for field in ("num_accepted", "next_token", "accepted"):
            assert torch.equal(getattr(got, field), getattr(want, field)), (gamma, field)
            assert getattr(got, field).dtype == getattr(want, field).dtype
        assert {int(n) for n in got.num_accepted} == set(range(gamma + 1))  # every outcome reached
