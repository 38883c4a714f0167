"""Drafters, losses, storage and training objectives side by side: same rollouts, same step budget.

    python bench/objectives.py --data runs/data [--steps 60 --extra 20 --batch 8 --threads 1]
                               [--num-layers 1 --draft-vocab 8192]

Everything trains in this one process (the training components without Ray: the same
objectives and ``train_step`` the Ray Train workers run), from the same seed, on the same
records in the same order, and is evaluated on the same held-out records (the train stage's
split). Variants:

* drafter: dspark, dflash, eagle3 — offline, each with the registry loss it trains with by
  default here (dspark: the DSpark mix; dflash and eagle3: KL, no confidence head);
* loss: dspark trained with lk_hybrid and with bv instead of the DSpark mix;
* storage: dspark on the same rollouts re-encoded to int8 (per-row absmax) instead of float16;
* chain: the offline dspark drafter (or ``--base``, one trained elsewhere) continued for
  ``--extra`` steps with a fresh optimizer by offline (the control), opd, carryover, dloop,
  edr or retrace — equal total steps for all (``--chain`` picks some of them).

Every variant is sized alike: ``--num-layers`` sets drafter.num_layers (unset: each drafter's own
default) and ``--draft-vocab DV`` drafter.draft_vocab_size (0: the full vocabulary). With DV > 0 each
fresh drafter reads out over the DV most frequent response tokens (the loss-masked ones) of the
training split (+ special/stop tokens), the same vocabulary for every variant; the chained drafters
keep it (it is in the state dict). A drafter whose default taps were not all captured (EAGLE-3's
[1, L//2 − 1, L − 4] against DSpark's spread) reads the nearest captured layers instead.

Reported per variant: held-out τ from distributions (1 − TV, random anchors), simulated greedy
τ (rounds where they start, greedy drafts against the recorded tokens) and, for the chain
variants, the engine's measured τ on held-out prompts (greedy, γ = block; offline and dloop
also with 3 loop stages, gate ``--gate``; carryover also with carryover context on; retrace also
with its recycle gate closed), and how its
drafter is sized (taps, draft layers, readout vocabulary, parameters). Prints a table and writes
``--out`` (JSON). Nothing about τ is asserted (only that chained drafters keep their vocabulary).
Carryover is by far the slowest variant: each step verifies every rejected first draft (up to
drafter.num_anchors per record) with a target forward over the branch's whole prefix.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import DrafterConfig, TargetConfig, TrainConfig
from components.data.records import Record, encode, select_layers
from components.data.shards import load_manifest, read_records
from components.drafters import build_drafter, load_drafter, with_draft_vocab
from components.drafters.registry import resolve_layer_ids
from components.engine import SpeculativeEngine
from components.losses import build_loss
from components.target import load_target
from components.training import collate, evaluate_records, heldout_ids, new_train_state, train_step
from components.training.objectives import ObjectiveContext, build_objective, objective_class

DSPARK = DrafterConfig(name="dspark", block_size=7, markov_rank=32)
DRAFTERS = {"dspark": (DSPARK, "tv_ce_confidence"),
            "dflash": (DrafterConfig(name="dflash", block_size=8), "kl"),
            "eagle3": (DrafterConfig(name="eagle3", ttt_steps=7), "kl")}
EXTRA_LOSS = {"offline": "tv_ce_confidence", "opd": "opd", "carryover": "tv_ce_confidence", "dloop": "tv_ce_confidence",
              "edr": "tv_ce_confidence", "retrace": "tv_ce_confidence"}  # edr forms its own loss


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a data-stage output directory (float16 shards)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--extra", type=int, default=20, help="steps of each chained objective")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--extra-lr", type=float, default=5e-4)
    ap.add_argument("--eval-fraction", type=float, default=0.1)
    ap.add_argument("--engine-prompts", type=int, default=12)
    ap.add_argument("--engine-tokens", type=int, default=48)
    ap.add_argument("--gate", type=float, default=-1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default="", help="comma list of groups: drafter,loss,storage,chain")
    ap.add_argument("--chain", default=",".join(EXTRA_LOSS), help="comma list of chained objectives to compare")
    ap.add_argument("--num-layers", type=int, default=None, help="drafter.num_layers of every variant "
                    "(default: each drafter's own)")
    ap.add_argument("--draft-vocab", type=int, default=0, help="drafter.draft_vocab_size of every variant, "
                    "chosen from the training split's response tokens (0: the full vocabulary)")
    ap.add_argument("--base", default=None, help="a trained dspark drafter directory the chain variants continue "
                    "from (its own held-out figures are reported as 'dspark'), instead of training one for --steps")
    ap.add_argument("--max-anchors", type=int, default=0, help="first-draft anchors per record of the chained "
                    "objectives that draft twice (carryover, retrace; 0: the drafter's num_anchors)")
    ap.add_argument("--carryover-verify", default="auto", help="carryover's verification: auto | tree (a record's "
                    "branches in one masked pass) | branches (each branch its own sequence)")
    ap.add_argument("--mixed-precision", default="no", help="train.mixed_precision of every variant (no | auto | bf16)")
    ap.add_argument("--out", default="bench-objectives.json")
    return ap.parse_args()


def sized(cfg: DrafterConfig, args: argparse.Namespace) -> DrafterConfig:
    """``cfg`` with the bench's ``--num-layers`` (when given) and ``--draft-vocab`` (0: full vocabulary)."""
    return dataclasses.replace(cfg, num_layers=args.num_layers or cfg.num_layers,
                               draft_vocab_size=args.draft_vocab or None)


