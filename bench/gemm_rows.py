"""What a verify pass of k tokens costs in the target's matrix products, against one token.

    python bench/gemm_rows.py [--target embedded] [--rows 1,2,3,4,8,16] [--threads 1] [--reps 50]

A target forward over k new tokens multiplies k rows by every weight matrix. On a memory-bound
step the weights are read once whatever k is, so the k-token verify pass should cost about what
one token costs; on a CPU the BLAS kernel for few rows decides. This bench times
``torch.nn.functional.linear`` of k random rows against each distinct weight shape of the
target's decoder layers and its LM head (the real weights, float32), k interleaved, median of
``--reps``, and prints each time over the one-row time. The same weight is multiplied again and
again, so it sits in the CPU's caches: the one-row times are those of a product that reads
nothing from memory (a forward streams every weight from DRAM), and the ratios show what the
kernel's arithmetic costs per extra row. Nothing is asserted; the figures help read the target's
T(k)/T(1) curve (``bench/target_card.py``) and which draft lengths are cheap to verify.
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


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="embedded", help="embedded, smollm2, tiny or an HF directory")
    ap.add_argument("--rows", default="1,2,3,4,8,16", help="k: rows (tokens) per product")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50)
    return ap.parse_args()


def weight_shapes(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """One weight per distinct (out, in) shape among the model's linear layers, named by the first."""
    seen: dict[tuple[int, ...], tuple[str, torch.Tensor]] = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and tuple(module.weight.shape) not in seen:
            seen[tuple(module.weight.shape)] = (name, module.weight.detach().float())
    return {name: w for name, w in seen.values()}


def time_rows(weight: torch.Tensor, rows: list[int], reps: int) -> dict[int, float]:
    """Median seconds of ``linear(x [k, in], weight)`` per k, the k interleaved."""
    inputs = {k: torch.randn(k, weight.shape[1]) for k in rows}
    samples: dict[int, list[float]] = {k: [] for k in rows}
    for rep in range(reps + 1):
        for k in rows:
            t0 = time.perf_counter()
            torch.nn.functional.linear(inputs[k], weight)
            if rep:  # the first pass warms every shape up
                samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    from components.config import TargetConfig
    from components.target import load_target

    target = load_target(TargetConfig(name_or_path=args.target, dtype="float32"), progress=False)
    rows = [int(k) for k in args.rows.split(",")]
    print(f"{target.name_or_path}: float32, {args.threads} thread(s), torch {torch.__version__}, median of {args.reps}")
    print(f"{'weight [out, in]':<44}" + "".join(f"{f'k={k}':>16}" for k in rows))
    with torch.no_grad():
        for name, weight in weight_shapes(target.model).items():
            times = time_rows(weight, rows, args.reps)
            cells = "".join(f"{1e3 * times[k]:9.3f} ({times[k] / times[rows[0]]:4.2f})" for k in rows)
            print(f"{name + ' ' + str(list(weight.shape)):<44}{cells}")
    print(f"(ms per product; in brackets: over k={rows[0]})")


if __name__ == "__main__":
    main()
