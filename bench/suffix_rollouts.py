"""Suffix decoding from an empty global tree against one that starts with the data stage's rollouts.

    python bench/suffix_rollouts.py --data runs/data [--prompts 8 --new-tokens 64 --reps 2 --threads 1]

On the eval stage's held-out prompts of the embedded target (``--prompts`` per set: HumanEval,
chat, summarise) it decodes, prompt by prompt and interleaved so that a noisy machine's drift
hits all alike: plain decoding (the fast step), suffix decoding whose global tree starts empty
(``suffix_rollouts: none``), and suffix decoding whose tree starts with the responses of the
rollouts in ``--data`` (a data stage's output directory: ``suffix_rollouts`` naming it), both as
the eval stage's ``suffix`` method runs them (the batch-1 engine; each response then joins the
tree, never drafted from by its own prompt). Every output is checked equal to plain decoding's.
``--reps`` passes over the prompts, each with fresh drafters. Prints per prompt set and over all:
tokens/s, target passes, tokens per pass, and each suffix variant's speedup over plain decoding
measured in the same pass; then the time to read the rollouts and fill the tree. Nothing is
asserted about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import EvalConfig, TargetConfig
from components.data.shards import read_responses
from components.engine import SpeculativeEngine, suffix_drafter, target_only_generate
from components.evaluation.prompts import eval_prompts, prompt_set
from components.spec.sampling import GREEDY
from components.target import load_target
from components.target.fast import step_target
from components.target.hf import resolve_target_path

VARIANTS = ("plain", "suffix, empty tree", "suffix, from rollouts")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a data stage's output directory (shards + manifest.json)")
    ap.add_argument("--prompts", type=int, default=8, help="per prompt set")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2, help="passes over the prompts, fresh drafters each")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    cfg = TargetConfig(name_or_path="embedded")
    path = resolve_target_path(cfg, progress=True)
    target = load_target(dataclasses.replace(cfg, name_or_path=path), progress=False)
    fast = step_target(target, cfg)
    torch.set_num_threads(args.threads)  # after loading: building a target sets its own count
    ev = EvalConfig(num_prompts=args.prompts, max_new_tokens=args.new_tokens)
    prompts = eval_prompts(ev, target.tokenizer, Path(path))
    clock = time.perf_counter()
    responses = list(read_responses(Path(args.data), target.tokenizer_hash))
    read_s = time.perf_counter() - clock
    seconds: dict[tuple[str, str], float] = defaultdict(float)  # (variant, set) → decoding seconds
    passes: dict[tuple[str, str], int] = defaultdict(int)
    tokens: dict[str, int] = defaultdict(int)
    fill_s = 0.0
    for _ in range(args.reps):
        clock = time.perf_counter()
        drafters = {"suffix, empty tree": suffix_drafter(ev, target.vocab_size),
                    "suffix, from rollouts": suffix_drafter(ev, target.vocab_size, responses=responses)}
        engines = {label: SpeculativeEngine(fast, drafter) for label, drafter in drafters.items()}
        fill_s += time.perf_counter() - clock
        for p in prompts:
            ids, name = list(p.input_ids), prompt_set(p.prompt_id)
            ref = target_only_generate(fast, ids, args.new_tokens, GREEDY, p.seed)
            seconds["plain", name] += ref.total_seconds
            passes["plain", name] += ref.target_forwards
            tokens[name] += len(ref.tokens)
            for label, drafter in drafters.items():
                out = engines[label].generate(ids, args.new_tokens, GREEDY, p.seed)
                if out.tokens != ref.tokens:
                    raise SystemExit(f"{p.prompt_id}: {label}: output differs from plain decoding's")
                clock = time.perf_counter()
                drafter.observe(out.tokens, key=tuple(ids))
                seconds[label, name] += out.total_seconds + time.perf_counter() - clock
                passes[label, name] += out.target_forwards
    sets = sorted(tokens) + ["all"]
    for variant in VARIANTS:
        for name in sorted(tokens):
            seconds[variant, "all"] += seconds[variant, name]
            passes[variant, "all"] += passes[variant, name]
    tokens["all"] = sum(tokens[n] for n in sets[:-1])
    print(f"{len(prompts)} prompts x {args.new_tokens} tokens x {args.reps} passes, greedy, every output equal "
          f"to plain decoding's; {len(responses)} rollout responses ({sum(map(len, responses)):,} tokens) "
          f"from {args.data}; {torch.get_num_threads()} thread(s)")
    print(f"{'variant':<24}{'set':<11}{'tok/s':>8}{'passes':>8}{'tok/pass':>9}{'vs plain':>9}")
    for name in sets:
        for variant in VARIANTS:
            rate = tokens[name] / seconds[variant, name]
            speedup = seconds["plain", name] / seconds[variant, name]
            print(f"{variant:<24}{name:<11}{rate:8.1f}{passes[variant, name]:8d}"
                  f"{tokens[name] / passes[variant, name]:9.2f}{speedup:8.2f}x")
    print(f"reading the rollouts {read_s:.2f} s; building a drafter with them {fill_s / args.reps:.2f} s "
          "(each start of an eval method or a replica)")


if __name__ == "__main__":
    main()
