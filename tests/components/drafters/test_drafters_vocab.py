"""A reduced draft vocabulary: the choice (frequency, ties, specials), the d2t/t2d convention,
training outputs in draft ids against the restricted target, proposals in target ids over V,
propose_many, the int8 head over the reduced rows, and checkpoints (round trip, refusals)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from components.config import DrafterConfig
from components.drafters import (
    DrafterError,
    DraftVocab,
    build_drafter,
    load_drafter,
    save_drafter,
    select_draft_vocab,
    with_draft_vocab,
)
from components.drafters.capabilities import Capability, has
from components.drafters.quantize import Int8Linear, int8_lm_head
from components.drafters.registry import target_special_ids
from components.spec.sampling import GREEDY, SamplingParams

NAMES = ["dspark", "dflash", "eagle3", "medusa", "mtp"]
DV = 64


def counts_for(target, seed: int = 0) -> torch.Tensor:
    """Distinct random counts [V] (a stand-in for the rollouts' response-token counts)."""
    return torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(seed)).double()


def reduced(target, name: str, size: int = DV, **overrides):
    torch.manual_seed(0)
    cfg = DrafterConfig(name=name, num_anchors=6, num_layers=overrides.pop("num_layers", 2),
                        draft_vocab_size=size, **overrides)
    return build_drafter(cfg, target, counts_for(target)).eval()


# ----------------------------------------------------------------------------- the choice
def test_select_orders_by_count_then_id_and_keeps_specials():
    counts = torch.tensor([5, 9, 9, 0, 7, 9, 1, 0])  # ids 1, 2, 5 tie at 9
    assert select_draft_vocab(counts, 3).tolist() == [1, 2, 5]  # ties: smaller id first
    assert select_draft_vocab(counts, 2).tolist() == [1, 2]
    assert select_draft_vocab(counts, 4).tolist() == [1, 2, 4, 5]
    assert select_draft_vocab(counts, 3, always=[7]).tolist() == [1, 2, 7]  # a never-seen special is in
    assert select_draft_vocab(counts, 3, always=[7, 3, 99, -1]).tolist() == [1, 3, 7]  # out-of-range ids ignored
    with pytest.raises(DrafterError, match="room for the 2 special"):
        select_draft_vocab(counts, 1, always=[3, 7])


def test_the_targets_special_and_stop_tokens_are_always_in(tiny_target):
    specials = target_special_ids(tiny_target)
    tok = tiny_target.tokenizer
    assert {tok.eos_token_id, tok.pad_token_id, tok.mask_token_id} <= set(specials)
    never = torch.ones(tiny_target.vocab_size)
    never[specials] = 0  # the rollouts never produced them
    d = build_drafter(DrafterConfig(name="eagle3", draft_vocab_size=DV), tiny_target, never)
    assert d.vocab.t2d[specials].all()


def test_d2t_holds_offsets_and_t2d_membership():
    vocab = DraftVocab(vocab_size=10, draft_vocab_size=4, hidden_size=3)
    weight = torch.arange(30.0).view(10, 3)
    vocab.assign(torch.tensor([1, 4, 5, 9]), weight)
    assert vocab.d2t.dtype == torch.int64 and vocab.d2t.tolist() == [1, 3, 3, 6]
    draft = torch.arange(4)
    assert (draft + vocab.d2t[draft]).tolist() == [1, 4, 5, 9]  # target = draft + d2t[draft]
    assert vocab.to_target(draft).tolist() == [1, 4, 5, 9]
    assert vocab.t2d.dtype == torch.bool and vocab.t2d.nonzero().flatten().tolist() == [1, 4, 5, 9]
    assert vocab.draft_of().tolist() == [-1, 0, -1, -1, 1, 2, -1, -1, -1, 3]
    assert torch.equal(vocab.head.weight, weight[[1, 4, 5, 9]])  # the target's rows
    wide = vocab.widen(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), float("-inf"))
    assert wide[0, [1, 4, 5, 9]].tolist() == [1, 2, 3, 4] and torch.isinf(wide[0, [0, 2, 3, 6, 7, 8]]).all()
    tokens, valid = vocab.restrict_tokens(torch.tensor([[4, 9, 2, 5]]), torch.tensor([[True, True, True, True]]))
    assert tokens.tolist() == [[1, 3, 0, 0]] and valid.tolist() == [[True, True, False, False]]  # 2 is outside


@pytest.mark.parametrize("size", [-1, 513])
def test_sizes_outside_the_vocabulary_are_refused(tiny_target, size):
    with pytest.raises(DrafterError, match="draft_vocab_size"):
        build_drafter(DrafterConfig(name="eagle3", draft_vocab_size=size), tiny_target)


