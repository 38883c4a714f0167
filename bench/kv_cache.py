"""The preallocated KV cache against HF's grow-by-cat cache, in the batch engine's decode rounds.

    python bench/kv_cache.py [--batch 1,16 --context 64,768 --new-tokens 48 --reps 3 --drafter DIR
                              --requests N]

On the embedded target, greedy: ``batch`` requests, each a held-out prompt stretched to
``context`` tokens (held-out prompts joined), decode ``--new-tokens`` tokens through a
``BatchEngine`` with ``preallocate=True`` (``components.engine.cache.slab``: keys/values written
in place in a buffer with headroom) and ``preallocate=False`` (every round ``torch.cat``s every
layer's keys/values), interleaved ``--reps`` times; medians of the decode time (prefill
excluded: it is the same for both). ``--requests N`` (> batch): N requests, at most ``batch``
in flight, joining as others finish (rows leave and join nearly every round). Both run plain decoding and speculation (prompt lookup, or
``--drafter DIR``); outputs are checked equal. The cat copies the whole cache every round, so
the gap grows with batch × context; on this CPU's tiny target the forward dominates, on a GPU
target it would not. Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import components.drafters  # noqa: F401  (registers every family)
from components.config import EvalConfig, TargetConfig
from components.drafters.checkpoint import load_drafter
from components.engine import PromptLookupDrafter
from components.engine.batch import BatchEngine, Request
from components.evaluation.prompts import eval_prompts
from components.target import load_target
from components.target.hf import resolve_target_path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", default="64,768", help="prompt lengths in tokens")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--drafter", default="", help="a trained drafter checkpoint (default: prompt lookup)")
    ap.add_argument("--requests", type=int, default=0, help="requests per run (default: one closed batch)")
    return ap.parse_args()


def stretched_prompts(pool: list[list[int]], count: int, length: int) -> list[list[int]]:
    """``count`` prompts of exactly ``length`` tokens: held-out prompt i followed by the next ones."""
    out = []
    for i in range(count):
        ids: list[int] = []
        j = i
        while len(ids) < length:
            ids += pool[j % len(pool)]
            j += 1
        out.append(ids[-length:])
    return out


def decode_seconds(target: Any, drafter: Any, prompts: list[list[int]], new_tokens: int, batch: int,
                   prealloc: bool) -> tuple[float, list[list[int]]]:
    """(seconds, outputs) of all prompts, at most ``batch`` in flight; the seconds exclude the
    prefills (each request's share of its admission pass), which are the same either way."""
    engine = BatchEngine(target, drafter, max_batch_size=batch, preallocate=prealloc)
    t0 = time.perf_counter()
    results = engine.generate(Request(p, new_tokens) for p in prompts)
    seconds = time.perf_counter() - t0 - sum(r.prefill_seconds for r in results)
    return seconds, [r.tokens for r in results]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = TargetConfig()
    target = load_target(cfg)
    pool = [list(p.input_ids) for p in eval_prompts(EvalConfig(num_prompts=64), target.tokenizer,
                                                   Path(resolve_target_path(cfg)))]
    drafter = (load_drafter(args.drafter, target).eval() if args.drafter
               else PromptLookupDrafter(target.vocab_size, 7, device=target.device))
    name = "drafter" if args.drafter else "prompt_lookup"
    load = f"{args.requests} requests, joining as others finish" if args.requests else "closed batches"
    print(f"target {target.num_layers} layers, {args.new_tokens} new tokens, greedy, {load}, "
          f"{torch.get_num_threads()} thread(s); decode seconds (prefill excluded), median of {args.reps}")
    print(f"{'batch':>5} {'context':>7} {'method':<14}{'cat s':>9}{'prealloc s':>12}{'cat/prealloc':>14}")
    for batch in [int(b) for b in args.batch.split(",")]:
        for context in [int(c) for c in args.context.split(",")]:
            prompts = stretched_prompts(pool, max(batch, args.requests), context)
            for label, d in (("plain", None), (name, drafter)):
                times: dict[bool, list[float]] = {True: [], False: []}
                ref = None
                for rep in range(args.reps):
                    for prealloc in ((False, True) if rep % 2 == 0 else (True, False)):  # neither always first
                        secs, out = decode_seconds(target, d, prompts, args.new_tokens, batch, prealloc)
                        ref = out if ref is None else ref
                        if out != ref:
                            raise SystemExit(f"{label} batch {batch} context {context}: outputs differ")
                        times[prealloc].append(secs)
                cat, pre = statistics.median(times[False]), statistics.median(times[True])
                print(f"{batch:>5} {context:>7} {label:<14}{cat:9.3f}{pre:12.3f}{cat / pre:13.2f}x")


if __name__ == "__main__":
    main()