def on_stored(cfg: DrafterConfig, target: Any, stored: list[int]) -> DrafterConfig:
    """``cfg`` reading only captured layers: its default taps, each moved to the nearest of ``stored``."""
    wanted = resolve_layer_ids(cfg, target.num_layers)
    if set(wanted) <= set(stored):
        return cfg
    near = sorted({min(stored, key=lambda s: (abs(s - i), s)) for i in wanted})
    print(f"{cfg.name}: layers {wanted} not all captured ({stored}); reading {near}", flush=True)
    return dataclasses.replace(cfg, layer_ids=near)


def response_counts(records: list[Record]) -> torch.Tensor:  # -> [max id + 1] int64
    """How often each token id is a response token (``input_ids[prompt_len:]``, the loss-masked ones)."""
    return torch.from_numpy(np.bincount(np.concatenate([r.input_ids[r.prompt_len:] for r in records]).astype(np.int64)))


def as_int8(records: list[Record]) -> list[Record]:
    """The same rollouts re-encoded as the data stage's int8 storage would write them."""
    out = []
    for r in records:
        h, hs = encode(r.hidden_f32(), "int8")
        lh, ls = encode(r.last_hidden_f32(), "int8")
        out.append(dataclasses.replace(r, hidden=h, hidden_scale=hs, last_hidden=lh, last_hidden_scale=ls))
    return out


def train(drafter: Any, objective: str, loss: str, records: list[Record], steps: int, args: argparse.Namespace,
          target: Any, lr: float, warmup: int) -> dict[str, float]:
    """``steps`` optimizer steps of ``objective`` over ``records`` (fixed order, cycling)."""
    tc = TrainConfig(lr=lr, warmup_steps=warmup, seed=0, mixed_precision=args.mixed_precision)
    params = {"max_anchors": args.max_anchors} if objective in ("carryover", "retrace") else {}
    if objective == "carryover":
        params["verify"] = args.carryover_verify
    obj = build_objective(objective, drafter, build_loss(loss), params, ObjectiveContext(target))
    state = new_train_state(drafter, tc, steps, seed=0, objective=obj)
    order = np.random.default_rng(0).permutation(len(records))
    t0, losses = time.perf_counter(), []
    for step in range(steps):
        pick = [records[order[(step * args.batch + j) % len(records)]] for j in range(args.batch)]
        losses.append(train_step(state, collate(pick))["train/loss"])
    drafter.eval()
    return {"seconds": time.perf_counter() - t0, "loss_first": losses[0], "loss_last": losses[-1]}