@pytest.mark.parametrize("size", [None, 0, 512])
def test_none_zero_or_the_full_size_is_the_full_vocabulary(tiny_target, size):
    d = build_drafter(DrafterConfig(name="dflash", draft_vocab_size=size), tiny_target)
    assert d.vocab is None and d.cfg.draft_vocab_size is None and d.readout_size == tiny_target.vocab_size


def test_a_vocabulary_must_be_chosen_before_use(tiny_target, ids, dr, tmp_path):
    d = build_drafter(DrafterConfig(name="dflash", num_layers=1, draft_vocab_size=DV), tiny_target)  # no counts
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :-1], run.hidden[:, :-1])
    with pytest.raises(DrafterError, match="not chosen yet"):
        d.propose(state, ids[:, -1], GREEDY)
    with pytest.raises(DrafterError, match="not chosen yet"):
        save_drafter(d, tmp_path / "d")
    with_draft_vocab(d, tiny_target, counts_for(tiny_target))
    assert d.propose(state, ids[:, -1], GREEDY).tokens.shape == (2, d.num_speculative_tokens)


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("name", NAMES)
def test_training_output_is_over_the_draft_vocabulary(tiny_target, ids, dr, name):
    d = reduced(tiny_target, name)
    batch = dr.run(tiny_target, d, ids).batch()
    out = d.training_forward(batch, torch.Generator().manual_seed(0))
    n, gamma, r = out.draft_logits.shape
    assert r == DV and out.target_logits.shape == (n, gamma, DV) and out.draft_logits.requires_grad
    # the target's logits at the draft vocabulary: its distribution restricted, renormalised by softmax
    full = build_drafter(DrafterConfig(name=name, num_anchors=6, num_layers=2), tiny_target)
    ref = full.eval().training_forward(batch, torch.Generator().manual_seed(0))
    ids_v = d.vocab.target_ids()
    torch.testing.assert_close(out.target_logits, ref.target_logits[..., ids_v])
    p = torch.softmax(ref.target_logits, -1)
    restricted = p[..., ids_v] / p[..., ids_v].sum(-1, keepdim=True)
    torch.testing.assert_close(torch.softmax(out.target_logits, -1), restricted)
    # tokens: draft ids of the data tokens; a block ends at its first data token outside
    assert torch.equal(out.reachable, ref.valid)
    inside = d.vocab.t2d[ref.target_tokens] & ref.valid
    assert torch.equal(out.valid, torch.cumprod(inside.int(), 1).bool())
    assert torch.equal(d.to_target(out.target_tokens)[out.valid], ref.target_tokens[out.valid])
    assert torch.equal(out.checkable(), ref.valid)
    assert bool((ref.valid & ~out.valid).any())  # the fixture data does leave the 64 tokens


def test_the_renormalised_target_is_where_true_acceptance_peaks():
    """Among drafts q supported on the draft vocabulary, the full-vocabulary acceptance
    α = Σ min(p, q) is at most p(draft vocab), reached at q = p restricted and renormalised."""
    gen = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(1000, generator=gen), 0)
    ids = torch.randperm(1000, generator=gen)[:100].sort().values
    mass = p[ids].sum()

    def alpha(q_draft: torch.Tensor) -> torch.Tensor:  # q over the draft vocabulary [100]
        return torch.minimum(p[ids], q_draft).sum()
    torch.testing.assert_close(alpha(p[ids] / mass), mass)
    for _ in range(20):
        assert alpha(torch.softmax(3 * torch.randn(100, generator=gen), 0)) <= mass + 1e-6


def test_the_default_loss_trains_the_draft_head(tiny_target, ids, dr):
    from components.config import TrainConfig
    from components.training.step import build_train_loss

    d = reduced(tiny_target, "dspark").train()
    out = d.training_forward(dr.run(tiny_target, d, ids).batch(), torch.Generator().manual_seed(0))
    lo = build_train_loss(TrainConfig())(out.loss_inputs())  # TV + CE + confidence over the DV tokens
    lo.loss.backward()
    assert torch.isfinite(lo.loss) and d.vocab.head.weight.grad.abs().sum() > 0
    assert 0 < float(lo.tau) and torch.isfinite(lo.alpha).any()


def test_the_draft_head_is_trainable_and_starts_as_the_targets_rows(tiny_target):
    d = reduced(tiny_target, "dspark")
    assert d.vocab.head.weight.requires_grad and d.vocab.head.weight.shape == (DV, tiny_target.hidden_size)
    assert torch.equal(d.vocab.head.weight, tiny_target.lm_head.weight[d.vocab.target_ids()])
    assert d.markov_head.markov_w1.weight.shape[0] == tiny_target.vocab_size  # reads target ids
    assert d.markov_head.markov_w2.weight.shape[0] == DV  # writes draft logits
    assert not d.vocab.d2t.requires_grad and d.num_parameters() > 0


