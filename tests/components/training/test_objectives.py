"""Objectives in-process (no Ray): round simulation vs free-running drafting, OPD loss, chains."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.config import ConfigError, DrafterConfig, TrainConfig
from components.drafters import build_drafter
from components.drafters.capabilities import Capability, CapabilityError
from components.losses import build_loss
from components.losses.common import LossInputs
from components.losses.edr import round_values
from components.losses.overlap import alpha_tv_reference
from components.spec.sampling import GREEDY
from components.training import collate, new_train_state, train_step
from components.training.chain import resolve_chain
from components.training.objectives import OBJECTIVES, ObjectiveContext, build_objective
from components.training.objectives.edr import every_anchor
from components.training.rounds import anchor_tensor, simulate_rounds
from tests.components.training.test_training_steps import _record, first_step_descends

DRAFTERS = {
    "dspark": DrafterConfig(name="dspark", block_size=4, num_anchors=8, markov_rank=8),
    "dflash": DrafterConfig(name="dflash", block_size=4, num_anchors=8),
    "eagle3": DrafterConfig(name="eagle3", ttt_steps=3),
}


def _free_running_rounds(drafter, batch, row: int) -> tuple[list[int], list[int]]:
    """Ground truth: rounds walked with the engine protocol (consume/propose), greedy."""
    ids, hidden, mask = batch.input_ids[row:row + 1], batch.hidden[row:row + 1], batch.loss_mask[row]
    t = int(mask.nonzero().max()) + 1  # real length
    a = int(mask.int().argmax())
    anchors, accepted = [], []
    while a < t - 1:
        state = drafter.consume(drafter.init_state(1), ids[:, :a], hidden[:, :a])
        gamma = min(drafter.num_speculative_tokens, t - 1 - a)
        prop = drafter.propose(state, ids[:, a], GREEDY, num_speculative_tokens=drafter.num_speculative_tokens)
        m = 0
        while m < gamma and int(prop.tokens[0, m]) == int(ids[0, a + 1 + m]):
            m += 1
        anchors.append(a)
        accepted.append(m)
        a += m + 1
    return anchors, accepted


def _planted_batch(drafter, records):
    """Records whose tokens copy the drafter's own greedy drafts at some anchors, so rounds accept."""
    batch = collate(records)
    for row in range(batch.input_ids.shape[0]):
        for a in (4, 9):
            state = drafter.consume(drafter.init_state(1), batch.input_ids[row:row + 1, :a], batch.hidden[row:row + 1, :a])
            prop = drafter.propose(state, batch.input_ids[row:row + 1, a], GREEDY)
            k = min(3, prop.tokens.shape[1])
            batch.input_ids[row, a + 1:a + 1 + k] = prop.tokens[0, :k]
    return batch


@pytest.fixture(scope="module")
def records(tiny_target):
    torch.manual_seed(0)
    ids = build_drafter(DRAFTERS["dspark"], tiny_target).layer_ids
    return [_record(tiny_target, ids, n, 3, i, "float16") for i, n in enumerate([20, 16, 18])]


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_simulated_rounds_equal_free_running_greedy_drafting(name, tiny_target, records):
    torch.manual_seed(1)
    drafter = build_drafter(DRAFTERS[name], tiny_target).eval()
    batch = _planted_batch(drafter, records)
    rounds = simulate_rounds(drafter, batch, chunk=5)
    for row in range(batch.input_ids.shape[0]):
        anchors, accepted = _free_running_rounds(drafter, batch, row)
        assert rounds.anchors[row] == anchors and rounds.accepted[row] == accepted, (row, rounds, anchors, accepted)
    assert sum(map(sum, rounds.accepted)) >= 6  # the planted drafts were accepted
    assert rounds.tau() > 1.0 and 0 < rounds.position_acceptance(drafter.num_speculative_tokens)[0] <= 1


def test_anchor_tensor_pads_and_subsamples():
    out = anchor_tensor([[1, 5, 9, 12], [3]], limit=2, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 2) and out[1].tolist() == [3, -1]
    assert set(out[0].tolist()) <= {1, 5, 9, 12} and out[0, 0] < out[0, 1]


def test_opd_loss_splits_trajectory_and_rejected_streams():
    torch.manual_seed(0)
    target = torch.randn(1, 3, 5, dtype=torch.float64)
    draft = torch.randn(1, 3, 5, dtype=torch.float64, requires_grad=True)
    tokens = draft.detach().argmax(-1).clone()
    tokens[0, 1] = (tokens[0, 1] + 1) % 5  # draft 2 is rejected: m = 1
    out = build_loss("opd", decay=0.5)(LossInputs(draft, target, tokens, torch.ones(1, 3, dtype=torch.bool)))
    lp, lq = torch.log_softmax(target, -1), torch.log_softmax(draft, -1)
    fwd = (lp.exp() * (lp - lq)).sum(-1)[0]  # KL(p‖q) per position
    rev = (lq.exp() * (lq - lp)).sum(-1)[0]  # KL(q‖p)
    expected = (fwd[0] + fwd[1] + 0.5 * rev[1]) / (2 + 0.5)  # positions 1..m+1, rejected at m+1
    torch.testing.assert_close(out.loss, expected)
    assert float(out.terms["greedy_accepted"]) == 1.0
    out.loss.backward()
    assert draft.grad[0, 2].abs().sum() == 0 and draft.grad[0, :2].abs().sum() > 0  # position 3 never reached


