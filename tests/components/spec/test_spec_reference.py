"""Fast batched paths agree with the plain-Python references, case by case, on ragged batches.

Both sides consume the same coins and exponential races, so sampled rules must agree exactly.
"""

import torch

from components.spec import reference as ref
from components.spec.tree_verify import verify_tree_greedy, verify_tree_rrs_core, walk_tree
from components.spec.verify import (
    block_survival,
    block_weights,
    match_prefix,
    verify_block_core,
    verify_greedy,
    verify_speculative_core,
)


def _ragged_case(gen, bsz=300, gamma=5, vocab=6):
    """Random p, q, drafts from q, draft lengths 0..γ, coins, races."""
    p = torch.randn(bsz, gamma + 1, vocab, generator=gen).mul(1.5).softmax(-1)
    q = torch.randn(bsz, gamma, vocab, generator=gen).mul(1.5).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(bsz, gamma)
    lens = torch.randint(0, gamma + 1, (bsz,), generator=gen)
    coins = torch.rand(bsz, gamma, generator=gen)
    race = torch.empty(bsz, vocab).exponential_(generator=gen)
    return p, q, drafts, lens, coins, race


def test_greedy_matches_reference_on_ragged_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        bsz, gamma, vocab = 300, 6, 4
        target = torch.randn(bsz, gamma + 1, vocab, generator=gen)
        best = target.argmax(-1)
        noise = torch.randint(0, vocab, (bsz, gamma), generator=gen)
        flip = torch.rand(bsz, gamma, generator=gen) < 0.25
        drafts = torch.where(flip, noise, best[:, :gamma])  # mostly right, sometimes wrong
        lens = torch.randint(0, gamma + 1, (bsz,), generator=gen)
        res = verify_greedy(drafts, lens, target)
        for b in range(bsz):
            n, tok = ref.greedy_ref(drafts[b, : lens[b]].tolist(), best[b].tolist())
            assert (int(res.num_accepted[b]), int(res.next_token[b])) == (n, tok)
            assert res.accepted[b].tolist() == [k < n for k in range(gamma)]


def test_speculative_matches_reference():
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        p, q, drafts, lens, coins, race = _ragged_case(gen)
        res = verify_speculative_core(drafts, lens, p, q, coins, race)
        for b in range(drafts.shape[0]):
            L = int(lens[b])
            n, tok = ref.speculative_ref(drafts[b, :L].tolist(), p[b, : L + 1], q[b, :L],
                                         coins[b], race[b])
            assert (int(res.num_accepted[b]), int(res.next_token[b])) == (n, tok), b


def test_block_matches_reference():
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        p, q, drafts, lens, coins, race = _ragged_case(gen)
        res = verify_block_core(drafts, lens, p, q, coins, race)
        valid = torch.arange(drafts.shape[1])[None, :] < lens[:, None]
        w = block_weights(p[:, :-1].gather(-1, drafts[..., None]).squeeze(-1),
                          q.gather(-1, drafts[..., None]).squeeze(-1), valid)
        h = block_survival(w, lens, p, q)
        for b in range(drafts.shape[0]):
            L = int(lens[b])
            n, tok, h_ref = ref.block_ref(drafts[b, :L].tolist(), p[b, : L + 1], q[b, :L],
                                          coins[b], race[b])
            assert (int(res.num_accepted[b]), int(res.next_token[b])) == (n, tok), b
            assert torch.allclose(h[b, 1 : L + 1], torch.tensor(h_ref, dtype=torch.float64),
                                  atol=1e-5)


def _random_trees(gen, bsz, n, vocab):
    """Random topologically ordered trees with ragged sizes; small vocab makes matches and
    duplicate siblings common."""
    parents = torch.full((bsz, n), -1, dtype=torch.long)
    for j in range(1, n):
        parents[:, j] = torch.randint(-1, j, (bsz,), generator=gen)
    tokens = torch.randint(0, vocab, (bsz, n), generator=gen)
    num_nodes = torch.randint(0, n + 1, (bsz,), generator=gen)
    return tokens, parents, num_nodes


def test_tree_greedy_matches_reference():
    gen = torch.Generator().manual_seed(3)
    bsz, n, vocab = 400, 9, 3
    tokens, parents, num_nodes = _random_trees(gen, bsz, n, vocab)
    target = torch.randn(bsz, n + 1, vocab, generator=gen)
    res = verify_tree_greedy(tokens, parents, target, num_nodes)
    best = target.argmax(-1)
    for b in range(bsz):
        k = int(num_nodes[b])
        path, tok = ref.tree_walk_ref(tokens[b, :k].tolist(), parents[b, :k].tolist(),
                                      best[b].tolist())
        assert int(res.num_accepted[b]) == len(path)
        assert res.path[b, : len(path)].tolist() == path
        assert int(res.next_token[b]) == tok
        assert res.accepted[b].nonzero().flatten().tolist() == sorted(path)


def test_tree_rrs_matches_reference():
    gen = torch.Generator().manual_seed(4)
    bsz, n, vocab = 300, 8, 4
    tokens, parents, num_nodes = _random_trees(gen, bsz, n, vocab)
    p = torch.randn(bsz, n + 1, vocab, generator=gen).softmax(-1)
    q = torch.randn(bsz, n + 1, vocab, generator=gen).softmax(-1)
    coins = torch.rand(bsz, n, generator=gen)
    race = torch.empty(bsz, vocab).exponential_(generator=gen)
    res = verify_tree_rrs_core(tokens, parents, p, q, coins, race, num_nodes)
    for b in range(bsz):
        k = int(num_nodes[b])
        path, tok = ref.tree_rrs_ref(tokens[b, :k].tolist(), parents[b, :k].tolist(), p[b], q[b],
                                     coins[b], race[b])
        assert res.path[b, : len(path)].tolist() == path, b
        assert int(res.num_accepted[b]) == len(path)
        assert int(res.next_token[b]) == tok, b


def test_chain_as_tree_equals_chain_rules():
    """A chain is a tree with one child per node: tree rules reduce to the chain rules."""
    gen = torch.Generator().manual_seed(5)
    p, q, drafts, _, coins, race = _ragged_case(gen, bsz=500)
    bsz, gamma = drafts.shape
    lens = torch.full((bsz,), gamma)
    parents = torch.arange(-1, gamma - 1).expand(bsz, -1)
    q_slots = torch.cat([q, torch.zeros_like(q[:, :1])], 1)  # the last slot has no children
    chain = verify_speculative_core(drafts, lens, p, q, coins, race)
    tree = verify_tree_rrs_core(drafts, parents, p, q_slots, coins, race)
    assert torch.equal(chain.num_accepted, tree.num_accepted)
    assert torch.equal(chain.next_token, tree.next_token)
    target_tokens = p.argmax(-1)
    assert torch.equal(match_prefix(drafts, lens, target_tokens).num_accepted,
                       walk_tree(drafts, parents, target_tokens).num_accepted)