# ----------------------------------------------------------------------------- proposals
@pytest.mark.parametrize("name", NAMES)
def test_proposals_are_target_ids_over_the_full_vocabulary(tiny_target, ids, dr, name):
    d = reduced(tiny_target, name)
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :-1], run.hidden[:, :-1])
    prop = d.propose(state, ids[:, -1], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    v, outside = tiny_target.vocab_size, ~d.vocab.t2d
    assert prop.logits.shape[-1] == prop.probs.shape[-1] == v
    assert d.vocab.t2d[prop.tokens].all()
    assert torch.isinf(prop.logits[..., outside]).all() and (prop.probs[..., outside] == 0).all()
    torch.testing.assert_close(prop.probs.sum(-1), torch.ones(prop.tokens.shape))
    assert (prop.probs.gather(-1, prop.tokens.unsqueeze(-1)) > 0).all()
    greedy = d.propose(state, ids[:, -1], GREEDY)
    assert torch.equal(greedy.tokens, greedy.logits.argmax(-1))  # the argmax over V, ties alike


def test_a_proposal_spreads_into_the_vocabulary_only_when_read(tiny_target, ids, dr):
    from components.drafters.exchange import Proposal
    from components.drafters.vocab import VocabProposal

    d = reduced(tiny_target, "dspark")
    run = dr.run(tiny_target, d, ids)
    state = d.consume(d.init_state(2), ids[:, :-1], run.hidden[:, :-1])
    prop = d.propose(state, ids[:, -1], SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert isinstance(prop, VocabProposal) and prop._logits is None and prop._probs is None
    first = prop.rows(1, 3)  # a row's first drafts: still over DV
    second = prop.rows(1, prop.tokens.shape[1])
    joined = Proposal.concat([first, second])  # DLoop's stages: joined over DV
    assert isinstance(joined, VocabProposal) and joined._logits is None and prop._logits is None
    picked = joined.tokens.clone()
    picked[0, 1] = int((~d.vocab.t2d).nonzero()[0])  # a token outside the draft vocabulary
    log_q = joined.log_q(picked)
    assert joined._logits is None  # in DV
    eager = torch.cat([prop.logits[1:2, :3], prop.logits[1:2]], 1)  # spread now
    assert torch.equal(joined.logits, eager)
    torch.testing.assert_close(log_q, Proposal.log_q(Proposal(joined.tokens, eager, eager), picked))
    assert log_q[0, 1] == float("-inf")
    torch.testing.assert_close(joined.probs, torch.cat([prop.probs[1:2, :3], prop.probs[1:2]], 1))
    assert torch.equal(joined.tokens, torch.cat([prop.tokens[1:2, :3], prop.tokens[1:2]], 1))


@pytest.mark.parametrize("name", NAMES)
def test_training_matches_inference_with_a_draft_vocabulary(tiny_target, ids, dr, name):
    d = reduced(tiny_target, name)
    a = 11
    state = d.consume(d.init_state(2), ids[:, :a], dr.run(tiny_target, d, ids).hidden[:, :a])
    prop = d.propose(state, ids[:, a], GREEDY)
    seq = torch.cat([ids[:, : a + 1], prop.tokens], dim=1)  # the data continues with the drafts
    out = d.training_forward(dr.run(tiny_target, d, seq).batch(anchors=torch.full((2, 1), a)))
    checked = 1 if name == "mtp" else prop.tokens.shape[1]
    torch.testing.assert_close(out.draft_logits[:, :checked], prop.logits[:, :checked, d.vocab.target_ids()],
                               rtol=1e-4, atol=1e-4)
    assert torch.equal(d.to_target(out.target_tokens), prop.tokens) and out.valid.all()


@pytest.mark.parametrize("name", ["dspark", "dflash", "eagle3", "medusa", "mtp"])
def test_propose_many_equals_propose_per_row(tiny_target, ids, dr, name):
    d = reduced(tiny_target, name)
    assert has(d, Capability.BATCHED_PROPOSE)
    run = dr.run(tiny_target, d, ids)
    states = [d.consume(d.init_state(1), ids[i:i + 1, :n], run.hidden[i:i + 1, :n]) for i, n in enumerate((9, 14))]
    last = torch.stack([ids[0, 9], ids[1, 14]])
    for sampling in (GREEDY, SamplingParams(temperature=0.8)):
        many = d.propose_many(states, last, sampling, generators=[torch.Generator().manual_seed(i) for i in (1, 2)])
        for i, state in enumerate(states):
            one = d.propose(state, last[i:i + 1], sampling, torch.Generator().manual_seed(i + 1))
            assert torch.equal(many[i].tokens, one.tokens)
            torch.testing.assert_close(many[i].probs, one.probs)
            assert many[i].logits.shape[-1] == tiny_target.vocab_size


def test_causal_tree_head_scores_target_ids_and_never_outside(tiny_target, ids, dr):
    d = reduced(tiny_target, "dspark")
    state = d.consume(d.init_state(1), ids[:1, :12], dr.run(tiny_target, d, ids).hidden[:1, :12])
    prop = d.propose(state, ids[:1, 12], GREEDY)
    head = d.causal_tree_head(prop.states[0])
    inside, outside = d.vocab.target_ids()[:3], (~d.vocab.t2d).nonzero().flatten()[:2]
    scores = head(torch.zeros(1, prop.tokens.shape[1] + 1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                  torch.cat([inside, outside])[None])
    assert torch.isfinite(scores[0, :3]).all() and torch.isinf(scores[0, 3:]).all()


def test_int8_quantizes_the_reduced_head(tiny_target, ids, dr):
    d = reduced(tiny_target, "dspark")
    float_head = d.vocab.head
    int8_lm_head(d)
    assert isinstance(d.readout_head, Int8Linear) and d.readout_head.out_features == DV
    assert d.vocab.head is float_head and d.shared.lm_head is tiny_target.lm_head  # saved weights, target untouched
    state = d.consume(d.init_state(2), ids[:, :-1], dr.run(tiny_target, d, ids).hidden[:, :-1])
    prop = d.propose(state, ids[:, -1], GREEDY)
    assert d.vocab.t2d[prop.tokens].all() and prop.logits.shape[-1] == tiny_target.vocab_size


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_checkpoint_round_trip(tiny_target, ids, dr, tmp_path, name):
    d = reduced(tiny_target, name)
    with torch.no_grad():
        for p in d.parameters():
            p.add_(0.01 * torch.randn_like(p))
    path = save_drafter(d, tmp_path / name)
    raw = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    assert raw["draft_vocab_size"] == DV
    assert tensors["vocab.d2t"].dtype == torch.int64 and tensors["vocab.d2t"].shape == (DV,)
    assert tensors["vocab.t2d"].dtype == torch.bool and tensors["vocab.t2d"].shape == (tiny_target.vocab_size,)
    loaded = load_drafter(path, tiny_target).eval()
    assert loaded.spec == d.spec and torch.equal(loaded.vocab.d2t, d.vocab.d2t)
    assert torch.equal(loaded.vocab.t2d, d.vocab.t2d)
    batch = dr.run(tiny_target, d, ids).batch(anchors=torch.tensor([[3, 9], [5, 11]]))
    assert torch.equal(d.training_forward(batch).draft_logits, loaded.training_forward(batch).draft_logits)


def test_mismatched_sizes_are_refused(tiny_target, tmp_path):
    path = save_drafter(reduced(tiny_target, "eagle3"), tmp_path / "d")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "draft_vocab_size": DV * 2}))
    with pytest.raises(DrafterError, match=r"shape mismatch .*vocab.d2t: checkpoint \(64,\), drafter \(128,\)"):
        load_drafter(path, tiny_target)
    (path / "config.json").write_text(json.dumps({**raw, "draft_vocab_size": None}))
    with pytest.raises(DrafterError, match=r"unexpected weights \['vocab.d2t', 'vocab.head.weight', 'vocab.t2d'\]"):
        load_drafter(path, tiny_target)


def test_disagreeing_maps_are_refused(tiny_target, tmp_path):
    path = save_drafter(reduced(tiny_target, "eagle3"), tmp_path / "d")
    tensors = load_file(str(path / "model.safetensors"))
    t2d = tensors["vocab.t2d"].clone()
    t2d[(~t2d).nonzero()[0]] = True  # one member too many
    save_file({**tensors, "vocab.t2d": t2d}, str(path / "model.safetensors"))
    with pytest.raises(DrafterError, match="maps disagree"):
        load_drafter(path, tiny_target)
    d2t = tensors["vocab.d2t"].clone()
    d2t[1] = -1  # draft 1 → target 0, below draft 0's target: not sorted
    save_file({**tensors, "vocab.d2t": d2t}, str(path / "model.safetensors"))
    with pytest.raises(DrafterError, match="sorted, distinct target ids"):
        load_drafter(path, tiny_target)
