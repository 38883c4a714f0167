"""ReTrace-style rejected-suffix reuse: the recycle gate starts as a no-op, the engine's next
block reads what the retrace objective trains (same alignment, same correction signal), the
recycled drafts last one round, the objective trains the gate, the engines stay lossless, and
drafters without the gate are refused by name."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.config import DrafterConfig, TrainConfig
from components.drafters import DraftBatch, DrafterError, build_drafter
from components.drafters.capabilities import Capability, CapabilityError, has
from components.engine import SpeculativeEngine, target_only_generate
from components.engine.batch import BatchEngine, Request
from components.losses import build_loss
from components.spec.sampling import GREEDY, SamplingParams
from components.training import collate, new_train_state, train_step
from components.training.objectives import ObjectiveContext, build_objective
from tests.components.training.test_training_steps import _record, first_step_descends

CONFIGS = {
    "dspark": DrafterConfig(name="dspark", block_size=4, num_anchors=8, markov_rank=8, num_layers=1),
    "dflash": DrafterConfig(name="dflash", block_size=4, num_anchors=8, num_layers=1),
}
LOSSES = {"dspark": "tv_ce_confidence", "dflash": "kl"}
TEXTS = ["def main(args):\n    ", "import os\nimport sys\n", "class Foo:\n    def __init__(self"]


def _drafter(target, name: str, retrace: bool = True, gate: float = 0.5):
    """A random drafter; with the gate, random non-zero projections (a fresh gate is a no-op)."""
    torch.manual_seed(0)
    d = build_drafter(dataclasses.replace(CONFIGS[name], retrace=retrace), target).eval()
    if retrace and gate:
        with torch.no_grad():
            d.recycle.state_proj.weight.normal_(0, gate)
            d.recycle.signal_proj.weight.normal_(0, gate)
    return d


def _objective(target, drafter, **params):
    return build_objective("retrace", drafter, build_loss(LOSSES[drafter.cfg.name]), params, ObjectiveContext(target))


@pytest.fixture(scope="module")
def records(tiny_target):
    ids = _drafter(tiny_target, "dspark").layer_ids
    return [_record(tiny_target, ids, n, 3, i, "float16") for i, n in enumerate([20, 16, 18])]


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_next_block_reads_what_the_objective_trains(tiny_target, name):
    """Round at anchor a drafts d; the target corrects draft m+1 to c. The engine's next proposal
    (consume x..d_m, c pending; with_recycled) equals the objective's second block at a+m+1."""
    d = _drafter(tiny_target, name)
    prompt = torch.tensor([tiny_target.tokenizer(TEXTS[0])["input_ids"]])
    a, m = prompt.shape[1] - 1, 1
    hidden = tiny_target.forward(prompt, layer_ids=d.layer_ids).hidden
    state = d.consume(d.init_state(1), prompt[:, :a], hidden[:, :a])
    prop = d.propose(state, prompt[:, a], GREEDY)
    c = (prop.tokens[:, m] + 1) % tiny_target.vocab_size  # the target's correction: not the draft
    seq = torch.cat([prompt, prop.tokens[:, :m], c[:, None]], dim=1)
    out = tiny_target.forward(seq, layer_ids=d.layer_ids)
    committed = d.consume(state, seq[:, a:a + m + 1], out.hidden[:, a:a + m + 1])  # x_a, d_1..d_m
    nxt = d.propose(d.with_recycled(committed, prop, m, c), c, GREEDY)
    plain = d.propose(committed, c, GREEDY)
    assert (nxt.logits - plain.logits).abs().max() > 1e-3  # the recycled drafts matter
    seq = torch.cat([seq, nxt.tokens], dim=1)  # the data continues with the drafts (Markov head: teacher-forced)
    out = tiny_target.forward(seq, layer_ids=d.layer_ids)

    obj = _objective(tiny_target, d)
    seen = {}
    real = obj.loss
    obj.loss = lambda inputs: seen.setdefault("logits", inputs.draft_logits) is not None and real(inputs)
    batch = DraftBatch(seq, out.hidden, out.last_hidden, anchors=torch.tensor([[a]]))
    obj(batch)
    torch.testing.assert_close(seen["logits"], nxt.logits, rtol=1e-4, atol=1e-4)


def test_a_fresh_gate_is_a_no_op_and_recycling_lasts_one_round(tiny_target):
    base = _drafter(tiny_target, "dspark", retrace=False)
    fresh = _drafter(tiny_target, "dspark", gate=0.0)
    fresh.load_state_dict(base.state_dict(), strict=False)  # the chain loads the previous drafter this way
    ids = torch.tensor([tiny_target.tokenizer(TEXTS[1])["input_ids"]])
    hidden = tiny_target.forward(ids, layer_ids=base.layer_ids).hidden
    state = fresh.consume(fresh.init_state(1), ids[:, :-2], hidden[:, :-2])
    prop = fresh.propose(state, ids[:, -2], GREEDY)
    rec = fresh.with_recycled(state, prop, 0, ids[:, -1])
    assert rec.recycled is not None and bool(rec.recycled.present.any())
    torch.testing.assert_close(fresh.propose(rec, ids[:, -1], GREEDY).logits,
                               base.propose(state, ids[:, -1], GREEDY).logits, rtol=0, atol=0)
    assert fresh.with_recycled(state, prop, prop.tokens.shape[1], ids[:, -1]).recycled is None  # full accept
    for dropped in (fresh.consume(rec, ids[:, -1:], hidden[:, -1:]), fresh.rollback(rec, state.length),
                    fresh.consume_own(rec, prop.states)):
        assert dropped.recycled is None


