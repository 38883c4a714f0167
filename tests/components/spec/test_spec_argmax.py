"""``argmax_last`` is ``x.argmax(-1)`` exactly: the same index for random rows, ties (the first
maximum), -inf rows, NaN (it counts as the maximum), non-contiguous views, any leading shape;
other dtypes and gradient-carrying tensors go through torch."""

from __future__ import annotations

import pytest
import torch

from components.spec.argmax import argmax_last


def _same(x: torch.Tensor) -> None:
    got = argmax_last(x)
    assert got.dtype == torch.long and got.shape == x.shape[:-1]
    assert torch.equal(got, x.argmax(dim=-1))


@pytest.mark.parametrize("shape", [(7,), (3, 49152), (2, 5, 300), (1, 1, 8192)])
def test_random_rows(shape):
    _same(torch.randn(*shape, generator=torch.Generator().manual_seed(0)))


def test_ties_infinities_and_nan():
    x = torch.zeros(6, 10)
    x[0, [2, 5, 7]] = 3.0  # ties: the first
    x[1] = float("-inf")  # all -inf: index 0
    x[1, 4] = float("-inf")
    x[2, [3, 8]] = float("nan")  # NaN is the maximum, the first one
    x[3, 9] = float("inf")
    x[4, [1, 6]] = float("inf")
    x[5, 0] = float("nan")
    x[5, 1] = float("inf")
    _same(x)


def test_views_and_other_tensors():
    x = torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(1))
    _same(x[:, 1:])  # a slice
    _same(x.transpose(0, 1))  # non-contiguous
    _same(x[..., ::2])  # strided last axis
    _same(x.flip(-1))
    _same(x.to(torch.bfloat16))
    _same(x.double())
    _same(torch.tensor(3.0))  # a scalar
    with torch.inference_mode():
        _same(torch.randn(2, 9))
    grad = x.clone().requires_grad_(True)
    assert torch.equal(argmax_last(grad), x.argmax(-1))
