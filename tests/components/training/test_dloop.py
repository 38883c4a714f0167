"""DLoop loop-aware training: stage states equal the inference loop's, and the objective trains."""

from __future__ import annotations

import pytest
import torch

from components.config import DrafterConfig, TrainConfig
from components.drafters import build_drafter
from components.drafters.base import DrafterError
from components.losses import build_loss
from components.spec.sampling import SamplingParams
from components.training import collate, new_train_state, train_step
from components.training.objectives import ObjectiveContext, build_objective
from tests.components.training.test_training_steps import _record, first_step_descends

DRAFTERS = {
    "dspark": DrafterConfig(name="dspark", block_size=4, num_anchors=6, markov_rank=8),
    "dflash": DrafterConfig(name="dflash", block_size=4, num_anchors=6),
}


@pytest.fixture(scope="module")
def records(tiny_target):
    torch.manual_seed(0)
    ids = build_drafter(DRAFTERS["dspark"], tiny_target).layer_ids
    return [_record(tiny_target, ids, n, 3, i, "float32") for i, n in enumerate([30, 26])]


def _objective(name, target, **params):
    torch.manual_seed(2)
    drafter = build_drafter(DRAFTERS[name], target).eval()
    return build_objective("dloop", drafter, build_loss("tv_ce_confidence" if name == "dspark" else "kl"), params,
                           ObjectiveContext(target))


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_stage_states_equal_the_inference_loop(name, tiny_target, records):
    """Stage s trained at anchor a == propose → consume_own → propose ... at serving time, when
    the anchor tokens of later stages are the recorded ones (i.e. earlier drafts were right)."""
    objective = _objective(name, tiny_target)
    d, batch = objective.drafter, collate(records[:1])
    a, gamma = 5, objective.drafter.max_speculative_tokens
    with torch.no_grad():
        stages = objective.stage_outputs(batch, torch.tensor([[a, 9]]), depth=3)
        state = d.consume(d.init_state(1), batch.input_ids[:, :a], batch.hidden[:, :a])
        for s in range(3):
            anchor = a + s * gamma
            prop = d.propose(state, batch.input_ids[:, anchor], SamplingParams(temperature=0.0))
            trained = d.draft_states(stages[s][1])[0, 0]  # [γ, H] of the chain at a
            torch.testing.assert_close(prop.states[0], trained, rtol=1e-4, atol=1e-5)
            state = d.consume_own(state, prop.states)
    assert state.length == a + 3 * gamma and d.rollback(state, a).length == a


def test_dloop_objective_descends_its_loss_and_reads_own_states(tiny_target, records):
    objective = _objective("dspark", tiny_target, max_stages=3)
    state = new_train_state(objective.drafter, TrainConfig(lr=3e-3, warmup_steps=1), 10, seed=1, objective=objective)
    batch = collate(records)
    metrics = [first_step_descends(state, batch, seed=3)] + [train_step(state, batch) for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(m["train/loss"])) for m in metrics)
    assert all(2 <= m["train/depth"] <= 3 for m in metrics)  # S drawn from 2..max_stages
    # A chain reads only its own stage states: dropping the other chain changes nothing in it.
    with torch.no_grad():
        both = objective.stage_outputs(batch, torch.tensor([[4, 9], [4, 9]]), depth=3)[2][0].draft_logits
        alone = objective.stage_outputs(batch, torch.tensor([[4, -1], [4, -1]]), depth=3)[2][0].draft_logits
    gamma = objective.drafter.max_speculative_tokens
    torch.testing.assert_close(both.view(2, 2, gamma, -1)[:, 0], alone.view(2, 2, gamma, -1)[:, 0])


def test_dloop_refuses_drafters_without_block_internals_or_own_context(tiny_target):
    drafter = build_drafter(DrafterConfig(name="eagle3"), tiny_target)
    with pytest.raises(DrafterError, match=r"objective 'dloop' needs capability block_internals, own_context; "
                                           r"drafter 'eagle3' \(Eagle3Drafter\)"):
        build_objective("dloop", drafter, build_loss("kl"))
    with pytest.raises(DrafterError, match="cannot use its own states"):
        drafter.consume_own(drafter.init_state(1), torch.zeros(1, 2, tiny_target.hidden_size))
