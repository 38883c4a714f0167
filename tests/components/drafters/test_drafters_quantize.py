"""The int8 readout head: close to the float head, drafts nearly the same tokens, leaves the
target's head alone, and the engine stays lossless with it (the target verifies in float32)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import components.drafters  # noqa: F401  (registers every family)
from components.config import DrafterConfig
from components.drafters.quantize import Int8Linear, int8_lm_head
from components.drafters.registry import build_drafter
from components.engine import SpeculativeEngine, target_only_generate
from components.spec.sampling import SamplingParams


def test_int8_linear_is_close_to_float():
    torch.manual_seed(0)
    linear = nn.Linear(64, 512, bias=False)
    x = torch.randn(3, 5, 64)
    with torch.no_grad():
        want, got = linear(x), Int8Linear(linear)(x)
    assert got.shape == want.shape == (3, 5, 512) and got.dtype == torch.float32
    assert float((got - want).abs().max() / want.abs().max()) < 0.03
    assert float((got.argmax(-1) == want.argmax(-1)).float().mean()) >= 0.9


def test_int8_head_drafter_is_lossless_and_leaves_the_target_alone(tiny_target):
    torch.manual_seed(0)
    plain = build_drafter(DrafterConfig(name="dspark", num_layers=1), tiny_target).eval()
    torch.manual_seed(0)
    quant = int8_lm_head(build_drafter(DrafterConfig(name="dspark", num_layers=1), tiny_target).eval())
    assert isinstance(tiny_target.lm_head, nn.Linear) and plain.shared.lm_head is tiny_target.lm_head
    assert isinstance(quant.shared.lm_head, Int8Linear)
    prompt = tiny_target.tokenizer("def main(args):\n    ")["input_ids"]
    ref = target_only_generate(tiny_target, prompt, 24).tokens
    assert SpeculativeEngine(tiny_target, quant).generate(prompt, 24).tokens == ref
    # the drafts themselves: nearly always the float head's
    ids = torch.tensor([prompt])
    out = tiny_target.forward(ids, layer_ids=plain.layer_ids)
    agree = []
    for drafter in (plain, quant):
        state = drafter.consume(drafter.init_state(1), ids[:, :-1], out.hidden[:, :-1])
        agree.append(drafter.propose(state, ids[:, -1], SamplingParams(temperature=0.0)).tokens)
    assert float((agree[0] == agree[1]).float().mean()) >= 0.8


def test_int8_head_refuses_a_non_linear_head(tiny_target):
    drafter = build_drafter(DrafterConfig(name="dspark", num_layers=1), tiny_target)
    drafter.shared = type(drafter.shared)(drafter.shared.embed_tokens, nn.Identity(), drafter.shared.final_norm)
    with pytest.raises(TypeError, match="not nn.Linear"):
        int8_lm_head(drafter)
