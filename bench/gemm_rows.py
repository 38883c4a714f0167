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

    python bench/gemm_rows.py --kernel [--rows 1,2,3,4,5,8,9,16,17] [--threads 1,2] [--reps 7]

``--kernel`` times the fast step's kernel (``components.target.kernels``) where a decode step
uses it, on weights streamed from memory: random float32 weights of SmolLM2-135M's shapes, the
LM head [49152, 576] (113 MB) and 30 layers' qkv/o/gate_up/down (425 MB), each far larger than
the caches. Per k and thread count, in one process and interleaved: torch's ``F.linear``, the
kernel on the weights as they are, the kernel on packed weights (what the fast step runs), and
the memory floor: a sum over a 540 MB tensor (torch, same threads). Prints ms and GB/s (weight
bytes over time), and each time over the packed kernel's k=1.
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
    ap.add_argument("--threads", default="1", help="threads (--kernel: a list, e.g. 1,2)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--kernel", action="store_true", help="the fast step's kernel on streamed weights (above)")
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


LAYER = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}  # SmolLM2-135M
HEAD, LAYERS = (49152, 576), 30


def kernel_bench(rows: list[int], threads: list[int], reps: int) -> None:
    """The table of ``--kernel`` (see the module's docstring)."""
    import tempfile

    from components.target.kernels import RowsGemm

    kernel = RowsGemm.build(Path(tempfile.mkdtemp(prefix="rows_gemm-")))
    gen = torch.Generator().manual_seed(0)
    sets = {"head": [torch.randn(*HEAD, generator=gen)],
            f"{LAYERS} layers": [torch.randn(*LAYER[n], generator=gen) for _ in range(LAYERS) for n in LAYER]}
    packs = {name: [kernel.pack(w) for w in ws] for name, ws in sets.items()}
    floor = torch.randn(135_000_000, generator=gen)  # 540 MB
    ways = {"torch": lambda x, ws, pk, t: [torch.nn.functional.linear(x, w) for w in ws],
            "unpacked": lambda x, ws, pk, t: [kernel.linear(x, w, t) for w in ws],
            "packed": lambda x, ws, pk, t: [kernel.linear(x, p, t) for p in pk]}
    inputs = {(name, k): {w.shape[1]: torch.randn(k, w.shape[1], generator=gen) for w in ws}
              for name, ws in sets.items() for k in rows}
    print(f"float32 weights from memory, median of {reps}, torch {torch.__version__}; "
          "ms (GB/s) [over packed k=1]")
    for t in threads:
        torch.set_num_threads(t)
        samples: dict[tuple, list[float]] = {}
        for rep in range(reps + 1):
            t0 = time.perf_counter()
            floor.sum()
            if rep:
                samples.setdefault(("floor",), []).append(time.perf_counter() - t0)
            for name, ws in sets.items():
                for k in rows:
                    for way, fn in ways.items():
                        xs = inputs[(name, k)]
                        t0 = time.perf_counter()
                        for x, w, p in zip((xs[w.shape[1]] for w in ws), ws, packs[name]):
                            fn(x, [w], [p], t)
                        if rep:  # the first pass warms every shape up
                            samples.setdefault((name, k, way), []).append(time.perf_counter() - t0)
        med = {key: statistics.median(v) for key, v in samples.items()}
        print(f"\n{t} thread(s): memory floor (sum of 540 MB) {floor.numel() * 4 / med[('floor',)] / 1e9:.1f} GB/s")
        for name, ws in sets.items():
            size = sum(w.numel() * 4 for w in ws)
            print(f"{name} ({size / 1e6:.0f} MB)")
            print(f"{'k':>4}" + "".join(f"{way:>26}" for way in ways))
            for k in rows:
                cells = "".join(f"{1e3 * med[(name, k, way)]:9.2f} ({size / med[(name, k, way)] / 1e9:4.1f})"
                                f" [{med[(name, k, way)] / med[(name, rows[0], 'packed')]:4.2f}]" for way in ways)
                print(f"{k:>4}{cells}")


def main() -> None:
    args = parse_args()
    if args.kernel:
        kernel_bench([int(k) for k in args.rows.split(",")], [int(t) for t in args.threads.split(",")], args.reps)
        return
    args.threads = int(args.threads)
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
