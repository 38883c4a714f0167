"""DSpark/DFlash specifics: one backbone pass per block, the Markov head's causality, head options."""

from __future__ import annotations

import pytest
import torch

from components.config import DrafterConfig
from components.drafters import DraftBatch, DrafterError, build_drafter
from components.spec.sampling import SamplingParams


def count_calls(module: torch.nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_whole_block_from_one_backbone_pass(tiny_target, ids, dr, name):
    d = dr.make(tiny_target, name)
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :10], run.hidden[:, :10])
    calls, layer_calls = count_calls(d.backbone), count_calls(d.backbone.layers[0])
    prop = d.propose(state, ids[:, 10], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert prop.tokens.shape[1] == d.num_speculative_tokens and calls[0] == 1 and layer_calls[0] == 1
    d.training_forward(run.batch(), torch.Generator().manual_seed(0))  # all anchors at once
    assert calls[0] == 2 and layer_calls[0] == 2
    assert d.sequential_passes(d.num_speculative_tokens) == 1 and d.sequential_passes(d.num_speculative_tokens + 1) == 2


def test_layouts(tiny_target, dr):
    assert dr.make(tiny_target, "dspark", block_size=7).num_speculative_tokens == 7  # slot k -> anchor+k+1
    assert dr.make(tiny_target, "dflash", block_size=7).num_speculative_tokens == 6  # slots 1.. -> anchor+k
    assert dr.make(tiny_target, "dflash", block_size=7, sample_from_anchor=True).num_speculative_tokens == 7


@pytest.mark.parametrize("head", ["linear", "rnn", "none"])
def test_markov_head_reads_previous_token_only(tiny_target, ids, dr, head):
    """Changing the data token at a+k changes draft k (its previous token) and nothing earlier;
    with the Markov head nothing later either (the RNN carries it forward; 'none' ignores it)."""
    d = dr.make(tiny_target, "dspark", markov_head=head)
    anchors = torch.tensor([[4, 9], [3, 8]])
    run = dr.run(tiny_target, d, ids)
    base = d.training_forward(run.batch(anchors=anchors)).draft_logits
    k = 2
    changed_ids = ids.clone()
    changed_ids[torch.arange(2), anchors[:, 0] + k] += 1  # blocks 0 and 2 (first anchor of each row)
    changed = d.training_forward(DraftBatch(changed_ids, run.hidden, run.last_hidden, anchors=anchors)).draft_logits
    diff = (changed - base).abs().amax(-1)[[0, 2]]  # [2 blocks, γ]
    assert (diff[:, :k] == 0).all()
    if head == "none":
        assert (diff == 0).all()
        return
    assert (diff[:, k] > 0).all()
    later = diff[:, k + 1:]
    assert (later == 0).all() if head == "linear" else (later > 0).any()


def test_markov_bias_in_sampling(tiny_target, ids, dr):
    """Draft k's logits = backbone logits + W2(W1[draft k-1]), slot 0 conditioned on the anchor."""
    d = dr.make(tiny_target, "dspark")
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :12], run.hidden[:, :12])
    prop = d.propose(state, ids[:, 12], SamplingParams(temperature=1.0), torch.Generator().manual_seed(3))
    heads = d.markov_head, d.confidence_head
    d.markov_head = d.confidence_head = None  # the bare backbone's logits
    base = d.propose(state, ids[:, 12], SamplingParams(temperature=0.0)).logits
    d.markov_head, d.confidence_head = heads
    prev = torch.cat([ids[:, 12:13], prop.tokens[:, :-1]], dim=1)
    torch.testing.assert_close(prop.logits, base + d.markov_head.markov_w2(d.markov_head.markov_w1(prev)))


def test_confidence_head_sizes(tiny_target, dr):
    d = dr.make(tiny_target, "dspark", markov_rank=8)
    assert d.confidence_head.proj.weight.shape == (1, tiny_target.hidden_size + 8)
    assert dr.make(tiny_target, "dspark", enable_confidence_head=False).confidence_head is None
    assert dr.make(tiny_target, "dspark", markov_head="none").confidence_head.proj.weight.shape[1] == 64


def test_bad_head_options_named(tiny_target):
    with pytest.raises(DrafterError, match="markov_head: 'gru'"):
        build_drafter(DrafterConfig(name="dspark", markov_head="gru"), tiny_target)
    with pytest.raises(DrafterError, match="markov_rank must be > 0"):
        build_drafter(DrafterConfig(name="dspark", markov_rank=0), tiny_target)
