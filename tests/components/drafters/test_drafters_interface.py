"""Every registered drafter behind the one interface: shapes, dtypes, state, rollback, agreement."""

from __future__ import annotations

import pytest
import torch

from components.config import DrafterConfig
from components.drafters import DRAFTERS, DrafterError, build_drafter, spread_layer_ids
from components.drafters.eagle3 import eagle3_layer_ids
from components.spec.sampling import GREEDY, SamplingParams

NAMES = ["dspark", "dflash", "dflash2", "domino", "d_loop", "dedit", "eagle3", "peagle", "medusa", "mtp"]



def test_registry_holds_every_family():
    assert set(NAMES) <= set(DRAFTERS)


def test_unknown_name_lists_registered(tiny_target):
    with pytest.raises(DrafterError, match="unknown drafter 'nope'.*dspark"):
        build_drafter(DrafterConfig(name="nope"), tiny_target)


def test_layer_id_defaults():
    assert spread_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert spread_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert spread_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert spread_layer_ids(4, 5) == [0, 1, 2]  # too shallow: widened to 0..L-2, deduped
    assert spread_layer_ids(36, 1) == [18]
    assert eagle3_layer_ids(36) == [1, 17, 32]
    assert eagle3_layer_ids(8) == [1, 3, 4]
    assert eagle3_layer_ids(4) == [0, 1, 2]


def test_out_of_range_layer_ids_named(tiny_target):
    with pytest.raises(DrafterError, match=r"\[7\] out of range.*4 layers"):
        build_drafter(DrafterConfig(name="dflash", layer_ids=[1, 7]), tiny_target)


@pytest.mark.parametrize("name", NAMES)
def test_training_forward_shapes(tiny_target, ids, name, dr):
    d = dr.make(tiny_target, name)
    out = d.training_forward(dr.run(tiny_target, d, ids).batch(), torch.Generator().manual_seed(0))
    n, gamma, v = out.draft_logits.shape
    assert gamma == d.num_speculative_tokens and v == tiny_target.vocab_size
    assert out.draft_logits.dtype == torch.float32 and out.draft_logits.requires_grad
    assert out.target_logits.shape == (n, gamma, v) and not out.target_logits.requires_grad
    assert out.target_tokens.shape == (n, gamma) and out.target_tokens.dtype == torch.long
    assert out.valid.dtype == torch.bool and out.valid.any()
    if out.confidence_logits is not None:
        assert out.confidence_logits.shape == (n, gamma)
    assert out.loss_inputs().draft_logits is out.draft_logits


@pytest.mark.parametrize("name", NAMES)
def test_proposal_shapes_and_parameters(tiny_target, ids, name, dr):
    d = dr.make(tiny_target, name)
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :-1], run.hidden[:, :-1])
    assert state.length == ids.shape[1] - 1
    prop = d.propose(state, ids[:, -1], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    gamma = d.num_speculative_tokens
    assert prop.tokens.shape == (2, gamma) and prop.tokens.dtype == torch.long
    assert prop.probs.shape == (2, gamma, tiny_target.vocab_size)
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(2, gamma))
    picked = prop.probs.gather(-1, prop.tokens.unsqueeze(-1))
    assert (picked > 0).all()  # tokens drawn from q
    if prop.confidences is not None:
        assert prop.confidences.shape == (2, gamma) and ((prop.confidences > 0) & (prop.confidences < 1)).all()
    shared = {id(p) for p in (tiny_target.embed_tokens.weight, tiny_target.lm_head.weight)}
    assert not shared & {id(p) for p in d.parameters()}
    assert 0 < d.num_parameters() == sum(p.numel() for p in d.parameters())
    assert d.sequential_passes(gamma) >= 1


