"""Round simulation without the frozen target head: tokens-only forwards, same rounds as the full
forward, one shared block-token helper, and ``Rounds.extend``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.config import DrafterConfig
from components.drafters import build_drafter
from components.drafters.base import DrafterError, SharedParts, block_targets, block_tokens
from components.losses import build_loss
from components.losses.onpolicy import greedy_accepted
from components.training import collate, evaluate_records
from components.training.objectives import ObjectiveContext, build_objective
from components.training.rounds import Rounds, anchor_tensor, simulate_rounds
from tests.components.training.test_objectives import DRAFTERS, _planted_batch
from tests.components.training.test_training_steps import _record

ALL_DRAFTERS = {**DRAFTERS, "medusa": DrafterConfig(name="medusa", medusa_heads=3),
                "mtp": DrafterConfig(name="mtp", mtp_depth=2)}


@pytest.fixture(scope="module")
def records(tiny_target):
    torch.manual_seed(0)
    ids = build_drafter(DRAFTERS["dspark"], tiny_target).layer_ids
    return [_record(tiny_target, ids, n, 3, i, "float16") for i, n in enumerate([20, 16, 18])]


def _reference_rounds(drafter, batch) -> Rounds:
    """The simulation as it was before the tokens-only path: a full ``training_forward`` (with
    target logits) at every response position, then the same walk from the first response token."""
    b, t = batch.input_ids.shape
    pos = torch.arange(t - 1).expand(b, -1)
    pos = torch.where(batch.loss_mask.gather(1, pos + 1), pos, torch.full_like(pos, -1))
    with torch.no_grad():
        out = drafter.eval().training_forward(dataclasses.replace(batch, anchors=pos))
    assert out.target_logits is not None
    m = greedy_accepted(out.draft_logits, out.target_tokens, out.valid).view(b, -1)
    r = out.valid.sum(1).view(b, -1)
    rounds = Rounds([], [], [])
    for row in range(b):
        a, anchors, accepted, reach = int(batch.loss_mask[row].int().argmax()), [], [], []
        while 0 <= a < t - 1 and int(r[row, a]) > 0:
            anchors.append(a)
            accepted.append(int(m[row, a]))
            reach.append(int(r[row, a]))
            a += accepted[-1] + 1
        rounds.extend(Rounds([anchors], [accepted], [reach]))
    return rounds


@pytest.mark.parametrize("name", sorted(ALL_DRAFTERS))
def test_tokens_only_forward_equals_the_full_forward_without_target_logits(name, tiny_target, records):
    torch.manual_seed(3)
    drafter = build_drafter(ALL_DRAFTERS[name], tiny_target).eval()
    batch = collate(records)
    anchors = torch.tensor([[2, 7, 11, -1], [3, 5, 14, 15], [0, 9, 16, -1]])
    with torch.no_grad():
        full = drafter.training_forward(dataclasses.replace(batch, anchors=anchors))
        lean = drafter.training_forward(dataclasses.replace(batch, anchors=anchors), targets=False)
    assert lean.target_logits is None and full.target_logits is not None
    torch.testing.assert_close(lean.draft_logits, full.draft_logits, rtol=0, atol=0)
    assert torch.equal(lean.target_tokens, full.target_tokens) and torch.equal(lean.valid, full.valid)
    with pytest.raises(DrafterError, match="targets=False"):
        lean.loss_inputs()


@pytest.mark.parametrize("name", ["dspark", "dflash", "eagle3"])
def test_opd_simulation_gives_the_same_rounds_as_the_full_forward(name, tiny_target, records):
    torch.manual_seed(1)
    drafter = build_drafter(DRAFTERS[name], tiny_target).eval()
    batch = _planted_batch(drafter, records)
    want = _reference_rounds(drafter, batch)
    got = simulate_rounds(drafter, batch, chunk=5)
    assert (got.anchors, got.accepted, got.reachable) == (want.anchors, want.accepted, want.reachable)
    assert sum(map(sum, got.accepted)) >= 6  # the planted drafts were accepted: a non-trivial check
    # the OPD objective trains exactly the blocks at these round starts
    objective = build_objective("opd", drafter, build_loss("opd"), {"max_anchors": 50}, ObjectiveContext(tiny_target))
    gen = torch.Generator().manual_seed(0)
    assert torch.equal(anchor_tensor(got.anchors, 50, gen), anchor_tensor(want.anchors, 50))
    loss, out = objective(batch, torch.Generator().manual_seed(0))
    assert torch.isfinite(loss) and float(out.terms["sim_tau"]) == pytest.approx(want.tau())


def test_block_tokens_are_the_targets_tokens_and_validity(tiny_target, records):
    batch = collate(records)
    anchors = torch.tensor([[0, 15, 18, -1], [2, 13, 14, -1], [4, 6, 16, 17]])
    tokens, valid = block_tokens(batch, anchors, 4)  # [B, A, γ]
    logits, tokens2, valid2 = block_targets(batch, anchors, 4, SharedParts.of(tiny_target))
    assert torch.equal(tokens.view(-1, 4), tokens2) and torch.equal(valid.view(-1, 4), valid2)
    assert logits is not None and logits.shape == (12, 4, tiny_target.vocab_size)
    assert block_targets(batch, anchors, 4, SharedParts.of(tiny_target), logits=False)[0] is None
    assert not valid[0, 3].any() and not valid[1, 3].any()  # unused anchors
    assert valid[0, 1].tolist() == [True, True, True, True]  # 15 → 16..19 inside a 20-token row
    assert valid[0, 2].tolist() == [True, False, False, False]  # past the end, prefix-closed
    ids = batch.input_ids
    assert tokens[2, 1].tolist() == ids[2, 7:11].tolist()
    assert (tokens[~valid] == 0).all()
    # each position read once (the blocks at 13 and 14 overlap): the head on every block's own positions
    shared = SharedParts.of(tiny_target)
    pos = (anchors.clamp_min(0).unsqueeze(-1) + torch.arange(4)).clamp_max(ids.shape[1] - 1)  # [B, A, γ]
    with torch.no_grad():
        want = shared.lm_head(shared.final_norm(batch.last_hidden[torch.arange(3).view(3, 1, 1), pos]))
    torch.testing.assert_close(logits, want.view(12, 4, -1), rtol=1e-5, atol=1e-5)


def test_rounds_extend_and_evaluation_merge_batches(tiny_target, records):
    merged = Rounds([[1, 4]], [[2, 0]], [[3, 3]]).extend(Rounds([[2]], [[1]], [[2]]))
    assert (merged.anchors, merged.accepted, merged.reachable) == ([[1, 4], [2]], [[2, 0], [1]], [[3, 3], [2]])
    assert merged.tau() == pytest.approx((3 + 3) / 3)
    torch.manual_seed(2)
    drafter = build_drafter(DRAFTERS["dspark"], tiny_target)
    ev = evaluate_records(drafter, build_loss("tv_ce_confidence"), records, batch_size=2)
    whole = simulate_rounds(drafter, collate(records[:2])).extend(simulate_rounds(drafter, collate(records[2:])))
    assert ev["sim_tau"] == pytest.approx(whole.tau()) and ev["rounds"] == sum(map(len, whole.accepted))
