"""Throughput of continuous batching at concurrency 1/4/16, with and without speculation.

    python bench/throughput.py [--drafter DIR --int8-head] [--per-slot 4 | --requests N] [--new-tokens 64
                               --concurrency 1,4,16 --reps 3 --profile-dir DIR --forward-profile]

On the embedded target (built and cached on first use), greedy, held-out prompts: for each
concurrency c, the first ``--per-slot`` × c of 64 drawn prompts (at least 16; or
``--requests N`` at every c) go through a ``BatchEngine`` that keeps at most c of them in
flight (requests join as others finish), so the load is sustained; with N = c the run is one
closed batch and measures how long its slowest request takes (plain rows all finish together,
speculative ones do not). Methods, measured back to back in the same run:

* ``plain``             -- no drafter: one token per request per round (the baseline);
* ``<drafter> fixed``   -- speculation with the drafter's γ every round;
* ``<drafter> adaptive``-- the cap chosen per round from survival estimates and the engine's
  round times per (batch size, cap), profiled on this machine at start for that drafter
  (``components.engine.adaptive.profile``; ``--profile-dir DIR`` keeps the profiles and reuses them;
  ``--forward-profile``: the older target-forward curve T(n) instead); 0 = plain round;
* ``prompt_lookup fixed/adaptive`` -- the model-free n-gram drafter, likewise;
* ``<drafter> tree``     -- with ``--tree-budget N``: fixed γ, and a token tree of N nodes
  whenever a single request is in flight (``BatchEngine(tree_budget=N)``).

``--drafter``: a trained drafter checkpoint (e.g. ``<run_dir>/train/drafter``); without it only
prompt lookup speculates. Every output is checked equal to plain greedy decoding (lossless).
Printed: tokens/s, τ, mean cap and the share of the time spent prefilling (of the last run), and
the ratio to plain at the same concurrency;
with ``--reps N`` every method runs N times, interleaved, and medians are shown. Nothing is
asserted about time.
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
from components.drafters.base import Drafter
from components.drafters.checkpoint import load_drafter
from components.drafters.quantize import int8_lm_head
from components.engine import PromptLookupDrafter
from components.engine.adaptive.policy import AdaptiveDraftLength
from components.engine.adaptive.profile import (
    profile_forward_time,
    profile_round_times,
    stored_round_times,
)
from components.engine.batch import BatchEngine, Request
from components.evaluation.prompts import eval_prompts
from components.target import load_target
from components.target.hf import resolve_target_path

POOL = 64  # held-out prompts drawn; each concurrency takes the first ones it needs


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", default="", help="trained drafter checkpoint directory")
    ap.add_argument("--requests", type=int, default=0, help="requests at every concurrency (default: --per-slot)")
    ap.add_argument("--per-slot", type=int, default=4, help="requests per slot of concurrency (at least 16 in all)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=1, help="runs per method, interleaved; medians are shown")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--int8-head", action="store_true", help="the drafter reads out through an int8 LM head")
    ap.add_argument("--profile-dir", default="",
                    help="keep each drafter's round profile here and reuse it while target, drafter and settings match")
    ap.add_argument("--tree-budget", type=int, default=0,
                    help="also run each drafter with token trees of this many nodes when one request is in flight")
    ap.add_argument("--forward-profile", action="store_true",
                    help="adaptive rows price rounds from the target's forward curve T(n), not profiled rounds")
    return ap.parse_args()


def run(target: Any, drafter: Any, prompts: list[list[int]], args: argparse.Namespace, conc: int,
        policy: Any = None, tree_budget: int = 0) -> tuple[float, list[list[int]], float, float, float]:
    """(seconds, outputs, τ, mean cap, share of the seconds spent prefilling) of all requests
    through one engine at concurrency ``conc``."""
    engine = BatchEngine(target, drafter, max_batch_size=conc, draft_length=policy, tree_budget=tree_budget)
    reqs = [Request(p, args.new_tokens) for p in prompts]
    t0 = time.perf_counter()
    results = engine.generate(reqs)
    seconds = time.perf_counter() - t0
    accepted = [a for r in results for a in r.accepted]
    tau = 1 + sum(accepted) / len(accepted) if accepted else 1.0
    cap = statistics.mean(engine.caps) if engine.caps else float(engine.max_cap)
    prefill = sum(r.prefill_seconds for r in results) / seconds
    return seconds, [r.tokens for r in results], tau, cap, prefill


def profile_policies(target: Any, drafters: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Per drafter, a maker of fresh adaptive policies over what was profiled here, printed."""
    if args.forward_profile:
        table = profile_forward_time(target)
        print("profiled T(n) ms: " + ", ".join(f"{int(x)}:{1000 * float(y):.1f}" for x, y in zip(table.xs, table.ys)))
        return {name: (lambda: AdaptiveDraftLength(table)) for name in drafters}
    top = max(int(c) for c in args.concurrency.split(","))
    sizes = sorted({1, top} | {b for b in (2, 4, 8, 16, 32, 64) if b < top})
    makers = {}
    for name, drafter in drafters.items():
        t0 = time.perf_counter()
        if args.profile_dir:
            stored = stored_round_times(args.profile_dir, target, drafter, sizes)
            rounds, reused = stored.times, stored.reused
        else:
            rounds, reused = profile_round_times(target, drafter, sizes), False
        how = f"stored in {args.profile_dir}" if reused else f"{time.perf_counter() - t0:.0f} s"
        print(f"profiled round ms, {name} ({how}), per batch size, caps 0..{rounds.max_cap}:")
        for b, row in zip(rounds.batch_sizes, rounds.seconds):
            print(f"  B={b:<3}" + " ".join(f"{1000 * float(x):6.1f}" for x in row))
        makers[name] = (lambda r=rounds: AdaptiveDraftLength(round_time=r))
    return makers


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = TargetConfig(device=args.device)
    target = load_target(cfg)
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = {c: args.requests or max(16, args.per_slot * c) for c in levels}
    pool = max(POOL, *counts.values())  # one draw whatever the levels: c = 4 alone runs c = 4's prompts
    prompts = [list(p.input_ids) for p in eval_prompts(EvalConfig(num_prompts=pool), target.tokenizer,
                                                Path(resolve_target_path(cfg)))]
    drafters = {"prompt_lookup": PromptLookupDrafter(target.vocab_size, 7, device=target.device)}
    if args.drafter:
        drafter = load_drafter(args.drafter, target).eval()
        drafters = {"drafter": int8_lm_head(drafter) if args.int8_head else drafter, **drafters}
    print(f"target {target.num_layers} layers, hidden {target.hidden_size}; requests x {args.new_tokens} new "
          f"tokens, greedy, {torch.get_num_threads()} thread(s), {args.device}")
    policies = profile_policies(target, drafters, args)
    print(f"{'conc':>4} {'reqs':>4} {'method':<24}{'tok/s':>9}{'tau':>7}{'cap':>6}{'prefill':>10}{'vs plain':>10}")
    modes = ("fixed", "adaptive", "tree") if args.tree_budget else ("fixed", "adaptive")
    methods = [("plain", None, "")] + [(name, d, mode) for name, d in drafters.items() for mode in modes
                                       if mode != "tree" or isinstance(d, Drafter)]  # trees: model drafters
    for conc in levels:
        seconds: dict[str, list[float]] = {}
        shown: dict[str, tuple[float, float, float]] = {}
        base_out = None
        for _ in range(args.reps):  # methods interleaved, so drift on a busy host hits all alike
            for name, drafter, mode in methods:
                policy = policies[name]() if mode == "adaptive" else None
                trees = args.tree_budget if mode == "tree" else 0
                secs, out, tau, cap, prefill = run(target, drafter, prompts[:counts[conc]], args, conc, policy, trees)
                base_out = out if base_out is None else base_out
                if out != base_out:
                    raise SystemExit(f"{name} {mode} at concurrency {conc}: output differs from plain greedy")
                label = f"{name} {mode}".strip()
                seconds.setdefault(label, []).append(secs)
                shown[label] = (tau, cap if drafter is not None else 0.0, prefill)
        total = sum(len(o) for o in base_out)
        base_s = statistics.median(seconds["plain"])
        for label, secs in seconds.items():
            med = statistics.median(secs)
            tau, cap, prefill = shown[label]
            print(f"{conc:>4} {counts[conc]:>4} {label:<24}{total / med:9.1f}{tau:7.2f}{cap:6.1f}"
                  f"{100 * prefill:9.0f}%{base_s / med:9.2f}x")


if __name__ == "__main__":
    main()
