"""bench/step_parts.py on the fixture target behind the fast step (float32 panels): every part
is timed and sized; the timings themselves describe the machine and are not checked."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from components.target.fast import StepTarget, step_target
from components.target.kernels import why_unavailable
from tests.bench.benches import load_bench

bench = load_bench("step_parts")


@pytest.mark.skipif(why_unavailable() is not None, reason=f"kernel: {why_unavailable()}")
@pytest.mark.parametrize("rows", [1, 3])
def test_every_part_of_a_step_is_timed_and_sized(tiny_target_cfg, tiny_target, rows):
    cfg = dataclasses.replace(tiny_target_cfg, step="fast", static_len=64)
    target = step_target(tiny_target, cfg)
    assert isinstance(target, StepTarget)
    threads = torch.get_num_threads()
    parts, bandwidth = bench.step_parts(target, context=40, reps=2, threads=1, rows=rows)
    assert bandwidth > 0
    assert torch.get_num_threads() == threads  # the caller's threads, restored
    names = [p.name for p in parts]
    assert names == [*bench.PRODUCTS, "head", "layers' other work at the first slots",
                     "attention over 40 slots", "rest of the step", f"step T({rows})"]
    d, s = target.decoder, target.decoder.shape
    for p, kind in zip(parts, bench.PRODUCTS, strict=False):  # the panels every layer's product reads
        assert p.bytes == sum(getattr(layer, kind).panels.numel() * 4 for layer in d.layers)
        assert p.weights == sum(getattr(layer, kind).shape.numel() for layer in d.layers) and p.seconds > 0
    assert parts[4].weights == d.head_weight.shape.numel()
    assert parts[6].bytes == 2 * s.layers * s.kv_heads * s.head_dim * 4 * 40  # keys and values, float32
    assert parts[-1].bytes == sum(p.bytes for p in parts[:-1]) and all(math.isfinite(p.seconds) for p in parts)
    lines = bench.table(parts, bandwidth=1e10, fma_flops=1e11, rows=rows)
    assert len(lines) == 2 + len(parts) and all(line.count("|") == 10 for line in lines)
    cells = lines[2].split(" | ")
    assert cells[5] == f"{parts[0].bytes / 1e10 * 1e3:.3f}"  # bytes over the bandwidth
    assert cells[7] == f"{2 * parts[0].weights * rows / 1e11 * 1e3:.3f}"  # two FLOP a weight and row


def test_a_step_without_kernels_is_refused(tiny_target):
    with pytest.raises(ValueError, match="no kernels"):
        bench.step_parts(StepTarget(tiny_target, (), 64), context=8, reps=1, threads=1)
