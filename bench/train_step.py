"""Drafter training steps side by side: their speed, and what the same steps buy.

    python bench/train_step.py --data runs/data [--steps 200 --eval-every 50 --threads 1]
                               [--variants fp32,bf16,bf16+head] [conf=dspark.yaml drafter.num_layers=1 ...]

Every variant trains in this one process (the training components without Ray: the objective
and ``train_step`` the Ray Train workers run), the drafter and training settings of the config
(``conf=...`` and overrides), from the same seed, on the same records in the same order
(``train.batch_size × train.num_workers`` records a step: the stage's global batch), and is
evaluated on the same held-out records (the train stage's split). A variant is ``+``-joined:

* ``fp32`` / ``bf16``: ``train.mixed_precision`` no / bf16 (autocast of the forward; master
  weights, optimizer state and gradients stay float32);
* ``head``: ``drafter.init_from_target`` (the draft layers start as the target's last layers);
* ``torchloss``: the default loss through torch ops (``train.loss_params.fused: false``) instead
  of its fused CPU kernel (``components/losses/fused.py``).

Reported per variant: seconds per step (median), supervised (response) tokens per second and per
core-second (``--threads`` cores), the final training loss, and at every ``--eval-every`` steps
held-out τ from distributions (1 − TV at random anchors), simulated greedy τ and first-draft
acceptance α1 — so a faster step is read beside what it buys. Prints a table, writes ``--out``
(JSON). Nothing about time or τ is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.confload import load_cli
from components.data.shards import load_manifest, read_records
from components.drafters import build_drafter, with_draft_vocab
from components.target import load_target
from components.training.heldout import evaluate_records, heldout_ids
from components.training.padding import collate, supervised_tokens
from components.training.step import build_train_loss, new_train_state, train_step

FLAGS = {"fp32": {}, "bf16": {}, "head": {}, "torchloss": {}}


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a data-stage output directory")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--variants", default="fp32,bf16,bf16+head")
    ap.add_argument("--out", default="bench-train-step.json")
    return ap.parse_known_args(argv)


def variant_cfg(cfg: Any, name: str) -> Any:
    """The config of a variant (``bf16+head`` …), or a clear error for an unknown part."""
    parts = name.split("+")
    unknown = [p for p in parts if p not in FLAGS]
    if unknown or ("fp32" in parts and "bf16" in parts):
        raise SystemExit(f"--variants: '{name}': parts are fp32 | bf16, optionally +head, +torchloss")
    loss_params = {**cfg.train.loss_params, "fused": False} if "torchloss" in parts else cfg.train.loss_params
    train = dataclasses.replace(cfg.train, mixed_precision="bf16" if "bf16" in parts else "no", loss_params=loss_params)
    drafter = dataclasses.replace(cfg.drafter, init_from_target="head" in parts)
    return dataclasses.replace(cfg, train=train, drafter=drafter)


def heldout(drafter: Any, cfg: Any, records: list) -> dict[str, float]:
    drafter.eval()
    ev = evaluate_records(drafter, build_train_loss(cfg.train), records, batch_size=8, seed=0)
    drafter.train()
    return {"tau_tv": round(ev["tau"], 4), "sim_tau": round(ev["sim_tau"], 4), "alpha1": round(ev["sim_alpha"][0], 4)}


def run_variant(name: str, cfg: Any, target: Any, train_set: list, held: list, counts: torch.Tensor,
                args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(cfg.train.seed)
    drafter = build_drafter(cfg.drafter, target)
    if drafter.vocab is not None:
        with_draft_vocab(drafter, target, counts)
    state = new_train_state(drafter, cfg.train, args.steps, seed=cfg.train.seed)
    batch = cfg.train.batch_size * cfg.train.num_workers
    order = np.random.default_rng(cfg.train.seed).permutation(len(train_set))
    curve = {0: heldout(drafter, cfg, held)}
    seconds, tokens, losses = [], 0, []
    for step in range(args.steps):
        pick = [train_set[order[(step * batch + j) % len(train_set)]] for j in range(batch)]
        b = collate(pick)
        t0 = time.perf_counter()
        losses.append(train_step(state, b, cfg.train.grad_clip)["train/loss"])
        seconds.append(time.perf_counter() - t0)
        tokens += supervised_tokens(b)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            curve[step + 1] = heldout(drafter, cfg, held)
            print(f"{name}: step {step + 1}, loss {losses[-1]:.3f}, {statistics.median(seconds):.2f} s/step, "
                  f"held-out {curve[step + 1]}", flush=True)
    total = sum(seconds)
    return {"s_per_step": statistics.median(seconds), "tokens_per_s": tokens / total,
            "tokens_per_core_s": tokens / total / args.threads, "loss_last": losses[-1], "curve": curve}


def main(argv: list[str]) -> None:
    args, overrides = parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_cli(overrides)
    meta = load_manifest(Path(args.data))["meta"]
    target = load_target(dataclasses.replace(cfg.target, name_or_path=meta["target"]), progress=False)
    records = list(read_records(Path(args.data)))
    held_ids = heldout_ids([r.sample_id for r in records], cfg.train.eval_fraction, cfg.train.seed)
    train_set = [r for r in records if r.sample_id not in held_ids]
    held = [r for r in records if r.sample_id in held_ids]
    counts = torch.from_numpy(np.bincount(np.concatenate([r.input_ids[r.prompt_len:] for r in train_set])))
    print(f"{len(train_set)} train / {len(held)} held-out records, {args.steps} steps × "
          f"{cfg.train.batch_size * cfg.train.num_workers} records, {args.threads} thread(s), "
          f"torch {torch.__version__}, CPU {torch.backends.cpu.get_cpu_capability()}", flush=True)
    results = {}
    for name in args.variants.split(","):
        results[name] = run_variant(name, variant_cfg(cfg, name), target, train_set, held, counts, args)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    first = next(iter(results.values()))
    print(f"\n{'variant':<14} {'s/step':>7} {'tok/s':>7} {'tok/core-s':>10} {'× first':>8} {'loss':>7} "
          f"{'τ (1−TV)':>9} {'sim τ':>7} {'α1':>6}")
    for name, r in results.items():
        end = r["curve"][max(r["curve"])]
        print(f"{name:<14} {r['s_per_step']:>7.2f} {r['tokens_per_s']:>7.0f} {r['tokens_per_core_s']:>10.0f} "
              f"{r['tokens_per_s'] / first['tokens_per_s']:>7.2f}x {r['loss_last']:>7.3f} {end['tau_tv']:>9.3f} "
              f"{end['sim_tau']:>7.3f} {end['alpha1']:>6.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
