"""Token trees: ancestor-only masks, flattening, and best-first optimality against brute force."""

import itertools

import torch

from components.spec.trees import (
    TokenTree,
    ancestor_mask,
    build_best_first_tree,
    build_best_first_trees,
    build_causal_trees,
    flatten_trees,
)


def _ancestors_ref(parents: list[int], i: int) -> set[int]:
    out = {i}
    while parents[i] >= 0:
        i = parents[i]
        out.add(i)
    return out


def test_ancestor_mask_is_ancestor_or_self_only():
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 7, 33):
        parents = torch.full((20, n), -1, dtype=torch.long)
        for j in range(1, n):
            parents[:, j] = torch.randint(-1, j, (20,), generator=gen)
        mask = ancestor_mask(parents)
        for b in range(20):
            par = parents[b].tolist()
            for i in range(n):
                assert set(mask[b, i].nonzero().flatten().tolist()) == _ancestors_ref(par, i)


def test_deep_chain_mask_is_lower_triangular():
    parents = torch.arange(-1, 99)[None, :]  # a chain of 100 nodes needs 7 squarings
    assert torch.equal(ancestor_mask(parents)[0], torch.ones(100, 100, dtype=torch.bool).tril())


def test_flatten_pads_and_keeps_mask_position_ids_consistent():
    gen = torch.Generator().manual_seed(1)
    trees = build_best_first_trees(torch.randn(3, 4, 10, generator=gen).log_softmax(-1), 12)
    trees.append(build_best_first_tree(torch.randn(2, 10, generator=gen).log_softmax(-1), 5))
    flat = flatten_trees(trees)
    assert flat.tokens.shape == (4, 12) and flat.num_nodes.tolist() == [12, 12, 12, 5]
    assert torch.equal(flat.attention_mask.sum(-1)[3, :5], flat.position_ids[3, :5])
    for b, t in enumerate(trees):
        k = t.tokens.numel()
        mask = flat.attention_mask[b]
        assert torch.equal(mask.sum(-1)[:k], t.depths)  # depth = number of ancestors-or-self
        assert torch.equal(flat.position_ids[b, :k], t.depths)
        assert bool(mask.diagonal().all())
        assert not bool(mask[:k, k:].any()) and not bool(mask[k:, :k].any())  # padding isolated
        assert not bool(mask.triu(1).any())  # topological order: ancestors come first
        for i in range(k):
            assert set(mask[i].nonzero().flatten().tolist()) == _ancestors_ref(t.parents.tolist(), i)


def _check_tree_scores(tree: TokenTree, step_logp):
    """Each node's score = parent's score + log-prob of its token; parents precede children."""
    for i in range(tree.tokens.numel()):
        par = int(tree.parents[i])
        assert par < i
        base = 0.0 if par < 0 else float(tree.scores[par])
        path = []
        j = i
        while j >= 0:
            path.append(int(tree.tokens[j]))
            j = int(tree.parents[j])
        assert abs(float(tree.scores[i]) - base - step_logp(path[::-1])) < 1e-5
        assert int(tree.depths[i]) == len(path)


def _all_paths(gamma, vocab):
    for d in range(1, gamma + 1):
        yield from itertools.product(range(vocab), repeat=d)


def test_best_first_picks_the_highest_probability_paths():
    gen = torch.Generator().manual_seed(2)
    gamma, vocab = 3, 4
    for budget in (1, 3, 10, 30, 84):
        log_q = torch.randn(gamma, vocab, generator=gen).mul(2).log_softmax(-1)
        tree = build_best_first_tree(log_q, budget)
        scores = sorted((sum(float(log_q[i, t]) for i, t in enumerate(path))
                         for path in _all_paths(gamma, vocab)), reverse=True)
        assert tree.tokens.numel() == min(budget, len(scores))
        got = sorted(tree.scores.tolist(), reverse=True)
        assert torch.allclose(torch.tensor(got), torch.tensor(scores[: len(got)]), atol=1e-5)
        assert tree.scores.tolist() == sorted(tree.scores.tolist(), reverse=True)  # pop order
        _check_tree_scores(tree, lambda path, lq=log_q: float(lq[len(path) - 1, path[-1]]))


def _hash_head(vocab_scale: float):
    """A path-dependent causal head: log-softmax over the candidates of a fixed random function
    of (whole path, candidate)."""
    table = torch.randn(7919, generator=torch.Generator().manual_seed(3)) * vocab_scale

    def head(paths, depth, candidates):
        weights = torch.tensor([1, 31, 131, 1031, 7001, 13001])[: paths.shape[1]]
        key = (paths * weights).sum(-1) + depth * 17
        logits = table[(key[:, None] * 7 + candidates * 101) % 7919]
        return logits.log_softmax(-1)

    return head


def test_causal_tree_picks_the_highest_path_scores_under_the_head():
    gen = torch.Generator().manual_seed(4)
    bsz, gamma, vocab, top_m = 3, 3, 7, 3
    base = torch.randn(bsz, gamma, vocab, generator=gen).log_softmax(-1)
    roots = torch.tensor([1, 4, 6])
    head = _hash_head(2.0)
    cands = base.topk(top_m, -1).indices
    for budget in (1, 5, 17, 39):
        trees = build_causal_trees(base, roots, head, budget, top_m)
        for b, tree in enumerate(trees):
            def step(path, b=b):
                d = len(path) - 1
                full = torch.tensor([int(roots[b])] + path[:-1] + [0] * (gamma - d))
                lp = head(full[None, :], torch.tensor([d]), cands[b, d][None, :])[0]
                return float(lp[(cands[b, d] == path[-1]).nonzero()[0, 0]])

            scores = sorted((sum(step(list(path[: i + 1])) for i in range(len(path)))
                             for path in _paths_over(cands[b])), reverse=True)
            assert tree.tokens.numel() == min(budget, len(scores))
            assert torch.allclose(tree.scores.sort(descending=True).values.float(),
                                  torch.tensor(scores[: tree.tokens.numel()]), atol=1e-5)
            _check_tree_scores(tree, step)


def _paths_over(cands):
    gamma = cands.shape[0]
    for d in range(1, gamma + 1):
        yield from itertools.product(*[cands[i].tolist() for i in range(d)])


def test_causal_builder_with_marginal_head_equals_ddtree():
    gen = torch.Generator().manual_seed(5)
    bsz, gamma, vocab, budget = 4, 4, 9, 25
    log_q = torch.randn(bsz, gamma, vocab, generator=gen).log_softmax(-1)
    roots = torch.arange(bsz)  # the root token tells the head which request a path belongs to

    def head(paths, depth, candidates):
        return log_q[paths[:, 0], depth].gather(-1, candidates)

    causal = build_causal_trees(log_q, roots, head, budget, top_m=vocab)
    for b in range(bsz):
        ddtree = build_best_first_tree(log_q[b], budget)
        assert torch.equal(causal[b].tokens, ddtree.tokens)
        assert torch.equal(causal[b].parents, ddtree.parents)
        assert torch.allclose(causal[b].scores, ddtree.scores, atol=1e-5)


def test_budget_larger_than_all_paths_and_empty_draft():
    log_q = torch.tensor([[0.0, -1.0]]).log_softmax(-1)  # γ = 1, V = 2: only two paths exist
    assert build_best_first_tree(log_q, 10).tokens.tolist() == [0, 1]
    assert build_best_first_tree(torch.zeros(0, 5), 4).tokens.numel() == 0
