"""Speedup of the speculative engine over target-only decoding, batch 1, greedy, same run.

    python bench/engine.py [--drafter DIR --tree-budget 16 --new-tokens 64 --prompts 4 --reps 3 --int8-head
                            --prompt-set heldout|code --target-step auto|hf]

On the embedded target (built and cached on first use) and its held-out prompts (the
evaluation stage's; ``--prompt-set code``: short code openings instead) it times, per prompt, plain greedy
decoding (``target_only_generate``) and the engine with: the drafter (a trained checkpoint from
``--drafter``, else a random-init DSpark, expect < 1x), the same drafter with token trees of
``--tree-budget`` nodes (``TreeEngine``: DDTree, and DominoTree from a causal head if the drafter
has one; 0 skips), with ``--int8-head`` the drafter reading out through an int8 LM head,
prompt lookup (model-free), and an oracle that
proposes the target's own greedy continuation for free (the upper bound of a perfect drafter at
this γ). The target runs as the evaluation stage runs it (``--target-step auto``: the fast step
where ``target.step`` chooses it, with the drafter's own linears streamed by its kernel,
``target.draft_weights``; token trees verify on the transformers forward, as the evaluation's
``drafter_tree`` does); ``hf`` keeps the transformers forward and torch's products for both.
Every engine output is checked equal to the baseline. Printed: tokens/s, τ, draft/verify
time shares, and the speedup as a ratio of medians measured in this run. Nothing is asserted
about time.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import components.drafters  # noqa: F401  (registers every family)
from components.config import DrafterConfig, EvalConfig, TargetConfig
from components.drafters.capabilities import Capability, has
from components.drafters.checkpoint import load_drafter
from components.drafters.quantize import int8_lm_head
from components.drafters.registry import build_drafter
from components.engine import (
    GenerationResult,
    OracleDrafter,
    PromptLookupDrafter,
    SpeculativeEngine,
    TreeEngine,
    target_only_generate,
)
from components.evaluation.prompts import eval_prompts
from components.target import load_target
from components.target.fast import step_target, stream_linears
from components.target.hf import resolve_target_path

PROMPTS = ["def main(args):\n    ", "import os\nimport sys\n", "class Foo:\n    def __init__(self",
           "for i in range(10):\n    ", "    return self._", "if __name__ == '__main__':\n"]


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-set", choices=("heldout", "code"), default="heldout",
                    help="heldout: the evaluation stage's held-out prompts of the embedded target; "
                         "code: short hand-written code openings (no BOS, off the training distribution)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-speculative-tokens", type=int, default=0, help="γ: draft tokens per round (0: the drafter's default)")
    ap.add_argument("--drafter", default="", help="trained drafter checkpoint (default: random-init DSpark)")
    ap.add_argument("--tree-budget", type=int, default=16, help="token-tree nodes per round (0: no tree run)")
    ap.add_argument("--int8-head", action="store_true",
                    help="also run the drafter with an int8 readout head (components/drafters/quantize.py)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--target-step", choices=("auto", "hf"), default="auto",
                    help="auto: the evaluation stage's target step and streamed drafter linears; hf: transformers' forward")
    ap.add_argument("--threads", type=int, default=1)
    return ap.parse_args()


def median_run(fn: Any, reps: int) -> GenerationResult:
    """The run with the median total time among ``reps`` (after one warmup)."""
    fn()
    runs = sorted((fn() for _ in range(reps)), key=lambda r: r.total_seconds)
    return runs[len(runs) // 2]


def bench_prompt(target: Any, engines: dict[str, Any], prompt: list[int], args: argparse.Namespace) -> dict:
    base = median_run(lambda: target_only_generate(target, prompt, args.new_tokens), args.reps)
    rows = {"target-only": (base, 1.0)}
    for name, make in engines.items():
        engine = make(prompt, base.tokens)
        res = median_run(lambda e=engine: e.generate(prompt, args.new_tokens), args.reps)
        if res.tokens != base.tokens:
            raise SystemExit(f"{name}: output differs from target-only greedy decoding (not lossless)")
        rows[name] = (res, base.total_seconds / res.total_seconds)
    return rows


def report(all_rows: list[dict], new_tokens: int) -> None:
    print(f"{'method':<22}{'tok/s':>9}{'tau':>7}{'draft%':>8}{'verify%':>9}{'speedup':>9}")
    for name in all_rows[0]:
        res = [rows[name][0] for rows in all_rows]
        secs = statistics.median(r.total_seconds for r in res)
        tau = statistics.mean(r.tau for r in res) if res[0].accepted else 1.0
        draft = statistics.mean(r.draft_seconds / r.total_seconds for r in res)
        verify = statistics.mean(r.verify_seconds / r.total_seconds for r in res)
        speed = statistics.median(rows[name][1] for rows in all_rows)
        print(f"{name:<22}{new_tokens / secs:9.1f}{tau:7.2f}{100 * draft:7.0f}%{100 * verify:8.0f}%{speed:8.2f}x")


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    target = load_target(TargetConfig(device=args.device))
    if args.drafter:
        dspark, label = load_drafter(args.drafter, target).eval(), "drafter"
    else:
        dspark, label = build_drafter(DrafterConfig(name="dspark"), target).eval(), "dspark (random init)"
    gamma = args.num_speculative_tokens or None
    quantized = int8_lm_head(copy.deepcopy(dspark)) if args.int8_head else None
    cfg = TargetConfig(device=args.device, step=args.target_step)
    # chains and the baseline; token trees keep the transformers forward, as the eval's
    step = step_target(target, cfg, taps=list(dspark.layer_ids), lines=print)
    if step is not target:  # as the evaluation stage runs a drafter beside the fast step
        stream_linears(target, cfg, modules=[dspark], keep_target=True, lines=print)
    engines = {
        label: lambda p, ref: SpeculativeEngine(step, dspark, "greedy", gamma),
        **({f"{label.split()[0]}, int8 head": lambda p, ref: SpeculativeEngine(step, quantized, "greedy", gamma)}
           if quantized is not None else {}),
        **({f"{label.split()[0]} tree {args.tree_budget}": lambda p, ref: TreeEngine(
            target, dspark, "greedy", gamma, budget=args.tree_budget)} if args.tree_budget else {}),
        **({f"{label.split()[0]} causal tree {args.tree_budget}": lambda p, ref: TreeEngine(
            target, dspark, "greedy", gamma, budget=args.tree_budget, builder="causal")}
           if args.tree_budget and has(dspark, Capability.CAUSAL_TREE_HEAD) else {}),
        "prompt lookup": lambda p, ref: SpeculativeEngine(
            step, PromptLookupDrafter(target.vocab_size, gamma or 7, device=target.device), "greedy"),
        "oracle (upper bound)": lambda p, ref: SpeculativeEngine(
            step, OracleDrafter(p + ref, target.vocab_size, gamma or 7, device=target.device), "greedy"),
    }
    if args.prompt_set == "code":
        prompts = [target.tokenizer(t)["input_ids"] for t in PROMPTS[: args.prompts]]
    else:
        prompts = [list(p.input_ids) for p in eval_prompts(EvalConfig(num_prompts=args.prompts), target.tokenizer,
                                                    Path(resolve_target_path(TargetConfig(device=args.device))))]
    print(f"target {target.name_or_path} ({target.num_layers} layers, hidden {target.hidden_size}, "
          f"vocab {target.vocab_size}), {args.device}, {torch.get_num_threads()} thread(s), "
          f"{args.new_tokens} new tokens, {len(prompts)} {args.prompt_set} prompts, median of {args.reps}; "
          f"{dspark.cfg.name} γ={gamma or dspark.num_speculative_tokens}, {dspark.cfg.num_layers} layers, "
          f"{dspark.num_parameters():,} params")
    report([bench_prompt(step, engines, p, args) for p in prompts], args.new_tokens)


if __name__ == "__main__":
    main()
