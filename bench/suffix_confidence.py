"""How often suffix decoding's draft tokens are right, per match length: what its confidences learn.

    python bench/suffix_confidence.py [--prompts 4 --new-tokens 64 --passes 2 --threads 1]

Runs suffix decoding (``SuffixDrafter`` in the batch-1 engine, greedy, each response then
joining the global tree, as the eval stage's ``suffix`` method does) over the eval stage's
held-out prompts of the embedded target (``--prompts`` per set: HumanEval, chat, summarise),
``--passes`` times over the same prompts (a prompt's own earlier response is dropped before it
runs again). Every output is checked equal to plain greedy decoding. Then prints what the
drafter's ``MatchCalibration`` counted: per cell (the match length the draft tokens were read
after, which tree, the tree's own count ratio for them and how many occurrences it was read
over: what the confidences were before they were learned) how many tokens its candidates predicted and how many the committed ids
confirmed; then per match length over every cell. Nothing is asserted; the table is the
measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import EvalConfig, TargetConfig
from components.engine import SpeculativeEngine, suffix_drafter, target_only_generate
from components.engine.match_calibration import DEPTH_EDGES, OCCURRENCE_EDGES, RATIO_EDGES
from components.evaluation.prompts import eval_prompts
from components.spec.sampling import GREEDY
from components.target import load_target
from components.target.fast import step_target
from components.target.hf import resolve_target_path


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=4, help="per prompt set")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args()


def depth_label(bucket: int) -> str:
    lo = DEPTH_EDGES[bucket]
    hi = DEPTH_EDGES[bucket + 1] - 1 if bucket + 1 < len(DEPTH_EDGES) else None
    return f"{lo}" if hi == lo else f"{lo}-{hi}" if hi is not None else f"{lo}+"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    cfg = TargetConfig(name_or_path="embedded")
    path = resolve_target_path(cfg, progress=True)
    target = load_target(dataclasses.replace(cfg, name_or_path=path), progress=False)
    fast = step_target(target, cfg)
    ev = EvalConfig(num_prompts=args.prompts, max_new_tokens=args.new_tokens)
    prompts = eval_prompts(ev, target.tokenizer, Path(path))
    drafter = suffix_drafter(ev, target.vocab_size)  # the eval stage's suffix settings
    engine = SpeculativeEngine(fast, drafter)
    refs = {p.prompt_id: target_only_generate(fast, list(p.input_ids), args.new_tokens, GREEDY, p.seed).tokens
            for p in prompts}
    for _ in range(args.passes):
        for p in prompts:
            drafter.forget(tuple(p.input_ids))
            out = engine.generate(list(p.input_ids), args.new_tokens, GREEDY, p.seed)
            if out.tokens != refs[p.prompt_id]:
                raise SystemExit(f"{p.prompt_id}: suffix decoding's output differs from plain decoding's")
            drafter.observe(out.tokens, key=tuple(p.input_ids))
    cal = drafter.calibration
    print(f"{len(prompts)} prompts x {args.new_tokens} tokens x {args.passes} passes, greedy, lossless; "
          f"ratio buckets: < {RATIO_EDGES[0]}, < {RATIO_EDGES[1]}, about 1")
    occurrences = [f"{lo}" if hi == lo + 1 else f"{lo}+" if hi is None else f"{lo}-{hi - 1}"
                   for lo, hi in zip(OCCURRENCE_EDGES, [*OCCURRENCE_EDGES[1:], None])]
    print(f"{'match':>6} {'tree':>7} {'ratio':>6} {'seen':>5} {'predicted':>9} {'confirmed':>9} {'rate':>6}")
    for (depth, ratio, shared, seen), (hits, trials) in cal.table().items():
        print(f"{depth_label(depth):>6} {'global' if shared else 'request':>7} {['<.5', '.5-1', '~1'][ratio]:>6} "
              f"{occurrences[seen]:>5} {trials:9d} {hits:9d} {hits / trials:6.2f}")
    print("by match length (every tree and ratio):")
    for depth in range(len(DEPTH_EDGES)):
        cells = [(h, n) for c, (h, n) in cal.table().items() if c[0] == depth]
        hits, trials = sum(h for h, _ in cells), sum(n for _, n in cells)
        if trials:
            print(f"{depth_label(depth):>6}: {hits}/{trials} = {hits / trials:.2f}")


if __name__ == "__main__":
    main()
