"""P-EAGLE: the chain attention equals attention under the full depth-aware mask; a round is one
layer pass whatever γ; every depth a training row computes is what the engine's one pass gives;
each slot is drawn from the q it hands to verification; γ past the trained depths is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from components.drafters import DrafterError
from components.drafters.peagle import chain_attention
from components.spec.sampling import GREEDY, SamplingParams, probs_from_logits
from tests.components.drafters.conftest import make_drafter, run_target


def test_chain_attention_equals_the_full_depth_mask():
    """Keys of every depth laid side by side, [depth 0 | depth 1 | ... | depth s], with the mask
    an unrolled implementation builds: (row j) sees depth-0 keys i ≤ j and its own chain (i = j)."""
    torch.manual_seed(0)
    b, h, hk, t, s, d = 2, 4, 2, 7, 3, 8
    q = torch.randn(b, h, t, d, dtype=torch.float64)
    k0, v0 = torch.randn(b, hk, t, d, dtype=torch.float64), torch.randn(b, hk, t, d, dtype=torch.float64)
    kc, vc = torch.randn(b, hk, t, s, d, dtype=torch.float64), torch.randn(b, hk, t, s, d, dtype=torch.float64)
    keys = torch.cat([k0] + [kc[:, :, :, i] for i in range(s)], dim=2)  # [B, hk, (s+1)T, d]
    values = torch.cat([v0] + [vc[:, :, :, i] for i in range(s)], dim=2)
    eye = torch.eye(t, dtype=torch.bool)
    mask = torch.cat([torch.ones(t, t, dtype=torch.bool).tril()] + [eye] * s, dim=1)  # [T, (s+1)T]
    want = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(chain_attention(q, k0, v0, kc, vc), want)


def test_a_round_is_one_pass(tiny_target, ids):
    d = make_drafter(tiny_target, "peagle", num_layers=1, ttt_steps=5)
    assert d.sequential_passes(5) == 1 and d.num_speculative_tokens == 5
    calls = [0]
    inner = d.midlayer.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    d.midlayer.forward = counted
    run = run_target(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :9], run.hidden[:, :9])
    prop = d.propose(state, ids[:, 9], GREEDY)
    assert calls[0] == 1 and prop.tokens.shape == (2, 5)
    with pytest.raises(DrafterError, match="at most 5"):
        d.propose(state, ids[:, 9], GREEDY, num_speculative_tokens=6)


def test_training_rows_equal_the_engine_pass_at_every_anchor(tiny_target, ids):
    """Every position's teacher-forced depths equal consume + propose there (the mask rows read
    nothing of the data after the anchor, so any data will do)."""
    d = make_drafter(tiny_target, "peagle", num_layers=1, ttt_steps=4)
    run = run_target(tiny_target, d, ids)
    out = d.training_forward(run.batch(anchors=torch.tensor([[3, 8, 12], [5, 10, 15]])))
    logits = out.draft_logits.view(2, 3, 4, -1)
    for row, anchors in enumerate(([3, 8, 12], [5, 10, 15])):
        for i, a in enumerate(anchors):
            state = d.consume(d.init_state(1), ids[row:row + 1, :a], run.hidden[row:row + 1, :a])
            prop = d.propose(state, ids[row:row + 1, a], GREEDY)
            torch.testing.assert_close(logits[row, i], prop.logits[0], rtol=1e-4, atol=1e-4)


def test_each_slot_is_drawn_from_its_q(tiny_target, ids):
    """Sampled: q is the processed distribution of each slot's logits, and the drafts at slot 2
    follow it (chi-square over top-4), whatever was drawn at slot 1 (slots are independent)."""
    d = make_drafter(tiny_target, "peagle", num_layers=1, ttt_steps=3)
    run = run_target(tiny_target, d, ids)
    state = d.consume(d.init_state(1), ids[:1, :9], run.hidden[:1, :9])
    sampling = SamplingParams(temperature=1.0, top_k=4)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        first = d.propose(state, ids[:1, 9], sampling, gen)
        torch.testing.assert_close(first.probs, probs_from_logits(d.full_logits(first.logits), sampling))
        q = first.probs[0, 1]
        counts: dict[int, int] = {}
        for _ in range(400):
            tok = int(d.propose(state, ids[:1, 9], sampling, gen).tokens[0, 1])
            counts[tok] = counts.get(tok, 0) + 1
    support = q.nonzero().view(-1).tolist()
    assert set(counts) <= set(support) and len(support) == 4
    n = sum(counts.values())
    stat = sum((counts.get(t, 0) - n * float(q[t])) ** 2 / (n * float(q[t])) for t in support)
    assert float(torch.special.gammaincc(torch.tensor(1.5), torch.tensor(stat / 2))) > 1e-3
