"""What a training budget buys: a drafter (DSpark unless the config says another) trained on
growing shares of the same rollouts, steps in proportion, each measured offline and in the engine.

    python bench/budget_curve.py --data runs/data --budgets 13000,27000,54000 [--epochs 7.4]
                                 [--threads 2 --out bench-budget-curve] [conf=dspark.yaml key=value ...]

The budget is response (supervised) tokens. For each budget, in this one process and from the
same seed: the training split's records in one seeded order, the shortest prefix of it holding
the budget's tokens, and ``ceil(epochs × records / global batch)`` optimizer steps over it (the
training components the Ray Train workers run; ``train.batch_size × train.num_workers`` records
a step; every other setting from the config). So each budget sees its data the same number of
times, and a larger budget is also a longer run. Every drafter is then measured on the same
held-out records of the train stage's split — τ from distributions (1 − TV), simulated greedy τ
and first-draft acceptance α1 — and by the eval stage itself (``pipelines.evaluate``: greedy,
``eval.prompt_sets`` × ``eval.num_prompts`` held-out prompts, methods ``target_only`` and
``drafter``), which gives engine τ and the speedup over plain decoding with that drafter,
checked token for token against plain decoding.

Prints a table, writes ``<out>/curve.json``, ``<out>/curve.png`` and each drafter under
``<out>/<budget>/drafter``. A budget beyond the training split's tokens is refused with the
number it holds. Nothing about τ is asserted.

Any drafter the config names trains on rollouts that hold its taps (``conf=eagle3.yaml
"drafter.layer_ids=[1,14,27]"`` on rollouts captured for DSpark at [1, 8, 14, 20, 27]): the
records keep only the drafter's layers; a tap that was not captured is refused by name. Same
data, budgets, epochs and seed give the same records and steps for every drafter. The drafter
trains with the config's objective (one: ``train.objectives``), e.g. Domino's curriculum.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.train_step import heldout  # the held-out figures train_step.py reports, computed alike
from components.confload import load_cli
from components.data.records import Record, select_layers
from components.data.shards import load_manifest, read_records
from components.drafters import build_drafter, with_draft_vocab
from components.drafters.checkpoint import save_drafter
from components.drafters.registry import resolve_layer_ids
from components.target import load_target
from components.tracking import Tracker
from components.training.chain import ObjectiveStage, resolve_chain
from components.training.heldout import heldout_ids
from components.training.objectives import ObjectiveContext, build_objective
from components.training.padding import collate, supervised_tokens
from components.training.step import build_train_loss, new_train_state, train_step


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a data-stage output directory")
    ap.add_argument("--budgets", required=True, help="response tokens per budget, comma-separated")
    ap.add_argument("--epochs", type=float, default=7.4,
                    help="passes over each budget's records (7.4: the default make run's 400 steps × 8 over 432 "
                         "of a block of 7; with its block of 3 it trains 800, 14.8 passes)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-budget-curve")
    ap.add_argument("--no-engine", action="store_true", help="offline estimates only (no eval stage)")
    return ap.parse_known_args(argv)


def budget_records(train_set: list[Record], budget: int) -> list[Record]:
    """The shortest prefix of ``train_set`` (already in its seeded order) holding ``budget``
    response tokens; refuses a budget the split does not hold."""
    total, picked = 0, []
    for r in train_set:
        if total >= budget:
            break
        picked.append(r)
        total += len(r.input_ids) - r.prompt_len
    if total < budget:
        raise SystemExit(f"--budgets: {budget:,} response tokens asked, the training split holds {total:,}: "
                         "generate more rollouts (data.max_prompts) or ask for less")
    return picked


def only_stage(cfg: Any) -> ObjectiveStage:
    """The config's one objective (``train.objectives: [base_anchored]`` for Domino's curriculum);
    a chain is refused: its stages would need their own step counts."""
    stages = resolve_chain(cfg.train)
    if len(stages) != 1:
        raise SystemExit(f"train.objectives: {[s.name for s in stages]}; this bench trains one objective per "
                         "budget (set train.objectives=[<one>])")
    return stages[0]


def train_budget(cfg: Any, target: Any, records: list[Record], counts: torch.Tensor, epochs: float) -> tuple[Any, dict]:
    torch.manual_seed(cfg.train.seed)
    drafter = build_drafter(cfg.drafter, target)
    if drafter.vocab is not None:
        with_draft_vocab(drafter, target, counts)
    batch = cfg.train.batch_size * cfg.train.num_workers
    steps = max(1, math.ceil(epochs * len(records) / batch))
    stage = only_stage(cfg)
    objective = build_objective(stage.name, drafter, build_train_loss(stage.train), stage.params,
                                ObjectiveContext(target=target))
    state = new_train_state(drafter, stage.train, steps, seed=cfg.train.seed, objective=objective)
    order = np.random.default_rng(cfg.train.seed).permutation(len(records))
    seconds, tokens, losses = [], 0, []
    for step in range(steps):
        b = collate([records[order[(step * batch + j) % len(records)]] for j in range(batch)])
        t0 = time.perf_counter()
        losses.append(train_step(state, b, cfg.train.grad_clip)["train/loss"])
        seconds.append(time.perf_counter() - t0)
        tokens += supervised_tokens(b)
        if (step + 1) % 50 == 0 or step + 1 == steps:
            print(f"  step {step + 1}/{steps}, loss {statistics.mean(losses[-50:]):.3f}, "
                  f"{statistics.median(seconds):.2f} s/step", flush=True)
    return drafter, {"steps": steps, "gamma": drafter.num_speculative_tokens,
                     "passes_per_round": drafter.sequential_passes(drafter.num_speculative_tokens),
                     "s_per_step": statistics.median(seconds), "train_seconds": sum(seconds),
                     "supervised_tokens_per_s": tokens / sum(seconds), "loss_last50": statistics.mean(losses[-50:])}


def engine(cfg: Any, drafter_dir: Path, out_dir: Path) -> dict[str, Any]:
    """The eval stage with the drafter: engine τ and speedup (over all prompts and per set)."""
    from pipelines import evaluate

    ev = dataclasses.replace(cfg.eval, drafter_path=str(drafter_dir), methods=["target_only", "drafter"],
                             output_dir=str(out_dir))
    run_cfg = dataclasses.replace(cfg, eval=ev, tracking=dataclasses.replace(cfg.tracking, enabled=False))
    res = evaluate.run(run_cfg, Tracker(run_cfg), {})
    return {"engine_tau": res["eval_tau"]["drafter"], "speedup": res["eval_speedup"]["drafter"],
            "plain_tok_s": res["eval_tokens_per_s"]["target_only"], "lossless": res["eval_lossless"]["drafter"],
            "sets": {s: m["drafter"] for s, m in res["eval_sets"].items()}}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [r["budget"] for r in rows]
    for key, label in (("tau_tv", "held-out τ (1 − TV)"), ("sim_tau", "simulated greedy τ"), ("engine_tau", "engine τ")):
        if all(key in r for r in rows):
            ax.plot(x, [r[key] for r in rows], marker="o", label=label)
    ax.set_xscale("log")
    ax.set_xlabel("training budget (response tokens; steps in proportion)")
    ax.set_ylabel("τ (tokens per round)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def curve(args: argparse.Namespace, overrides: list[str]) -> list[dict[str, Any]]:
    """Trains and measures the config's drafter at each of ``args.budgets``; writes ``args.out``
    (curve.json, curve.png, each drafter) and returns one row per budget."""
    torch.set_num_threads(args.threads)
    cfg = load_cli(overrides)
    only_stage(cfg)  # refuses a chain before anything loads
    meta = load_manifest(Path(args.data))["meta"]
    cfg = dataclasses.replace(cfg, target=dataclasses.replace(cfg.target, name_or_path=meta["target"]))
    target = load_target(cfg.target, progress=False)
    records = select_layers(list(read_records(Path(args.data))), meta["layer_ids"],
                            resolve_layer_ids(cfg.drafter, target.num_layers))
    held_ids = heldout_ids([r.sample_id for r in records], cfg.train.eval_fraction, cfg.train.seed)
    train_all = [r for r in records if r.sample_id not in held_ids]
    train_all = [train_all[i] for i in np.random.default_rng(cfg.train.seed).permutation(len(train_all))]
    held = [r for r in records if r.sample_id in held_ids]
    budgets = sorted(int(b) for b in args.budgets.split(","))
    subsets = {b: budget_records(train_all, b) for b in budgets}  # refuses before any training
    out = Path(args.out)
    response = sum(len(r.input_ids) - r.prompt_len for r in train_all)
    print(f"{cfg.drafter.name} ({cfg.train.loss}): {len(train_all)} train records ({response:,} response tokens)"
          f" / {len(held)} held-out; budgets {budgets}; {args.epochs} epochs each; "
          f"{args.threads} thread(s); {cfg.train.mixed_precision} precision", flush=True)
    rows = []
    for b in budgets:
        recs = subsets[b]
        print(f"budget {b:,}: {len(recs)} records", flush=True)
        # the draft vocabulary is chosen from the budget's own records, as the train stage would
        counts = torch.from_numpy(np.bincount(np.concatenate([r.input_ids[r.prompt_len:] for r in recs])))
        drafter, trained = train_budget(cfg, target, recs, counts, args.epochs)
        row = {"budget": b, "records": len(recs), **trained, **heldout(drafter, cfg, held)}
        save_drafter(drafter, out / str(b) / "drafter")
        if not args.no_engine:
            row |= engine(cfg, out / str(b) / "drafter", out / str(b) / "eval")
        print(f"budget {b:,}: {json.dumps(row)}", flush=True)
        rows.append(row)
        (out / "curve.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out / "curve.png")
    return rows


def main(argv: list[str]) -> None:
    args, overrides = parse_args(argv)
    rows = curve(args, overrides)
    print(f"\n{'budget':>9} {'records':>7} {'steps':>6} {'train s':>8} {'τ (1−TV)':>9} {'sim τ':>6} {'α1':>6} "
          f"{'engine τ':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['budget']:>9,} {r['records']:>7} {r['steps']:>6} {r['train_seconds']:>8.0f} {r['tau_tv']:>9.3f} "
              f"{r['sim_tau']:>6.3f} {r['alpha1']:>6.3f} {r.get('engine_tau', float('nan')):>9.3f} "
              f"{r.get('speedup', float('nan')):>7.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
