"""A fast step whose block products compute in another precision than float32
(``target.step_precision``: bfloat16, int16, int8, each where the CPU declares it): its output near
float32's, its speculative output equal to its own plain output token for token (batch-1 engine
with a drafter and with suffix decoding, batch engine), a pass only the transformers forward
could run refused; and the setting's errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from components.engine import (
    BatchEngine,
    Request,
    SpeculativeEngine,
    SuffixDrafter,
    target_only_generate,
)
from components.target.fast import StepTarget, step_target, wanted_kernel
from components.target.hf import TargetError
from components.target.kernels import PRECISIONS, precisions, why_unavailable
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts, random_drafter
from tests.components.target.test_blocks import stored_target  # noqa: F401 (a fixture)

OTHERS = [p for p in PRECISIONS if p != "float32"]
DECLARED = precisions() if why_unavailable() is None else ()


@pytest.mark.parametrize("precision", OTHERS)
def test_a_step_of_another_precision_is_lossless_against_its_own_plain_decoding(tiny_target_cfg, stored_target,  # noqa: F811
                                                                                tmp_path, precision):
    if precision not in DECLARED:
        pytest.skip(f"the CPU does not declare what {precision} products need")
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", static_len=256, cache_dir=str(tmp_path),
                              step_precision=precision)
    lines: list[str] = []
    drafter = random_drafter(stored_target, "dspark")
    fast = step_target(stored_target, cfg, taps=tuple(drafter.layer_ids), lines=lines.append)
    assert isinstance(fast, StepTarget) and fast.precision == precision
    assert f"q4_1 blocks (inputs in {precision})" in lines[0]
    assert {"bfloat16": "bf16"}.get(precision, precision) in fast.forward_kind  # its own round profiles
    f32 = step_target(stored_target, dataclasses.replace(cfg, step_precision="float32"))
    ids = torch.tensor([prompts(stored_target)[0] * 8], dtype=torch.long)[:, :40]
    got, want = fast.forward(ids, use_cache=True).logits, f32.forward(ids, use_cache=True).logits
    assert not torch.equal(got, want)  # not float32's output, but near it
    torch.testing.assert_close(got, want, rtol=0, atol=0.05 * want.abs().max().item())
    suffix = SuffixDrafter(stored_target.vocab_size, 8)
    for prompt in [*prompts(stored_target), prompts(stored_target)[2] * 3]:
        plain = target_only_generate(fast, prompt, MAX_NEW).tokens
        for d in (drafter, suffix):
            engine = SpeculativeEngine(fast, d, rule="greedy", num_speculative_tokens=4)
            assert engine.generate(prompt, MAX_NEW).tokens == plain
    batch = BatchEngine(fast, drafter, num_speculative_tokens=3, max_batch_size=3)
    want_all = [target_only_generate(fast, p, MAX_NEW).tokens for p in prompts(stored_target)]
    got_all = batch.generate([Request(p, MAX_NEW, request_id=str(i)) for i, p in enumerate(prompts(stored_target))])
    assert [r.tokens for r in got_all] == want_all
    with pytest.raises(TargetError, match="would compute in float32"):  # what only the transformers forward runs
        fast.forward(ids[:, :4], attention_mask=torch.ones(1, 4, dtype=torch.long))


def test_step_precision_setting(tiny_target_cfg, tiny_target, stored_target):  # noqa: F811
    with pytest.raises(TargetError, match="target.step_precision: 'float16' is not one of"):
        wanted_kernel(tiny_target, dataclasses.replace(tiny_target_cfg, step_precision="float16"))
    with pytest.raises(TargetError, match="bfloat16 runs in the fast step, which does not run here"):
        wanted_kernel(tiny_target, dataclasses.replace(tiny_target_cfg, step="hf", step_precision="bfloat16"))
    if why_unavailable() is None:  # a step without blocks would ignore it: said, not ignored
        with pytest.raises(TargetError, match="acts on the checkpoint's blocks, and this step reads none"):
            wanted_kernel(tiny_target, dataclasses.replace(tiny_target_cfg, step="fast", step_precision="bfloat16"))
    if "bfloat16" not in DECLARED and why_unavailable() is None:  # asked for where the CPU cannot: one line, no fallback
        with pytest.raises(TargetError, match="target.step_precision: bfloat16, but"):
            wanted_kernel(stored_target, dataclasses.replace(tiny_target_cfg, step="fast", step_precision="bfloat16"))
