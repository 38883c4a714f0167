"""Where one decode step (or verify pass) of the fast target goes, part by part, beside each
part's floor.

A pass T(k) of ``--rows`` k new tokens at ``--context`` tokens of context is split into what the
kernel does:

* each product kind of the decoder layers (q|k|v, o, gate|up, down), all layers, k rows, in
  layer order, through the kernel's own entry point (no Python between calls);
* the head (the tied embedding, k rows);
* the layers' other work: every layer in one call at context 1 and at ``--context``, less their
  products (norms, RoPE, SiLU and attention over the first slots; the attention over the context
  is the difference between the two);
* the rest of the step (embedding, final norm, Python, the logits' allocation): the step less
  the layers at ``--context`` and the head.

Each part beside its floors measured in the same run: its bytes (weights, or keys and values)
over the bandwidth of a sum over a tensor as large as the step's weights on the same threads
(timed among the parts),
and for products the arithmetic (two FLOP a weight) at the kernel's vector FMA peak. Medians of
``--reps``, the parts interleaved so that load from other processes falls on all alike.

    python bench/step_parts.py [--threads 2 --context 256 --rows 1 --reps 41 --cache-dir DIR]
                               [--step-precision float32|bfloat16|int8|int16]

Prints a markdown table. Nothing is asserted; the numbers describe this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import SMOLLM2_TARGET, TargetConfig
from components.engine.core import crop_cache
from components.target import load_target
from components.target.fast import StepTarget, step_target

PRODUCTS = ("qkv", "o", "gate_up", "down")


@dataclass
class Part:
    """One part of a step: its median seconds, the bytes it must read (0: none to speak of), the
    weights it multiplies (products only)."""

    name: str
    seconds: float
    bytes: int = 0
    weights: int = 0


def _nbytes(w) -> int:
    """Bytes of a packed weight's panels (what a one-row product reads)."""
    return w.panels.numel() * w.panels.element_size()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--rows", type=int, default=1, help="new tokens a pass (a verify pass of k tokens: k)")
    p.add_argument("--reps", type=int, default=41)
    p.add_argument("--cache-dir", default=str(Path("~/.cache/specline/targets").expanduser()))
    p.add_argument("--step-precision", default="float32", choices=["float32", "bfloat16", "int8", "int16"],
                   help="target.step_precision (the block products on bfloat16 or integer inputs)")
    return p.parse_args(argv)


