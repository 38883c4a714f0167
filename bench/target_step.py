"""The target's step against the memory floor: T(k), one pass of k new tokens over a
``--context``-token KV cache, for the transformers forward (``target.step: hf``) and the fast
step (``fast``: static slab + our weight-streaming kernel), beside the floor measured in the
same run: the seconds a pass needs to read every weight once, taken from a sum over a tensor of
the weights' size (the bandwidth one pass can use at that thread count).

    python bench/target_step.py [--threads 1,2 --context 256 --new-tokens 1,2,4,8,16 --reps 15
                                 --cache-dir DIR]

Prints a markdown table: per thread count and k, the medians of hf and fast (interleaved, so
load from other processes falls on both alike), fast over the floor, T(k)/T(1) of each and
fast's speedup over hf. Also the arithmetic beside it: GFLOP per pass. SmolLM2-135M-Instruct in
float32 (converted once into ``--cache-dir``). Nothing is asserted; the numbers describe this
machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import SMOLLM2_TARGET, TargetConfig
from components.engine.core import crop_cache
from components.target import load_target
from components.target.fast import StepTarget, step_target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", default="1,2")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--new-tokens", default="1,2,4,8,16")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--cache-dir", default=str(Path("~/.cache/specline/targets").expanduser()))
    return p.parse_args(argv)


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        clock = time.perf_counter()
        fn()
        times.append(time.perf_counter() - clock)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = TargetConfig(name_or_path=SMOLLM2_TARGET, dtype="float32", device="cpu", cache_dir=args.cache_dir, step="fast")
    hf = load_target(cfg)
    fast = step_target(hf, cfg)
    assert isinstance(fast, StepTarget)
    weight_bytes = sum(p.numel() * p.element_size() for p in hf.model.parameters())
    params = sum(p.numel() for p in hf.model.parameters())
    ks = [int(k) for k in args.new_tokens.split(",")]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, hf.vocab_size, (1, args.context + max(ks)), generator=gen)
    hf_cache = hf.forward(ids[:, :args.context], use_cache=True).cache
    fast_cache = fast.forward(ids[:, :args.context], use_cache=True).cache
    block = torch.randn(weight_bytes // 4, generator=gen)  # as many bytes as the weights

    def hf_pass(k: int) -> None:
        crop_cache(hf_cache, args.context)
        hf.forward(ids[:, args.context:args.context + k], cache=hf_cache, use_cache=True)

    def fast_pass(k: int) -> None:
        crop_cache(fast_cache, args.context)
        fast.forward(ids[:, args.context:args.context + k], cache=fast_cache, use_cache=True)

    print(f"SmolLM2-135M float32: {weight_bytes / 1e6:.0f} MB of weights, context {args.context}, "
          f"{args.reps} reps, medians; torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}\n")
    print("| threads | floor ms (GB/s) | k | GFLOP | hf ms | fast ms | fast / floor | hf T(k)/T(1) | fast T(k)/T(1) | fast speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for k in ks:  # warm-up
            hf_pass(k), fast_pass(k)
        floor = median_ms(lambda: block.sum(), args.reps)
        rows: dict[int, tuple[float, float]] = {}
        for k in ks:
            times: dict[str, list[float]] = {"hf": [], "fast": []}
            for _ in range(args.reps):  # interleaved
                times["hf"].append(median_ms(lambda k=k: hf_pass(k), 1))
                times["fast"].append(median_ms(lambda k=k: fast_pass(k), 1))
            rows[k] = (statistics.median(times["hf"]), statistics.median(times["fast"]))
        for k in ks:
            h, f = rows[k]
            print(f"| {threads} | {floor:.1f} ({weight_bytes / floor / 1e6:.1f}) | {k} | {2 * params * k / 1e9:.2f} | "
                  f"{h:.1f} | {f:.1f} | {f / floor:.2f} | {h / rows[ks[0]][0]:.2f} | {f / rows[ks[0]][1]:.2f} | "
                  f"{h / f:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
