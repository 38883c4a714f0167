"""What a draft slot costs in a batch round: the fast step's pass over B sequences (one new
token each, a plain round) against the same pass with draft rows added (each the next position
of one of the B sequences, as a verify pass lays them out), on the checkpoint's blocks.

    python bench/batch_rows.py [--batch 1,2,4,8,16 --context 200 --threads 2 --reps 9
                                --cache-dir DIR]

For each batch size B and each count of extra rows e, the median pass (interleaved reps), the
marginal milliseconds per extra row, and its **price**: that marginal time over a plain row's
share of the plain pass (T(B) / B). A draft pays for its slot only where it is accepted more
often than its price (before the engine's own per-round costs), so the price is the break-even
acceptance of a first draft at that batch. Beside it, the limit the arithmetic sets: one row's
FLOPs (every weight once, the head included) at the kernel's vector FMA peak measured in the same
run. SmolLM2-135M-Instruct in float32 (converted once into ``--cache-dir``). Nothing is
asserted; the numbers describe this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.target_step import median_ms
from components.config import SMOLLM2_TARGET, TargetConfig
from components.target import load_target
from components.target.fast import StepTarget, step_target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,2,4,8,16", help="batch sizes B (sequences, one new token each)")
    p.add_argument("--context", type=int, default=200, help="committed tokens of every sequence")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--cache-dir", default=str(Path("~/.cache/specline/targets").expanduser()))
    return p.parse_args(argv)


def extra_counts(batch: int) -> list[int]:
    """Extra rows tried at ``batch``: one, a quarter, half and all of the batch (distinct, ≥ 1)."""
    return sorted({1, max(1, batch // 4), max(1, batch // 2), batch})


def layout(batch: int, extra: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(seq [N], pos [N]) of a pass: every sequence's next token, then ``extra`` draft rows spread
    over the sequences round robin (each at its sequence's next free position), by sequence."""
    rows = [(b, context) for b in range(batch)]
    for j in range(extra):
        rows.append((j % batch, context + 1 + j // batch))
    rows.sort()
    return torch.tensor([s for s, _ in rows]), torch.tensor([p for _, p in rows])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = TargetConfig(name_or_path=SMOLLM2_TARGET, dtype="float32", device="cpu", cache_dir=args.cache_dir, step="fast")
    hf = load_target(cfg)
    step = step_target(hf, cfg)
    assert isinstance(step, StepTarget), "the fast step did not build here (no kernel): nothing to measure"
    dec, batches = step.decoder, [int(b) for b in args.batch.split(",")]
    pool = step.slot_pool(max(batches))
    gen = torch.Generator().manual_seed(0)
    for b in range(max(batches)):  # every sequence's committed context: real keys and values in its slots
        ids = torch.randint(0, hf.vocab_size, (args.context,), generator=gen)
        dec.forward_rows(ids, torch.full((args.context,), b), torch.arange(args.context), pool.k, pool.v)
    params = sum(p.numel() for p in hf.model.parameters())
    fma = dec.kernels.fma_rate(args.threads)  # GFLOP/s of the build's vector FMAs
    row_floor = 2 * params / 1e6 / fma  # ms: one row's products at that peak
    print(f"SmolLM2-135M on its blocks ({', '.join(step.weight_formats)}), kernel {dec.kernels.isa}, "
          f"{args.threads} threads, context {args.context}, {args.reps} reps, medians; one row's arithmetic at "
          f"the FMA peak ({fma:.0f} GFLOP/s): {row_floor:.2f} ms\n")
    print("| B | plain ms | ms a plain row | extra rows | ms | ms an extra row | price (of a plain row) | "
          "extra row over its FMA floor |")
    print("|---" * 8 + "|")
    for batch in batches:
        cases = [0] + extra_counts(batch)
        passes = {e: layout(batch, e, args.context) for e in cases}
        times: dict[int, list[float]] = {e: [] for e in cases}
        for rep in range(args.reps + 1):  # the first round warms up
            for e in cases:
                seq, pos = passes[e]
                ids = torch.randint(0, hf.vocab_size, (len(seq),), generator=gen)
                ms = median_ms(lambda i=ids, s=seq, p=pos: dec.forward_rows(i, s, p, pool.k, pool.v), 1)
                if rep:
                    times[e].append(ms)
        plain = statistics.median(times[0])
        for e in cases[1:]:
            ms = statistics.median(times[e])
            per = (ms - plain) / e
            print(f"| {batch} | {plain:.2f} | {plain / batch:.2f} | {e} | {ms:.2f} | {per:.2f} | "
                  f"{per / (plain / batch):.2f} | {per / row_floor:.2f} |", flush=True)


if __name__ == "__main__":
    main()
