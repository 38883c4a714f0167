"""The Q4_1 products of bfloat16 inputs (``kernels/rows_gemm_bf16.c``, ``target.step_precision:
bfloat16``): float32 arithmetic on the inputs rounded to bfloat16 and the checkpoint's exact
weights, every row's bits its own whatever the pass's row count (the step built on them:
``test_step_precision.py``)."""

from __future__ import annotations

import pytest
import torch

from components.target.blocks import Blocks
from components.target.kernels import precisions, rows_gemm, why_unavailable

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
