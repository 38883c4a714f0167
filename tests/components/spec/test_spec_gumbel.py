"""Gumbel coupling: for one seed the output is the target's own Gumbel-max sample sequence,
whatever the drafter, across rounds with ragged draft lengths, for chains and trees."""

import torch

from components.spec.gumbel import gumbel_argmax, gumbel_noise
from components.spec.tree_verify import tree_noise_positions, verify_tree_gumbel
from components.spec.verify import emitted_tokens, verify_gumbel

V = 6
GAMMA = 4
NUM_TOKENS = 12


def _markov(gen, sharp=2.0):
    return torch.randn(V, V, generator=gen).mul(sharp).log_softmax(-1)


def target_only(log_p, seeds):
    """x_t = argmax(log P[x_{t-1}] + g(seed, t)), x_{-1} = 0."""
    bsz = seeds.shape[0]
    out, last = [], torch.zeros(bsz, dtype=torch.long)
    for t in range(NUM_TOKENS):
        noise = gumbel_noise(seeds, torch.full((bsz, 1), t), V)[:, 0]
        last = gumbel_argmax(log_p[last], noise)
        out.append(last)
    return torch.stack(out, 1)


def _emit(out, count, emitted, n):
    width = out.shape[1] - 1
    cols = count[:, None] + torch.arange(emitted.shape[1])[None, :]
    ok = (torch.arange(emitted.shape[1])[None, :] < n[:, None]) & (cols < width)
    out.scatter_(1, torch.where(ok, cols, width), emitted)


def chain_decode(log_p, log_q, seeds, gen):
    bsz = seeds.shape[0]
    out = torch.full((bsz, NUM_TOKENS + GAMMA + 2), -1, dtype=torch.long)
    count = torch.zeros(bsz, dtype=torch.long)
    last = torch.zeros(bsz, dtype=torch.long)
    rounds = 0
    while int(count.min()) < NUM_TOKENS:
        rounds += 1
        noise = gumbel_noise(seeds, count[:, None] + torch.arange(GAMMA + 1), V)
        prev, drafts, slots = last, [], [last]
        for k in range(GAMMA):
            prev = gumbel_argmax(log_q[prev], noise[:, k])  # the drafter uses the same noise
            drafts.append(prev)
            slots.append(prev)
        d = torch.stack(drafts, 1)
        lens = torch.randint(0, GAMMA + 1, (bsz,), generator=gen)
        res = verify_gumbel(d, lens, log_p[torch.stack(slots, 1)], noise)
        n = res.num_accepted + 1
        _emit(out, count, emitted_tokens(res, d), n)
        last = res.next_token
        count += n
    return out[:, :NUM_TOKENS], rounds


def test_chain_output_is_drafter_invariant_and_equals_target_sampling():
    gen = torch.Generator().manual_seed(0)
    log_p = _markov(gen)
    seeds = torch.randint(0, 2**40, (256,), generator=gen)
    want = target_only(log_p, seeds)
    good = (log_p.exp() * 0.8 + 0.2 / V).log()
    bad = _markov(gen, sharp=4.0)
    got_good, rounds_good = chain_decode(log_p, good, seeds, gen)
    got_bad, rounds_bad = chain_decode(log_p, bad, seeds, gen)
    assert torch.equal(got_good, want) and torch.equal(got_bad, want)
    assert rounds_good < rounds_bad  # the drafters really differ; only the speed changes
    different_seed = target_only(log_p, seeds + 1)
    assert not torch.equal(different_seed, want)


def tree_decode(log_p, log_q, seeds):
    """Deterministic depth-2 trees (top-2 children per node) verified with per-slot noise."""
    bsz = seeds.shape[0]
    parents = torch.tensor([-1, -1, 0, 0, 1, 1]).expand(bsz, -1)
    depths = torch.tensor([1, 1, 2, 2, 2, 2]).expand(bsz, -1)
    out = torch.full((bsz, NUM_TOKENS + 4), -1, dtype=torch.long)
    count = torch.zeros(bsz, dtype=torch.long)
    last = torch.zeros(bsz, dtype=torch.long)
    while int(count.min()) < NUM_TOKENS:
        kids = log_q[last].topk(2, -1).indices
        grand = log_q[kids.reshape(-1)].topk(2, -1).indices.view(bsz, 4)
        tokens = torch.cat([kids, grand], 1)
        slots = torch.cat([last[:, None], tokens], 1)
        noise = gumbel_noise(seeds, tree_noise_positions(count, depths), V)
        res = verify_tree_gumbel(tokens, parents, log_p[slots], noise)
        emitted = torch.full((bsz, 4), -1, dtype=torch.long)
        on_path = torch.arange(3)[None, :] < res.num_accepted[:, None]
        emitted[:, :3] = torch.where(on_path, tokens.gather(1, res.path[:, :3].clamp_min(0)), -1)
        emitted = emitted.scatter(1, res.num_accepted[:, None], res.next_token[:, None])
        n = res.num_accepted + 1
        _emit(out, count, emitted, n)
        last = res.next_token
        count += n
    return out[:, :NUM_TOKENS]


def test_tree_output_is_drafter_invariant_and_equals_target_sampling():
    gen = torch.Generator().manual_seed(1)
    log_p = _markov(gen)
    seeds = torch.randint(0, 2**40, (256,), generator=gen)
    want = target_only(log_p, seeds)
    assert torch.equal(tree_decode(log_p, log_p, seeds), want)
    assert torch.equal(tree_decode(log_p, _markov(gen), seeds), want)


def test_noise_is_a_pure_function_of_seed_position_token():
    seeds = torch.tensor([3, 2**35 + 3, 7])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2], [5, 6, 7]])
    a = gumbel_noise(seeds, pos, 50)
    b = gumbel_noise(seeds, pos, 50)
    assert torch.equal(a, b)
    assert not torch.equal(a[0], a[1])  # high seed bits matter
    shifted = gumbel_noise(seeds[2:], torch.tensor([[6, 7]]), 50)
    assert torch.equal(shifted[0], a[2, 1:])  # same (seed, position) -> same noise, any round cut
    big = gumbel_noise(torch.arange(64), torch.arange(64)[:, None].expand(64, 8), 1000)
    assert abs(float(big.mean()) - 0.5772) < 0.01 and abs(float(big.std()) - 1.2825) < 0.01