@pytest.mark.parametrize("name", ["dspark", "eagle3"])
def test_opd_objective_trains_every_drafter_kind(name, tiny_target, records):
    torch.manual_seed(0)
    drafter = build_drafter(DRAFTERS[name], tiny_target)
    objective = build_objective("opd", drafter, build_loss("opd"), {"max_anchors": 4}, ObjectiveContext(tiny_target))
    state = new_train_state(drafter, TrainConfig(lr=3e-3, warmup_steps=1), 10, seed=1, objective=objective)
    batch = collate(records)
    metrics = [first_step_descends(state, batch, seed=0)] + [train_step(state, batch) for _ in range(5)]
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)
    assert all(m["train/sim_tau"] >= 1.0 for m in metrics)  # τ counts the bonus/correction token


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_edr_objective_is_the_expected_rounds_at_every_anchor_and_trains(name, tiny_target, records):
    """Its loss (confidence off) is Σ E[#rounds] / Σ anchors over the rows, E from 1 − TV of the
    blocks at every anchor from the first response token on; its first step descends."""
    torch.manual_seed(0)
    drafter = build_drafter(DRAFTERS[name], tiny_target)
    objective = build_objective("edr", drafter, build_loss("kl"), {"confidence_weight": 0.0}, ObjectiveContext(tiny_target))
    batch = collate(records)
    anchors, lengths = every_anchor(batch.loss_mask)
    first = batch.loss_mask.int().argmax(1)
    for row, (a, n) in enumerate(zip(anchors, lengths)):
        assert a[:n].tolist() == list(range(int(first[row]), int(first[row]) + int(n))) and bool((a[n:] == -1).all())
    with torch.no_grad():
        out = drafter.training_forward(dataclasses.replace(batch, anchors=anchors))
        _, tv = alpha_tv_reference(torch.softmax(out.target_logits.double(), -1), out.draft_logits.double())
        accept = torch.where(out.valid, 1 - tv, 0.0).view(*anchors.shape, -1)
        expected = round_values(accept, lengths)[0][:, 0].sum() / lengths.sum()
        loss, metrics = objective(batch)
    assert float(loss) == pytest.approx(float(expected), rel=1e-4)
    assert float(metrics.terms["sim_tau"]) == pytest.approx(float(1 / expected), rel=1e-4)
    state = new_train_state(drafter, TrainConfig(lr=3e-3, warmup_steps=1), 10, seed=1, objective=objective)
    metrics = [first_step_descends(state, batch, seed=0)] + [train_step(state, batch) for _ in range(2)]
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)


def test_chain_resolves_losses_and_overrides_and_names_mistakes():
    tc = TrainConfig(objectives=["offline", "opd"], per_objective={"opd": {"lr": 1e-4, "max_anchors": 4}})
    offline, opd = resolve_chain(tc)
    assert (offline.train.loss, offline.train.lr, offline.run_name) == ("tv_ce_confidence", tc.lr, "offline")
    assert (opd.train.loss, opd.train.lr, opd.params["max_anchors"], opd.run_name) == ("opd", 1e-4, 4, "opd")
    assert resolve_chain(dataclasses.replace(tc, run_name="x"))[1].run_name == "x-opd"
    bad = {
        "train.objectives[1]: unknown objective 'opdd'": {"objectives": ["offline", "opdd"]},
        "train.per_objective: ['dloop'] not in": {"per_objective": {"dloop": {}}},
        "train.per_objective.opd: objective 'opd': unknown parameter": {"per_objective": {"opd": {"max_anchor": 3}}},
        "apply to the whole train stage": {"per_objective": {"opd": {"data_dir": "x"}}},
        "names an objective twice": {"objectives": ["opd", "opd"]},
    }
    for message, change in bad.items():
        with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
            resolve_chain(dataclasses.replace(tc, **change))
    assert {"offline", "opd"} <= set(OBJECTIVES)


# What each objective declares it needs of its drafter; every other objective needs nothing
# beyond the core interface.
REQUIRES = {"dloop": (Capability.BLOCK_INTERNALS, Capability.OWN_CONTEXT),
            "carryover": (Capability.BLOCK_INTERNALS, Capability.CARRYOVER),
            "retrace": (Capability.BLOCK_INTERNALS, Capability.RECYCLES),
            "edr": (Capability.BLOCK_INTERNALS,),
            "base_anchored": (Capability.BASE_LOGITS,)}


def _declaring(target, monkeypatch, keep):
    """A DSpark drafter with E_carry and the recycle gate whose ``capabilities()`` declares only what ``keep(declared)``
    returns: it still has every method, so only the declaration can make an objective refuse it."""
    torch.manual_seed(0)
    drafter = build_drafter(dataclasses.replace(DRAFTERS["dspark"], carryover=True, retrace=True), target)
    declared = frozenset(keep(drafter.capabilities()))
    monkeypatch.setattr(drafter, "capabilities", lambda: declared)
    return drafter


@pytest.mark.parametrize("name, capability", [(n, c) for n, caps in REQUIRES.items() for c in caps],
                         ids=lambda v: getattr(v, "value", v))
def test_an_objective_refuses_a_drafter_without_a_capability_it_requires(name, capability, tiny_target, monkeypatch):
    drafter = _declaring(tiny_target, monkeypatch, lambda caps: caps - {capability})
    with pytest.raises(CapabilityError, match=rf"objective '{name}' needs capability {capability.value}; "
                                              r"drafter 'dspark' \(DSparkDrafter\)"):
        build_objective(name, drafter, build_loss("kl"), context=ObjectiveContext(tiny_target))


@pytest.mark.parametrize("name", sorted(OBJECTIVES))
def test_every_objective_builds_with_exactly_what_it_requires(name, tiny_target, monkeypatch):
    drafter = _declaring(tiny_target, monkeypatch, lambda caps: caps & set(REQUIRES.get(name, ())))
    assert build_objective(name, drafter, build_loss("kl"), context=ObjectiveContext(tiny_target)).drafter is drafter