def _median_interleaved(calls: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Median seconds of each call, the calls taken in turn ``reps`` times (after one warm-up)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for rep in range(reps + 1):
        for name, call in calls.items():
            clock = time.perf_counter()
            call()
            if rep:
                times[name].append(time.perf_counter() - clock)
    return {name: statistics.median(t) for name, t in times.items()}


def step_parts(target: StepTarget, context: int, reps: int, threads: int, rows: int = 1) -> tuple[list[Part], float]:
    """(the parts of a pass of ``rows`` new tokens of ``target`` (the fast step with its kernels)
    at ``context`` tokens of context, on ``threads`` threads: the products by kind, the head, the
    layers' other work at the first slots and the attention over the rest of the context, and the
    rest of the pass; the bandwidth in B/s of a sum over a tensor of the step's weight bytes,
    timed among them)."""
    d, kernel = target.decoder, target.decoder.kernels
    if kernel is None:
        raise ValueError("step_parts: the target's step has no kernels (target.step: fast)")
    s, torch_threads = d.shape, torch.get_num_threads()
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (1, context + rows), generator=gen)
    cache = target.forward(ids[:, :context], use_cache=True).cache
    calls: dict[str, Callable[[], None]] = {}
    kept = []  # the products' inputs and outputs, alive while their calls are
    for kind in PRODUCTS:
        bound = []
        for layer in d.layers:
            w = getattr(layer, kind)
            x, y = torch.randn(rows, w.shape[1], generator=gen), torch.empty(rows, w.shape[0])
            kept.append((x, y))
            bound.append(kernel.bound_product(x, w, y, threads))
        calls[kind] = lambda bound=bound: [call() for call in bound]
    x, y = torch.randn(rows, s.hidden, generator=gen), torch.empty(rows, d.head_weight.shape[0])
    calls["head"] = kernel.bound_product(x, d.head_weight, y, threads)
    row = d.embed(ids[0, context:]).contiguous()  # [rows, H]
    seq = torch.zeros(rows, dtype=torch.long)
    for at in (1, context):
        pos, h = torch.arange(at, at + rows), row.clone()
        calls[f"layers@{at}"] = lambda pos=pos, h=h: kernel.layers(h.copy_(row), seq, pos, s, d.layers, cache.k, cache.v,
                                                                   d.cos, d.sin, threads)

    def step() -> None:
        crop_cache(cache, context)
        target.forward(ids[:, context:], cache=cache, use_cache=True)
    calls["step"] = step
    weight_bytes = _nbytes(d.head_weight) + sum(_nbytes(getattr(layer, kind)) for layer in d.layers for kind in PRODUCTS)
    stream = torch.randn(weight_bytes // 4, generator=gen)
    calls["sum"] = stream.sum
    took = _median_interleaved(calls, reps)
    torch.set_num_threads(torch_threads)

    parts = [Part(kind, took[kind], sum(_nbytes(getattr(layer, kind)) for layer in d.layers),
                  sum(getattr(layer, kind).shape.numel() for layer in d.layers)) for kind in PRODUCTS]
    parts.append(Part("head", took["head"], _nbytes(d.head_weight), d.head_weight.shape.numel()))
    products = sum(p.seconds for p in parts[:len(PRODUCTS)])
    kv_bytes = 2 * s.layers * s.kv_heads * s.head_dim * 4 * context  # float32 keys and values read once
    parts.append(Part("layers' other work at the first slots", took["layers@1"] - products))
    parts.append(Part(f"attention over {context} slots", took[f"layers@{context}"] - took["layers@1"], kv_bytes))
    parts.append(Part("rest of the step", took["step"] - took[f"layers@{context}"] - took["head"]))
    parts.append(Part(f"step T({rows})", took["step"], sum(p.bytes for p in parts), sum(p.weights for p in parts)))
    return parts, stream.numel() * 4 / took["sum"]


def table(parts: list[Part], bandwidth: float, fma_flops: float, rows: int = 1) -> list[str]:
    """Markdown rows: each part's ms, share of the step, MB, GB/s, and its floors (bytes over
    ``bandwidth`` B/s; two FLOP a weight and row at ``fma_flops`` FLOP/s)."""
    step = parts[-1].seconds
    lines = ["| part | ms | share | MB read | GB/s | memory floor ms | × | FMA floor ms | × |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in parts:
        mem = p.bytes / bandwidth
        fma = 2 * p.weights * rows / fma_flops
        lines.append(f"| {p.name} | {p.seconds * 1e3:.3f} | {p.seconds / step:.0%} | "
                     + (f"{p.bytes / 1e6:.1f} | {p.bytes / p.seconds / 1e9:.1f} | {mem * 1e3:.3f} | {p.seconds / mem:.2f} | "
                        if p.bytes and p.seconds > 0 else "– | – | – | – | ")
                     + (f"{fma * 1e3:.3f} | {p.seconds / fma:.2f} |" if p.weights and p.seconds > 0 else "– | – |"))
    return lines


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = TargetConfig(name_or_path=SMOLLM2_TARGET, dtype="float32", device="cpu", cache_dir=args.cache_dir,
                       step="fast", static_len=max(2048, args.context + args.rows), step_precision=args.step_precision)
    target = step_target(load_target(cfg), cfg)
    assert isinstance(target, StepTarget)
    parts, bandwidth = step_parts(target, args.context, args.reps, args.threads, args.rows)
    fma = target.decoder.kernels.fma_rate(args.threads) * 1e9
    print(f"SmolLM2-135M, fast step ({', '.join(target.weight_formats)} blocks, kernel {target.decoder.kernels.isa}, "
          f"{target.precision} products), "
          f"{args.rows} new token(s), context {args.context}, {args.threads} thread(s), medians of {args.reps}; a sum over a tensor of the "
          f"weights' bytes: {bandwidth / 1e9:.1f} GB/s; vector FMAs {fma / 1e9:.0f} GFLOP/s\n")
    print("\n".join(table(parts, bandwidth, fma, args.rows)))


if __name__ == "__main__":
    main()