def heldout_eval(drafter: Any, records: list[Record]) -> dict[str, float]:
    ev = evaluate_records(drafter, build_loss("kl"), records, batch_size=8, seed=0)
    return {"tau_tv": ev["tau"], "sim_tau": ev["sim_tau"], "sim_alpha": [round(a, 3) for a in ev["sim_alpha"]]}


def engine_tau(target: Any, drafter: Any, records: list[Record], args: argparse.Namespace, loop: int,
               carryover: bool = False) -> float:
    """Measured greedy τ of the engine on held-out prompts (the records' prompts)."""
    engine = SpeculativeEngine(target, drafter, rule="greedy", loop_stages=loop, loop_gate=args.gate,
                               carryover=carryover)
    acc = rounds = 0
    for r in records[: args.engine_prompts]:
        out = engine.generate(r.input_ids[: r.prompt_len].tolist(), args.engine_tokens)
        acc, rounds = acc + sum(out.accepted), rounds + out.rounds
    return (acc + rounds) / max(1, rounds)


def fresh(cfg: DrafterConfig, target: Any, counts: torch.Tensor | None = None) -> Any:
    """A drafter initialised from seed 0; with a draft vocabulary, chosen from ``counts`` when given."""
    torch.manual_seed(0)
    drafter = build_drafter(cfg, target)
    return with_draft_vocab(drafter, target, counts) if drafter.vocab is not None and counts is not None else drafter


def run_groups(args: argparse.Namespace, target: Any, train_set: list[Record], held: list[Record],
               stored: list[int]) -> dict[str, dict[str, Any]]:
    groups = set(args.only.split(",")) if args.only else {"drafter", "loss", "storage", "chain"}
    results: dict[str, dict[str, Any]] = {}
    counts = response_counts(train_set) if args.draft_vocab else None  # the training split only
    dspark = on_stored(sized(DSPARK, args), target, stored)

    def offline(name: str, cfg: DrafterConfig, loss: str, records: list[Record], ev_records: list[Record]) -> Any:
        drafter = fresh(cfg, target, counts)
        stats = train(drafter, "offline", loss, records, args.steps, args, target, args.lr, 10)
        results[name] = {**stats, **heldout_eval(drafter, ev_records), **describe(drafter)}
        print(name, json.dumps(results[name]), flush=True)
        return drafter

    if args.base:
        base = load_drafter(args.base, target).eval()
        results["dspark"] = {"seconds": 0.0, "loss_last": float("nan"), **heldout_eval(base, held), **describe(base)}
        print("dspark (from --base)", json.dumps(results["dspark"]), flush=True)
    else:
        base = offline("dspark", dspark, "tv_ce_confidence", train_set, held)
    if "drafter" in groups:
        for name in ("dflash", "eagle3"):
            cfg, loss = DRAFTERS[name]
            cfg = on_stored(sized(cfg, args), target, stored)
            wanted = resolve_layer_ids(cfg, target.num_layers)
            offline(name, cfg, loss, select_layers(train_set, stored, wanted), select_layers(held, stored, wanted))
    if "loss" in groups:
        for loss in ("lk_hybrid", "bv"):
            offline(f"dspark+{loss}", dspark, loss, train_set, held)
    if "storage" in groups:
        offline("dspark int8", dspark, "tv_ce_confidence", as_int8(train_set), held)
    if "chain" in groups:
        for objective in args.chain.split(","):
            loss = EXTRA_LOSS[objective]
            drafter = copy.deepcopy(base)
            if objective in ("carryover", "retrace"):  # E_carry / the recycle gate, zero: the offline drafter
                drafter = _rebuilt(base, target, objective)
            same_vocab(drafter, base)
            stats = train(drafter, objective, loss, train_set, args.extra, args, target, args.extra_lr, 2)
            row = {**stats, **heldout_eval(drafter, held), **describe(drafter),
                   "engine_tau": engine_tau(target, drafter, held, args, 1)}
            if objective in ("offline", "dloop"):
                row["engine_tau_loop3"] = engine_tau(target, drafter, held, args, 3)
            if objective == "carryover":
                row["engine_tau_carry"] = engine_tau(target, drafter, held, args, 1, carryover=True)
            if objective == "retrace":  # the same drafter with its gate closed: what recycling adds at inference
                row["engine_tau_no_recycle"] = engine_tau(target, _gate_closed(drafter), held, args, 1)
            results[f"dspark→{objective}"] = row
            print(f"dspark→{objective}", json.dumps(row), flush=True)
    return results


