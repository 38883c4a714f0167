"""``drafter.init_from_target`` (``DFlashDrafter.head_start``): the draft layers start as the
target's last decoder layers, the fusion passes the deepest tap through, and drafters or sizes
that cannot take it fail by name."""

from __future__ import annotations

import pytest
import torch

from components.drafters.capabilities import CapabilityError
from components.drafters.errors import DrafterError
from tests.components.drafters.conftest import make_drafter, run_target


@pytest.mark.parametrize("name", ["dspark", "dflash"])
def test_draft_layers_are_copies_of_the_targets_last_layers(tiny_target, name):
    drafter = make_drafter(tiny_target, name, num_layers=2, init_from_target=True)
    layers = tiny_target.model.model.layers
    for mine, theirs in zip(drafter.backbone.layers, layers[-2:]):
        theirs_state = theirs.state_dict()
        for key, value in mine.state_dict().items():
            if key in theirs_state:
                assert torch.equal(value, theirs_state[key]), key
            else:  # a Llama target has no q/k norms: the drafter's stay ones
                assert key.endswith(("q_norm.weight", "k_norm.weight")) and torch.equal(value, torch.ones_like(value))
    h, n = tiny_target.hidden_size, len(drafter.layer_ids)
    deepest = drafter.layer_ids.index(max(drafter.layer_ids))
    fc = drafter.backbone.fc.weight.view(h, n, h)
    assert torch.equal(fc[:, deepest], torch.eye(h)) and fc.abs().sum() == h
    assert torch.equal(drafter.backbone.norm.weight, tiny_target.model.model.norm.weight)


def test_the_fused_context_is_the_deepest_taps_state_as_the_target_norms_it(tiny_target, ids):
    drafter = make_drafter(tiny_target, "dspark", num_layers=1, init_from_target=True)
    run = run_target(tiny_target, drafter, ids)
    deepest = drafter.layer_ids.index(max(drafter.layer_ids))
    copied = tiny_target.model.model.layers[-1].input_layernorm
    torch.testing.assert_close(drafter.backbone.fuse(run.hidden), copied(run.hidden[:, :, deepest]))


def test_without_it_the_layers_are_random(tiny_target):
    drafter = make_drafter(tiny_target, "dspark", num_layers=1)
    theirs = tiny_target.model.model.layers[-1].mlp.down_proj.weight
    assert not torch.equal(drafter.backbone.layers[0].mlp.down_proj.weight, theirs)


def test_other_shapes_and_drafters_fail_by_name(tiny_target):
    with pytest.raises(DrafterError, match="init_from_target.*intermediate_size|init_from_target.*mlp"):
        make_drafter(tiny_target, "dspark", num_layers=1, intermediate_size=8, init_from_target=True)
    with pytest.raises(CapabilityError, match="head_start"):
        make_drafter(tiny_target, "eagle3", num_layers=1, init_from_target=True)
