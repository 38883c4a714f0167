"""Prompt prefixes kept across requests (``serve.prefix_cache_tokens``) where they matter most: a
chat's later turns, each resending the whole conversation so far.

    python bench/prefix_cache.py [--conversations 6] [--turns 4] [--new-tokens 64] [--concurrency 2]
                                 [--prefix-cache-tokens 4096] [--threads 2] [--reps 2]

The embedded target behind the fast step, in the serve stage's batch engine (plain decoding), in
process. Each conversation starts from one of the held-out chat prompts; each later turn is the
conversation so far, the assistant's reply, and a follow-up user message in the chat template.
Turn by turn, every conversation's prompt goes through the engine with at most ``--concurrency``
in it at once. The same conversations run with the store off and with a store of
``--prefix-cache-tokens`` tokens, alternated ``--reps`` times, each engine fresh; the replies are
checked equal (the store changes no bits). Reported per mode: wall seconds, the engine's prefill
seconds, the prompt tokens and the share copied from kept prefixes, and per turn the prefill
seconds per request (the engine's admission time, shared by the requests it admitted). Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.closed_loop import closed_loop
from components.config import EvalConfig, TargetConfig
from components.engine.batch import BatchEngine
from components.evaluation.prompts import eval_prompts, prompt_set
from components.target import load_target
from components.target.fast import step_target
from components.target.hf import resolve_target_path

FOLLOW_UPS = ("Tell me more about that.", "Can you give an example?", "Summarise that in one sentence.",
              "What would you add?", "Why is that?", "Say it more simply.")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=2)
    ap.add_argument("--prefix-cache-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    return ap.parse_args()


def turn_suffix(tokenizer: Any, text: str) -> list[int]:
    """The ids that close an assistant reply and open the next user turn and the assistant's answer."""
    return tokenizer(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n",
                     add_special_tokens=False)["input_ids"]


def converse(engine: BatchEngine, starts: list[list[int]], follow_ups: list[list[int]], turns: int, new_tokens: int,
             concurrency: int) -> tuple[list[list[int]], float, list[float]]:
    """Every conversation through ``turns`` turns → (every reply, in order; wall seconds; each
    turn's prefill seconds per request)."""
    prompts, replies, prefill = [list(s) for s in starts], [], []
    clock = time.perf_counter()
    for turn in range(turns):
        before = engine.stats.prefill_seconds
        got, _ = closed_loop(engine, prompts, concurrency, new_tokens, speculate=False)
        replies += got
        prompts = [p + r + follow_ups[(i + turn) % len(follow_ups)] for i, (p, r) in enumerate(zip(prompts, got))]
        prefill.append((engine.stats.prefill_seconds - before) / len(prompts))
    return replies, time.perf_counter() - clock, prefill


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    path = resolve_target_path(TargetConfig())
    cfg = TargetConfig(name_or_path=path)
    target = step_target(load_target(cfg, progress=False), cfg, lines=print)
    if target.batch_cache != "slots":
        raise SystemExit("the store needs the fast step (target.step: fast), which this CPU does not run")
    target.prefill_threads = args.threads
    tokenizer = target.tokenizer
    chats = [list(p.input_ids) for p in eval_prompts(EvalConfig(num_prompts=args.conversations), tokenizer, Path(path))
             if prompt_set(p.prompt_id) == "chat"][:args.conversations]
    follow_ups = [turn_suffix(tokenizer, text) for text in FOLLOW_UPS]
    print(f"{len(chats)} conversations x {args.turns} turns x {args.new_tokens} tokens, greedy, concurrency "
          f"{args.concurrency}, {args.threads} thread(s)")
    print(f"{'mode':<14} {'rep':>3} {'secs':>7} {'prefill s':>9} {'prompt tok':>10} {'copied':>7}  "
          "prefill per request, turn by turn (ms)")
    replies: dict[int, list[list[int]]] = {}
    for rep in range(args.reps):
        for size in (0, args.prefix_cache_tokens):
            engine = BatchEngine(target, None, max_batch_size=args.concurrency, prefix_tokens=size)
            got, secs, prefill = converse(engine, chats, follow_ups, args.turns, args.new_tokens, args.concurrency)
            if replies.setdefault(rep, got) != got:
                raise SystemExit("the replies with the store differ from those without it")
            s = engine.stats
            mode = f"store {size}" if size else "store off"
            print(f"{mode:<14} {rep:>3} {secs:7.2f} {s.prefill_seconds:9.2f} {s.prompt_tokens:10d} "
                  f"{s.prefix_hit_tokens / max(1, s.prompt_tokens):7.1%}  "
                  + " / ".join(f"{1e3 * t:.0f}" for t in prefill))
    print("replies equal with and without the store")


if __name__ == "__main__":
    main()