def _rebuilt(base: Any, target: Any, objective: str) -> Any:
    """``base`` rebuilt with what ``objective`` adds (its ``drafter_overrides``: the carryover
    embedding, the recycle gate; both start as no-ops) and its weights copied."""
    overrides = objective_class(objective).drafter_overrides
    drafter = fresh(dataclasses.replace(base.cfg, **overrides), target)
    missing = drafter.load_state_dict(base.state_dict(), strict=False).missing_keys
    assert all(k == "carry_embed" or k.startswith("recycle.") for k in missing), missing
    return drafter


def _gate_closed(drafter: Any) -> Any:
    """A copy of a retrace drafter whose recycle gate adds nothing (its projections zeroed)."""
    closed = copy.deepcopy(drafter)
    with torch.no_grad():
        closed.recycle.state_proj.weight.zero_()
        closed.recycle.signal_proj.weight.zero_()
    return closed


def describe(drafter: Any) -> dict[str, Any]:
    """How a variant's drafter is sized: taps, draft layers, readout vocabulary, parameters."""
    return {"layer_ids": drafter.layer_ids, "num_layers": int(drafter.cfg.num_layers),
            "readout_vocab": drafter.readout_size,
            "parameters": drafter.num_parameters()}


def same_vocab(drafter: Any, base: Any) -> None:
    """Raises unless a copied/rebuilt chain drafter reads out over ``base``'s chosen vocabulary."""
    if base.vocab is None:
        assert drafter.vocab is None
        return
    assert drafter.vocab is not None and drafter.vocab.chosen, "the draft vocabulary was lost"
    assert torch.equal(drafter.vocab.d2t, base.vocab.d2t) and torch.equal(drafter.vocab.t2d, base.vocab.t2d)
    assert torch.equal(drafter.vocab.head.weight, base.vocab.head.weight)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    meta = load_manifest(Path(args.data))["meta"]
    target = load_target(TargetConfig(name_or_path=meta["target"], dtype="float32"), progress=False)
    records = list(read_records(Path(args.data)))
    held_ids = heldout_ids([r.sample_id for r in records], args.eval_fraction, 0)
    train_set = [r for r in records if r.sample_id not in held_ids]
    held = [r for r in records if r.sample_id in held_ids]
    print(f"{len(train_set)} train / {len(held)} held-out records, {args.steps} steps × {args.batch}", flush=True)
    results = run_groups(args, target, train_set, held, list(meta["layer_ids"]))
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    cols = ("engine_tau", "engine_tau_loop3", "engine_tau_carry", "engine_tau_no_recycle")
    print(f"\n{'variant':<20} {'τ (1−TV)':>9} {'sim τ':>7} {'engine τ':>9} {'loop×3 τ':>9} {'carry τ':>8} "
          f"{'gate shut τ':>11} {'loss':>7} {'s':>6}")
    for name, r in results.items():
        eng, loop, carry, shut = (f"{r[c]:.3f}" if c in r else "-" for c in cols)
        print(f"{name:<20} {r['tau_tv']:>9.3f} {r['sim_tau']:>7.3f} {eng:>9} {loop:>9} {carry:>8} {shut:>11} "
              f"{r['loss_last']:>7.3f} {r['seconds']:>6.0f}")


if __name__ == "__main__":
    main()
