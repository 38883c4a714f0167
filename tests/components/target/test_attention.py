"""The target's GQA attention kernel equals transformers' own SDPA path, bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.target import TargetError, load_target
from components.target.attention import GQA_SDPA


@pytest.fixture(scope="module")
def sdpa_target(tiny_target_cfg, tiny_target_build):
    return load_target(dataclasses.replace(tiny_target_cfg, attention="sdpa"), progress=False)


def test_auto_takes_the_gqa_kernel_on_cpu(tiny_target, sdpa_target):
    assert tiny_target.model.config.num_key_value_heads < tiny_target.model.config.num_attention_heads
    assert tiny_target.model.config._attn_implementation == GQA_SDPA
    assert sdpa_target.model.config._attn_implementation == "sdpa"


def test_gqa_kernel_equals_sdpa_on_prefill_and_masked_ragged_passes(tiny_target, sdpa_target):
    torch.manual_seed(0)
    prefix = torch.randint(5, tiny_target.vocab_size, (3, 9))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding, as the batch engine's ragged rows have
    new = torch.randint(5, tiny_target.vocab_size, (3, 3))
    outs = []
    for target in (tiny_target, sdpa_target):
        first = target.forward(prefix, attention_mask=mask[:, :9], layer_ids=[1], use_cache=True)
        rest = target.forward(new, attention_mask=mask, layer_ids=[1], cache=first.cache)
        plain = target.forward(prefix)  # no mask: causal prefill
        outs.append((first.logits, rest.logits, rest.hidden, plain.logits))
    for ours, theirs in zip(*outs):
        assert torch.equal(ours, theirs)


def test_unknown_attention_is_a_clear_error(tiny_target_cfg, tiny_target_build):
    with pytest.raises(TargetError, match="target.attention: cannot use 'warp-speed'"):
        load_target(dataclasses.replace(tiny_target_cfg, attention="warp-speed"), progress=False)
