"""The serve stage's engine in a closed loop, in process: speculation on and off over the same
prompts, without HTTP, Ray or the replica's threads around it.

    python bench/closed_loop.py [--method suffix|hybrid|model] [--drafter DIR] [--rollouts DATA_DIR]
                                [--concurrency 1,8] [--requests N] [--new-tokens 64] [--threads 2] [--reps 2]
                                [--step-precision float32|bfloat16|int8|int16] [--prefix-cache-tokens N]

Builds the engine as a replica builds it (``serving.assemble.build_parts`` and ``adapt``: the
served drafter, its adaptive cap and its round profile, measured once per host and cached), then
at each concurrency level C keeps C requests in the engine: each time one finishes, the next
held-out prompt joins (``bench/serve.py``'s prompts, the embedded target's held-out split), as
C closed-loop clients would. Each level runs ``spec on`` and then ``spec off`` (the same
requests with ``Request.speculate`` False: plain decoding in the same engine) over the same
prompts, ``--reps`` times; suffix decoding learns every finished response, so each level and
repetition has prompts of its own, and speculation runs first, so that no request is drafted
from its own earlier answer. Every spec-on output is checked equal to its spec-off twin (greedy).

Reported per level, mode and repetition: tokens/s over the wall time, the engine's rounds and
where their time went (prefill, target passes, drafting, the rest: ``BatchEngine.stats``), τ
over the drafting rows and the share of row-rounds that drafted, the prompt tokens copied from
kept prefixes; then spec on / off per repetition. ``--prefix-cache-tokens`` N > 0 serves with
``serve.prefix_cache_tokens`` N, the store emptied before each mode, so that either mode copies
only what earlier prompts of its own left (default 0: off; the serve stage's default keeps 4,096
tokens). Against ``bench/serve.py`` this leaves out the HTTP server, the replica's event loop and
its streaming: a gap between the two is theirs. Nothing is asserted about time.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import EvalConfig, ServeConfig, TargetConfig
from components.engine.batch import Request
from components.engine.batch.stats import EngineStats
from components.evaluation.prompts import eval_prompts
from components.serving.assemble import build_parts
from components.serving.provenance import DrafterSource
from components.spec.sampling import GREEDY
from components.target.hf import resolve_target_path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="suffix", choices=["suffix", "hybrid", "model"],
                    help="what drafts: suffix decoding, the hybrid (needs --drafter), the trained drafter")
    ap.add_argument("--drafter", default="", help="drafter checkpoint directory (model, hybrid)")
    ap.add_argument("--rollouts", default="none", help="a data directory whose responses start suffix decoding's tree")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--requests", type=int, default=0, help="requests per level and repetition (default max(16, 4 x C))")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads, as serve.torch_threads")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prefix-cache-tokens", type=int, default=0,
                    help="serve.prefix_cache_tokens (emptied before each mode; 0: off)")
    ap.add_argument("--step-precision", default="float32", choices=["float32", "bfloat16", "int8", "int16"],
                    help="target.step_precision (the fast step's block products on bfloat16 or integer inputs)")
    args = ap.parse_args()
    if args.method != "suffix" and not args.drafter:
        ap.error(f"--method {args.method} needs --drafter (a checkpoint directory)")
    return args


def closed_loop(engine: Any, prompts: list[list[int]], concurrency: int, new_tokens: int,
                speculate: bool) -> tuple[list[list[int]], float]:
    """Every prompt through ``engine`` with at most ``concurrency`` in it at once, the next one
    joining as one finishes; (outputs in prompt order, wall seconds)."""
    queue, outputs, ids = list(enumerate(prompts)), [[] for _ in prompts], {}
    start = time.perf_counter()

    def send() -> None:
        i, prompt = queue.pop(0)
        ids[engine.add(Request(prompt, new_tokens, GREEDY, seed=i, speculate=speculate))] = i

    while queue and len(ids) < concurrency:
        send()
    while engine.has_work:
        for out in engine.step():
            if out.finished and out.result is not None:
                outputs[ids[out.request_id]] = list(out.result.tokens)
                if queue:
                    send()
    return outputs, time.perf_counter() - start


def delta(after: EngineStats, before: EngineStats) -> dict[str, float]:
    """What the engine counted between two snapshots of its stats."""
    names = ("rounds", "row_rounds", "tokens", "drafting_rounds", "accepted", "draft_seconds", "verify_seconds",
             "prefill_seconds", "busy_seconds", "prompt_tokens", "prefix_hit_tokens")
    return {n: getattr(after, n) - getattr(before, n) for n in names}


def report(conc: int, mode: str, rep: int, tokens: int, secs: float, d: dict[str, float], base: float | None) -> float:
    rest = d["busy_seconds"] - d["prefill_seconds"] - d["verify_seconds"] - d["draft_seconds"]
    tau = 1 + d["accepted"] / d["drafting_rounds"] if d["drafting_rounds"] else float("nan")
    share = d["drafting_rounds"] / d["row_rounds"] if d["row_rounds"] else 0.0
    rate = tokens / secs
    ratio = f"{rate / base:6.2f}x" if base else f"{'-':>7}"
    print(f"{conc:>4} {mode:<8} {rep:>3} {secs:7.2f} {rate:8.1f} {ratio} {d['rounds']:7.0f} "
          f"{d['prefill_seconds']:8.2f} {d['verify_seconds']:8.2f} {d['draft_seconds']:7.2f} {rest:6.2f} "
          f"{1e3 * rest / max(1, d['rounds']):7.2f} {tau:6.2f} {share:7.2f}")
    if d["prefix_hit_tokens"]:
        print(f"{'':>4} {mode:<8} prompt tokens copied from kept prefixes: {d['prefix_hit_tokens']:.0f} of "
              f"{d['prompt_tokens']:.0f} ({d['prefix_hit_tokens'] / d['prompt_tokens']:.1%})")
    return rate


def main() -> None:
    args = parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    counts = {c: args.requests or max(16, 4 * c) for c in levels}
    target = TargetConfig(name_or_path="embedded", step_precision=args.step_precision)
    path = resolve_target_path(target)
    sc = ServeConfig(max_ongoing_requests=max(levels), torch_threads=args.threads, drafter=args.method,
                     prefix_cache_tokens=args.prefix_cache_tokens,
                     suffix_rollouts=str(Path(args.rollouts).resolve()) if args.rollouts != "none" else "none")
    source = DrafterSource(str(Path(args.drafter).resolve()) if args.drafter else None, "bench", method=args.method)
    parts = build_parts(target, sc, path, source)
    engine = parts.engine
    need = sum(counts.values()) * args.reps
    from transformers import AutoTokenizer

    prompts = [list(p.input_ids) for p in eval_prompts(EvalConfig(num_prompts=need), AutoTokenizer.from_pretrained(path),
                                                       Path(path))]
    if len(prompts) < need:
        print(f"note: {len(prompts)} held-out prompts for {need} requests: later ones repeat prompts the engine "
              "has learnt", file=sys.stderr)
    print(f"{parts.settings['drafter']} in the serve stage's engine, in process: {args.threads} thread(s), "
          f"round profile {parts.settings['round_profile']}; {args.new_tokens} tokens a request, greedy")
    print(f"{'conc':>4} {'mode':<8} {'rep':>3} {'secs':>7} {'tok/s':>8} {'on/off':>7} {'rounds':>7} "
          f"{'prefill':>8} {'passes':>8} {'draft':>7} {'rest':>6} {'ms/rnd':>7} {'tau':>6} {'drafted':>7}")
    start, ratios = 0, {c: [] for c in levels}
    for conc in levels:
        for rep in range(args.reps):
            mine = [prompts[(start + i) % len(prompts)] for i in range(counts[conc])]
            start += counts[conc]
            done: dict[bool, tuple[list[list[int]], float, dict[str, float]]] = {}
            for speculate in (True, False):  # speculation first: the tree learns these answers
                if engine.prefixes is not None:  # each mode copies only what its own earlier prompts left
                    engine.prefixes.clear()
                before = dataclasses.replace(engine.stats)
                outs, secs = closed_loop(engine, mine, conc, args.new_tokens, speculate)
                done[speculate] = outs, secs, delta(engine.stats, before)
            if done[True][0] != done[False][0]:
                raise SystemExit(f"concurrency {conc}: speculative output differs from plain decoding's")
            base = None
            for speculate, mode in ((False, "spec off"), (True, "spec on")):
                outs, secs, d = done[speculate]
                rate = report(conc, mode, rep, sum(map(len, outs)), secs, d, base)
                base = base or rate
            ratios[conc].append(done[False][1] / done[True][1])
    for conc in levels:
        print(f"concurrency {conc}: spec on / off " + ", ".join(f"{r:.3f}x" for r in ratios[conc])
              + "; every output equal to plain decoding's")


if __name__ == "__main__":
    main()
