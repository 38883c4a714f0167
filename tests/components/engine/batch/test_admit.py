"""Admission: the requests admitted in one round are prefilled in one right-padded target pass,
whose cache rows, first tokens and drafter states match batch-1 prefills."""

from __future__ import annotations

import torch

from components.engine.batch import BatchEngine, Request
from tests.components.engine.batch.test_continuous import batch_prompts
from tests.components.engine.test_engine_greedy import random_drafter


class CountingTarget:
    """The real target, counting its forward passes."""

    def __init__(self, target):
        self.target, self.calls = target, []

    def __getattr__(self, name):
        return getattr(self.target, name)

    def forward(self, input_ids, **kw):
        self.calls.append(tuple(input_ids.shape))
        return self.target.forward(input_ids, **kw)


def test_admitted_requests_share_one_padded_prefill(tiny_target):
    prompts = batch_prompts(tiny_target)[:4]
    counting = CountingTarget(tiny_target)
    engine = BatchEngine(counting, random_drafter(tiny_target, "dspark"), max_batch_size=4)
    for p in prompts:
        engine.add(Request(p, 5))
    rows, cache = engine.admission.prefill(list(engine.waiting))
    assert counting.calls == [(4, max(len(p) for p in prompts))]
    for i, (p, row) in enumerate(zip(prompts, rows)):
        alone = tiny_target.forward(torch.tensor([p]), layer_ids=engine.layer_ids, use_cache=True)
        assert cache.valid[i].tolist() == [True] * len(p) + [False] * (cache.length - len(p))
        for mine, ref in zip(cache.cache.layers, alone.cache.layers):
            torch.testing.assert_close(mine.keys[i:i + 1, :, :len(p)], ref.keys, atol=1e-5, rtol=1e-5)
        assert int(row.seq.last_token[0]) == int(alone.logits[0, -1].argmax())
        assert row.seq.length == len(p) + 1 and row.result.prefill_seconds > 0
        state = engine.drafter.consume(engine.drafter.init_state(1), torch.tensor([p]), alone.hidden)
        assert row.seq.draft_state.length == state.length
        torch.testing.assert_close(row.seq.draft_state.kv[0][0], state.kv[0][0], atol=1e-5, rtol=1e-5)


def test_a_lone_request_is_prefilled_without_padding(tiny_target):
    counting = CountingTarget(tiny_target)
    engine = BatchEngine(counting, None, max_batch_size=4)
    engine.add(Request(batch_prompts(tiny_target)[0], 3))
    engine.step()
    assert counting.calls[0] == (1, len(batch_prompts(tiny_target)[0]))
    assert bool(engine.batch.cache.valid.all())
