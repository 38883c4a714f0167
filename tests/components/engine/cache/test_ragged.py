"""The ragged cache: left padding is invisible, holes are masked out, and compaction moves them
away without changing what any row sees (nothing is recomputed)."""

from __future__ import annotations

import pytest
import torch

from components.engine.cache.ragged import RaggedCache
from tests.components.engine.batch.test_continuous import batch_prompts


def test_ragged_cache_compaction_keeps_attention_exact(tiny_target):
    """Left padding is invisible (each row's next-token logits equal a plain forward of its own
    tokens), and ``compact`` moves holes away without changing what any row sees."""
    prompts = batch_prompts(tiny_target)[:3]
    ragged = None
    for p in prompts:
        part = RaggedCache.single(tiny_target.forward(torch.tensor([p]), use_cache=True).cache)
        ragged = part if ragged is None else (ragged.concat(part) or ragged)

    def next_logits(cache: RaggedCache) -> torch.Tensor:  # [B, V] after one more token (7) per row
        lens = cache.valid.sum(dim=1)
        ids = torch.full((cache.batch_size, 1), 7)
        out = tiny_target.forward(ids, attention_mask=cache.attention_mask(1), cache=cache.cache,
                                  use_cache=True, position_ids=lens[:, None])
        cache.commit(torch.zeros(cache.batch_size, 1, dtype=torch.bool))  # drop the probe again
        return out.logits[:, 0]

    exact = next_logits(ragged)
    for b, p in enumerate(prompts):
        ref = tiny_target.forward(torch.tensor([p + [7]])).logits[:, -1]
        torch.testing.assert_close(exact[b:b + 1], ref, atol=1e-5, rtol=1e-5)
    assert ragged.holes() > 0 and ragged.reclaimable() == 0  # left padding only: nothing to gain
    ragged.valid[0, -2] = False  # punch a hole in row 0
    counts = [len(p) - (b == 0) for b, p in enumerate(prompts)]
    assert ragged.reclaimable() == pytest.approx(1 - max(counts) / max(len(p) for p in prompts))
    before = next_logits(ragged)
    ragged.compact()
    after = next_logits(ragged)
    assert ragged.holes() > 0 and int(ragged.valid[0].sum()) == len(prompts[0]) - 1
    torch.testing.assert_close(before, after, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(before[0], exact[0], atol=1e-4)  # the hole was masked out