def test_carryover_rows_keep_the_recycled_drafts(tiny_target):
    """A drafter with both: attaching (or clearing) carryover rows keeps what ``with_recycled``
    attached, whichever comes first."""
    torch.manual_seed(0)
    d = build_drafter(dataclasses.replace(CONFIGS["dspark"], retrace=True, carryover=True), tiny_target).eval()
    ids = torch.tensor([tiny_target.tokenizer(TEXTS[2])["input_ids"]])
    hidden = tiny_target.forward(ids, layer_ids=d.layer_ids).hidden
    state = d.consume(d.init_state(1), ids[:, :-3], hidden[:, :-3])
    rec = d.with_recycled(state, d.propose(state, ids[:, -3], GREEDY), 0, ids[:, -2])
    carried = d.with_carry(rec, hidden[:, -2:], state.length)
    assert carried.carry_rows == 2 and carried.recycled is rec.recycled
    assert d.with_carry(carried, hidden[:, :0], state.length).recycled is rec.recycled


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_objective_trains_the_gate(tiny_target, records, name):
    d = _drafter(tiny_target, name, gate=0.0).train()
    obj = _objective(tiny_target, d, max_anchors=4)
    batch = collate(records)
    batch.anchors = torch.tensor([[3, 6, 9, 12]] * 3)
    loss, out = obj(batch)
    loss.backward()
    assert d.recycle.state_proj.weight.grad.abs().sum() > 0 and d.recycle.signal_proj.weight.grad.abs().sum() > 0
    assert 0 < float(out.terms["retrace_fraction"]) <= 1 and float(out.terms["retrace_blocks"]) > 0
    d.zero_grad()
    state = new_train_state(d, TrainConfig(lr=3e-3, warmup_steps=1), 10, seed=1, objective=obj)
    metrics = [first_step_descends(state, batch, seed=0)] + [train_step(state, batch) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor([m["train/loss"] for m in metrics])))
    assert d.recycle.state_proj.weight.abs().sum() > 0


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_engines_lossless(tiny_target, name):
    d = _drafter(tiny_target, name)
    prompts = [tiny_target.tokenizer(t)["input_ids"] for t in TEXTS]
    refs = [target_only_generate(tiny_target, p, 20).tokens for p in prompts]
    calls = [0]
    inner = d.with_recycled

    def counted(*args):
        calls[0] += 1
        return inner(*args)

    d.with_recycled = counted
    assert [SpeculativeEngine(tiny_target, d, rule="greedy").generate(p, 20).tokens for p in prompts] == refs
    assert calls[0] > 0
    assert [r.tokens for r in BatchEngine(tiny_target, d, max_batch_size=2).generate(Request(p, 20) for p in prompts)] == refs
    sampling = SamplingParams(temperature=0.9)
    reqs = [Request(p, 16, sampling=sampling, seed=3 + i, rule="speculative") for i, p in enumerate(prompts)]
    alone = SpeculativeEngine(tiny_target, d, rule="speculative")
    expected = [alone.generate(r.prompt_ids, 16, sampling, r.seed).tokens for r in reqs]
    assert [r.tokens for r in BatchEngine(tiny_target, d, max_batch_size=3).generate(reqs)] == expected


def test_refusals_name_what_to_fix(tiny_target, records):
    plain = _drafter(tiny_target, "dspark", retrace=False)
    assert not has(plain, Capability.RECYCLES) and has(_drafter(tiny_target, "dspark"), Capability.RECYCLES)
    with pytest.raises(CapabilityError, match="objective 'retrace' needs capability recycles.*drafter.retrace=true"):
        _objective(tiny_target, plain)
    ids = torch.tensor([[5, 6, 7]])
    hidden = tiny_target.forward(ids, layer_ids=plain.layer_ids).hidden
    state = plain.consume(plain.init_state(1), ids[:, :2], hidden[:, :2])
    with pytest.raises(DrafterError, match="no recycle gate.*drafter.retrace=true"):
        plain.with_recycled(state, plain.propose(state, ids[:, 2], GREEDY), 0, ids[:, 2])
    for name in ("dedit", "hspec"):
        with pytest.raises(DrafterError, match="drafter.retrace=false"):
            build_drafter(DrafterConfig(name=name, num_layers=1, retrace=True), tiny_target)
