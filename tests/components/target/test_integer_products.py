"""The block products of integer inputs (``kernels/rows_gemm_int8.c``, ``target.step_precision:
int8`` and ``int16``): each record of 32 inputs quantized to integers by its largest, exact integer
sums with the checkpoint's exact weights (Q4_1 and Q8_0), every row's bits its own whatever the
pass's row count; only where the CPU declares them (the step built on them: ``test_step_precision.py``)."""

from __future__ import annotations

import pytest
import torch

from components.target import kernels
from components.target.blocks import Blocks
from components.target.kernels import precisions, rows_gemm, why_unavailable
from tests.components.target.test_bf16_products import random_q41

DECLARED = why_unavailable() is None and "int8" in precisions()
needs_int8 = pytest.mark.skipif(not DECLARED, reason="the CPU does not declare AVX-512 VNNI and VBMI")
LIMITS = {"int8": 127, "int16": 127 * 257}  # the largest integer an input becomes


def quantized(x: torch.Tensor, limit: int) -> torch.Tensor:
    """What the kernel multiplies for float32 rows ``x`` [M, K]: per record of 32, the integers
    round(x * limit / max |x|) (ties to even, in float32) times the record's step max |x| / limit."""
    records = x.view(x.shape[0], -1, 32)
    amax = records.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, limit / amax, torch.zeros_like(amax))
    a = torch.round(records * inv).clamp(-limit, limit)
    return (a.double() * (amax / limit).double()).view_as(x)


def random_q80(n: int, k: int, gen: torch.Generator) -> Blocks:
    d = (torch.rand(n, k // 32, generator=gen) * 0.01 + 0.002).half().float()
    return Blocks("q8_0", torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen), d, None)


@needs_int8
@pytest.mark.parametrize("precision", list(LIMITS))
@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_products_are_exact_integer_sums_of_inputs_quantized_per_record(tmp_path, fmt, precision):
    gen = torch.Generator().manual_seed(0)
    int8 = rows_gemm(tmp_path, precision)  # built once per process (the step below takes it too)
    f32 = rows_gemm(tmp_path)
    assert int8.precision == precision and int8.nibbles == "amx" and precision in int8.path.name
    blocks = (random_q41 if fmt == "q4_1" else random_q80)(200, 96, gen)  # a partial last panel, three records
    w = blocks.dequantize()
    packed = int8.pack_blocks(blocks, w)
    x = torch.randn(11, 96, generator=gen) * torch.logspace(-3, 2, 96)  # inputs of many magnitudes
    x[3, 32:64] = 0  # a record of zeros: step 0
    y = int8.linear(x, packed)
    xq = quantized(x, LIMITS[precision])
    scale = xq.abs() @ w.double().abs().T
    assert ((y.double() - xq @ w.double().T).abs() / scale).max() < 1e-6  # float32's rounding of exact sums, no more
    steps = (x.view(11, 3, 32).abs().amax(-1) / LIMITS[precision]).double()  # [M, G]: inputs move by half a step at most
    bound = 0.5 * steps @ w.double().abs().view(200, 3, 32).sum(-1).T
    assert ((y.double() - x.double() @ w.double().T).abs() <= bound * 1.001 + 1e-6 * scale).all()
    assert not torch.equal(y, f32.linear(x, f32.pack_blocks(blocks, w)))  # the inputs really are quantized
    for rows in range(1, 11):  # every row's bits, whatever the pass's row count (blocks of up to 8 rows)
        assert torch.equal(int8.linear(x[:rows], packed), y[:rows]), rows
        assert torch.equal(int8.linear(x[rows:rows + 1], packed), y[rows:rows + 1]), rows


def test_int8_is_declared_by_the_cpus_flags(monkeypatch, tmp_path):
    """A CPU that does not declare VNNI (or VBMI) gets no int8 build: said, never tried."""
    if why_unavailable() is not None or "avx512" not in kernels.isas():
        pytest.skip("no AVX-512 build here")
    flags = (kernels.cpuinfo("flags") or "").split()
    monkeypatch.setattr(kernels, "cpuinfo", lambda field: " ".join(f for f in flags if f != "avx512_vnni")
                        if field == "flags" else None)
    assert "int8" not in precisions() and "int16" not in precisions()
    for precision in LIMITS:
        with pytest.raises(kernels.KernelUnavailable, match=f"{precision} products need the AVX-512 build on a CPU "
                                                            "declaring avx512_vnni, avx512vbmi"):
            kernels.RowsGemm.build(tmp_path, precision=precision)