@pytest.mark.parametrize("name", NAMES)
def test_rollback_reproduces_proposals(tiny_target, ids, name, dr):
    d = dr.make(tiny_target, name)
    run = dr.run(tiny_target, d, ids)
    cut = 12
    base = d.consume(d.init_state(2), ids[:, :cut], run.hidden[:, :cut])
    first = d.propose(base, ids[:, cut], GREEDY)
    longer = d.consume(base, ids[:, cut:18], run.hidden[:, cut:18])  # e.g. speculative positions
    back = d.rollback(longer, cut)
    again = d.propose(back, ids[:, cut], GREEDY)
    assert torch.equal(first.tokens, again.tokens)
    torch.testing.assert_close(first.logits, again.logits, rtol=0, atol=0)
    with pytest.raises(DrafterError, match="rollback"):
        d.rollback(base, cut + 1)


@pytest.mark.parametrize("name", NAMES)
def test_chunked_consume_equals_one_call(tiny_target, ids, name, dr):
    d = dr.make(tiny_target, name)
    run = dr.run(tiny_target, d, ids)
    one = d.consume(d.init_state(2), ids[:, :15], run.hidden[:, :15])
    parts = d.consume(d.init_state(2), ids[:, :6], run.hidden[:, :6])
    parts = d.consume(parts, ids[:, 6:15], run.hidden[:, 6:15])
    torch.testing.assert_close(d.propose(one, ids[:, 15], GREEDY).logits, d.propose(parts, ids[:, 15], GREEDY).logits)


@pytest.mark.parametrize("name", NAMES)
def test_training_matches_inference(tiny_target, ids, name, dr):
    """Teacher-forced training logits at anchor a equal the engine path (consume + propose) when the
    data continues with the greedy drafts (DFlash2: on the candidates it drafts among); MTP's deeper
    steps differ by design (see mtp.py)."""
    d = dr.make(tiny_target, name)
    a = 11
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :a], run.hidden[:, :a])
    prop = d.propose(state, ids[:, a], GREEDY)
    gamma = prop.tokens.shape[1]
    seq = torch.cat([ids[:, : a + 1], prop.tokens], dim=1)  # data = context, anchor, the drafts
    batch = dr.run(tiny_target, d, seq).batch(anchors=torch.full((2, 1), a))
    out = d.training_forward(batch)
    checked = 1 if name == "mtp" else gamma
    drafted = prop.logits[:, :checked].isfinite()  # DFlash2 drafts among its candidates only (-inf elsewhere)
    assert drafted.all() or name == "dflash2"
    torch.testing.assert_close(out.draft_logits[:, :checked][drafted], prop.logits[:, :checked][drafted],
                               rtol=1e-4, atol=1e-4)
    assert out.valid.sum(1).tolist() == [gamma, gamma]
    assert torch.equal(out.target_tokens, prop.tokens)


def test_layer_ids_resolve_in_one_place():
    """The data stage (before any weights load) and build_drafter read the same resolution."""
    from components.drafters.registry import resolve_layer_ids

    for name in ("dspark", "eagle3", "medusa"):
        cfg = DrafterConfig(name=name)
        for depth in (4, 8, 36):
            assert resolve_layer_ids(cfg, depth) == DRAFTERS[name].default_layer_ids(depth, cfg)
    assert resolve_layer_ids(DrafterConfig(), 36) == [1, 9, 17, 25, 33]  # Qwen3-8B, DSpark's 5 taps
    assert resolve_layer_ids(DrafterConfig(), 8) == [1, 2, 3, 4, 5]
    with pytest.raises(DrafterError, match=r"drafter.layer_ids \[0, 9\]: \[9\] out of range .* 8 layers"):
        resolve_layer_ids(DrafterConfig(layer_ids=[0, 9]), 8)


def test_num_speculative_tokens_past_the_block_is_refused_at_build(tiny_target, dr):
    assert dr.make(tiny_target, "dflash", block_size=4).num_speculative_tokens == 3  # anchor slot is no draft
    with pytest.raises(DrafterError, match=r"drafter.num_speculative_tokens: 5 is not in 1..4 .*block_size 4"):
        dr.make(tiny_target, "dspark", block_size=4, num_speculative_tokens=5)
    assert dr.make(tiny_target, "eagle3", num_speculative_tokens=9).num_speculative_tokens == 9  # no block bound
