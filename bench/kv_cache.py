"""The preallocated KV cache against HF's grow-by-cat cache, in the batch engine's decode rounds.

    python bench/kv_cache.py [--batch 1,16 --context 64,768 --new-tokens 48 --reps 3 --drafter DIR]

On the embedded target, greedy: ``batch`` requests, each a held-out prompt stretched to
``context`` tokens (held-out prompts joined), decode ``--new-tokens`` tokens through a
``BatchEngine`` with ``preallocate=True`` (``components.engine.kv_slab``: keys/values written
in place in a buffer with headroom) and ``preallocate=False`` (every round ``torch.cat``s every
layer's keys/values), interleaved ``--reps`` times; medians of the decode time (prefill
excluded: it is the same for both). Both run plain decoding and speculation (prompt lookup, or
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


def decode_seconds(target: Any, drafter: Any, prompts: list[list[int]], new_tokens: int,
                   prealloc: bool) -> tuple[float, list[list[int]]]:
    """(seconds of the rounds after admission, outputs) of all prompts as one closed batch."""
    engine = BatchEngine(target, drafter, max_batch_size=len(prompts), preallocate=prealloc)
    for p in prompts:
        engine.add(Request(p, new_tokens))
    outs: dict[str, list[int]] = {}
    engine.step()  # admission: every prompt prefilled, first tokens out
    t0 = time.perf_counter()
    while engine.has_work:
        for o in engine.step():
            if o.finished and o.result is not None:
                outs[o.request_id] = o.result.tokens
    return time.perf_counter() - t0, [outs[k] for k in sorted(outs, key=lambda r: int(r.split("-")[-1]))]


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
    print(f"target {target.num_layers} layers, {args.new_tokens} new tokens, greedy, "
          f"{torch.get_num_threads()} thread(s); decode seconds, median of {args.reps}")
    print(f"{'batch':>5} {'context':>7} {'method':<14}{'cat s':>9}{'prealloc s':>12}{'cat/prealloc':>14}")
    for batch in [int(b) for b in args.batch.split(",")]:
        for context in [int(c) for c in args.context.split(",")]:
            prompts = stretched_prompts(pool, batch, context)
            for label, d in (("plain", None), (name, drafter)):
                times: dict[bool, list[float]] = {True: [], False: []}
                ref = None
                for rep in range(args.reps):
                    for prealloc in ((False, True) if rep % 2 == 0 else (True, False)):  # neither always first
                        secs, out = decode_seconds(target, d, prompts, args.new_tokens, prealloc)
                        ref = out if ref is None else ref
                        if out != ref:
                            raise SystemExit(f"{label} batch {batch} context {context}: outputs differ")
                        times[prealloc].append(secs)
                cat, pre = statistics.median(times[False]), statistics.median(times[True])
                print(f"{batch:>5} {context:>7} {label:<14}{cat:9.3f}{pre:12.3f}{cat / pre:13.2f}x")


if __name__ == "__main__":
    main()
