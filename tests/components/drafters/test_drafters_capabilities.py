"""Drafter capabilities: each registered drafter implements what it declares, declares what its
config gives it, and a feature that needs a capability refuses a drafter without it by name."""

from __future__ import annotations

import pytest

from components.drafters.capabilities import Capability, CapabilityError, has, require
from components.drafters.registry import DRAFTERS

EXPECTED = {  # name -> capabilities with the test config below (carryover off, linear Markov head)
    "dflash": {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.OWN_CONTEXT,
               Capability.BLOCK_INTERNALS, Capability.HEAD_START, Capability.ROUND_LIMIT, Capability.LAYER_KERNEL},
    "dspark": {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.OWN_CONTEXT,
               Capability.BLOCK_INTERNALS, Capability.SLOT_HEADS, Capability.CAUSAL_TREE_HEAD,
               Capability.HEAD_START, Capability.BASE_LOGITS, Capability.ROUND_LIMIT, Capability.LAYER_KERNEL},
    "dflash2": {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.OWN_CONTEXT,
                Capability.BLOCK_INTERNALS, Capability.HEAD_START, Capability.BASE_LOGITS, Capability.ROUND_LIMIT},
    "domino": {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.OWN_CONTEXT,
               Capability.BLOCK_INTERNALS, Capability.CAUSAL_TREE_HEAD, Capability.HEAD_START,
               Capability.BASE_LOGITS, Capability.ROUND_LIMIT, Capability.LAYER_KERNEL},
    "d_loop": {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.OWN_CONTEXT,
               Capability.HEAD_START, Capability.ROUND_LIMIT, Capability.LAYER_KERNEL},
    "dedit": {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.OWN_CONTEXT,
              Capability.HEAD_START, Capability.ROUND_LIMIT, Capability.LAYER_KERNEL},
    "hspec": {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.CAUSAL_TREE_HEAD,
              Capability.BASE_LOGITS, Capability.ROUND_LIMIT, Capability.TARGET_KV},
    "eagle3": {Capability.BATCHED_PROPOSE},
    "peagle": {Capability.BATCHED_PROPOSE, Capability.ROUND_LIMIT},
    "medusa": {Capability.BATCHED_PROPOSE},
    "mtp": {Capability.BATCHED_PROPOSE},
}


def test_every_registered_drafter_is_listed():
    assert set(DRAFTERS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_declared_capabilities_are_implemented(tiny_target, dr, name):
    drafter = dr.make(tiny_target, name)
    assert set(drafter.capabilities()) == EXPECTED[name]
    for cap in drafter.capabilities():
        for attr in cap.methods:
            assert getattr(drafter, attr, None) is not None, f"{name} declares {cap.value} but has no {attr}"


@pytest.mark.parametrize("name", ["dflash", "dspark"])
def test_carryover_follows_the_config(tiny_target, dr, name):
    assert not has(dr.make(tiny_target, name), Capability.CARRYOVER)
    drafter = dr.make(tiny_target, name, carryover=True)
    assert has(drafter, Capability.CARRYOVER)
    assert drafter.carry_embed is not None


def test_causal_tree_head_needs_a_markov_head(tiny_target, dr):
    plain = dr.make(tiny_target, "dspark", markov_head="none")
    assert not has(plain, Capability.CAUSAL_TREE_HEAD) and not has(plain, Capability.BASE_LOGITS)


def test_require_names_feature_drafter_and_capability(tiny_target, dr):
    drafter = dr.make(tiny_target, "eagle3")
    require(drafter, "anything", Capability.BATCHED_PROPOSE)
    with pytest.raises(CapabilityError, match=r"DLoop stages needs capability own_context; drafter 'eagle3'"):
        require(drafter, "DLoop stages", Capability.OWN_CONTEXT)
