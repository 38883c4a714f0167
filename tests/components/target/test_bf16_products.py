"""The Q4_1 products of bfloat16 inputs (``kernels/rows_gemm_bf16.c``, ``target.step_precision:
bfloat16``): float32 arithmetic on the inputs rounded to bfloat16 and the checkpoint's exact
weights, every row's bits its own whatever the pass's row count, and a step built on them
whose speculative output is its own plain output token for token; the setting's errors."""

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
from components.target.blocks import Blocks
from components.target.fast import StepTarget, step_target, wanted_kernel
from components.target.hf import TargetError
from components.target.kernels import precisions, rows_gemm, why_unavailable
from tests.components.engine.test_engine_greedy import MAX_NEW, prompts, random_drafter
from tests.components.target.test_blocks import stored_target  # noqa: F401 (a fixture)

DECLARED = why_unavailable() is None and "bfloat16" in precisions()
needs_bf16 = pytest.mark.skipif(not DECLARED, reason="the CPU does not declare AVX-512 BF16")


def random_q41(n: int, k: int, gen: torch.Generator) -> Blocks:
    """Q4_1 blocks with a checkpoint's kind of scales: d > 0 and m < 0 (float16 values)."""
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.002).half().float()
    m = (-8 * d * (0.8 + 0.4 * torch.rand(n, k // 32, generator=gen))).half().float()
    return Blocks("q4_1", torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen), d, m)


@needs_bf16
def test_products_are_float32_arithmetic_on_inputs_rounded_to_bfloat16(tmp_path):
    gen = torch.Generator().manual_seed(0)
    bf16 = rows_gemm(tmp_path, "bfloat16")  # built once per process (the step below takes it too)
    f32 = rows_gemm(tmp_path)
    assert bf16.precision == "bfloat16" and bf16.nibbles == "amx" and "bf16" in bf16.path.name
    blocks = random_q41(200, 96, gen)  # a partial last panel, three records
    w = blocks.dequantize()
    packed = bf16.pack_blocks(blocks, w)
    x = torch.randn(9, 96, generator=gen) * torch.logspace(-3, 2, 96)  # inputs of many magnitudes
    y = bf16.linear(x, packed)
    rounded = x.to(torch.bfloat16).double()
    scale = rounded.abs() @ w.double().abs().T
    assert ((y.double() - rounded @ w.double().T).abs() / scale).max() < 1e-6  # float32's rounding, no more
    exact = x.double() @ w.double().T
    assert ((y.double() - exact).abs() / (x.double().abs() @ w.double().abs().T)).max() < 2 ** -8
    assert not torch.equal(y, f32.linear(x, f32.pack_blocks(blocks, w)))  # the inputs really are rounded
    for rows in range(1, 9):  # every row's bits, whatever the pass's row count (blocks of 4 rows and their tails)
        assert torch.equal(bf16.linear(x[:rows], packed), y[:rows]), rows
        assert torch.equal(bf16.linear(x[rows:rows + 1], packed), y[rows:rows + 1]), rows


@needs_bf16
def test_a_bfloat16_step_is_lossless_against_its_own_plain_decoding(tiny_target_cfg, stored_target, tmp_path):  # noqa: F811
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", static_len=256, cache_dir=str(tmp_path),
                              step_precision="bfloat16")
    lines: list[str] = []
    drafter = random_drafter(stored_target, "dspark")
    fast = step_target(stored_target, cfg, taps=tuple(drafter.layer_ids), lines=lines.append)
    assert isinstance(fast, StepTarget) and fast.precision == "bfloat16"
    assert "q4_1 blocks (inputs in bfloat16)" in lines[0] and "bf16" in fast.forward_kind
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
    if why_unavailable() is None:  # a step without Q4_1 blocks would ignore it: said, not ignored
        with pytest.raises(TargetError, match="acts on the checkpoint's blocks, and this step reads none"):
            wanted_kernel(tiny_target, dataclasses.replace(tiny_target_cfg, step="fast", step_precision="bfloat16"))
    if not DECLARED and why_unavailable() is None:  # asked for where the CPU cannot: one line, no fallback
        with pytest.raises(TargetError, match="target.step_precision: bfloat16, but"):
            wanted_kernel(stored_target, dataclasses.replace(tiny_target_cfg, step="fast", step_precision="bfloat16"))
