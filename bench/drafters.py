"""Drafters side by side: each trained on the same rollouts, budget, steps and seed, then measured
alike (held-out τ from distributions, simulated greedy τ, first-draft acceptance α1, and the eval
stage's engine τ and speedup at the drafter's own γ, every output checked equal to plain decoding),
with each drafter's γ and its sequential drafter passes a round.

    python bench/drafters.py --data runs/data --budget 60000 [--epochs 5 --threads 2 --out bench-drafters] \\
        --drafter dspark --drafter dflash --drafter domino \\
        --drafter "eagle3 drafter.layer_ids=[1,14,27]" \\
        --drafter "peagle drafter.layer_ids=[1,14,27] drafter.ttt_steps=3" \\
        --drafter "domino-offline=domino train.objectives=[offline]" [key=value ... for every drafter]

Each ``--drafter`` is ``[label=]name [key=value ...]``: ``conf/<name>.yaml`` (the settings that
drafter trains with) plus its own overrides, then the ones given to every drafter; the label
names its row and its directory (default: the name). A drafter reads only the taps the rollouts
hold (rollouts captured at DSpark's [1, 8, 14, 20, 27] serve EAGLE-3 at [1, 14, 27]; a tap not
captured is refused by name). Each drafter is ``bench/budget_curve.py`` at one budget, so its
steps are ``ceil(epochs × records / global batch)`` over the budget's records in one seeded order.

Prints the table, writes ``<out>/drafters.json``, ``<out>/drafters.png`` (τ by drafter) and each
drafter's curve under ``<out>/<label>/``. Nothing about τ is asserted.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.budget_curve import curve


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="a data-stage output directory")
    ap.add_argument("--budget", type=int, required=True, help="response tokens each drafter trains on")
    ap.add_argument("--epochs", type=float, default=5.0, help="passes over the budget's records")
    ap.add_argument("--drafter", action="append", required=True, metavar="[LABEL=]NAME [KEY=VALUE ...]",
                    help="a drafter preset (conf/NAME.yaml) and its own overrides; repeat for each")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-drafters")
    ap.add_argument("--no-engine", action="store_true", help="offline estimates only (no eval stage)")
    return ap.parse_known_args(argv)


def parse_drafter(spec: str) -> tuple[str, str, list[str]]:
    """``"[label=]name k=v ..."`` → (label, name, overrides); refuses an empty spec."""
    words = shlex.split(spec)
    if not words or "=" in words[0] and "." in words[0].split("=", 1)[0]:
        raise SystemExit(f"--drafter {spec!r}: start with the drafter's preset name (e.g. 'dspark' or "
                         "'label=dspark'), then its key=value overrides")
    label, _, name = words[0].rpartition("=")
    return label or name, name, words[1:]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [(k, lab) for k, lab in (("tau_tv", "held-out τ (1 − TV)"), ("sim_tau", "simulated greedy τ"),
                                    ("engine_tau", "engine τ")) if all(k in r for r in rows)]
    fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4))
    width = 0.8 / max(1, len(keys))
    for i, (key, lab) in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r[key] for r in rows], width, label=lab)
    ax.set_xticks([j + width * (len(keys) - 1) / 2 for j in range(len(rows))], [r["label"] for r in rows])
    ax.set_ylabel("τ (tokens per round)")
    ax.set_ylim(bottom=1.0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str]) -> None:
    args, shared = parse_args(argv)
    drafters = [parse_drafter(s) for s in args.drafter]
    labels = [label for label, _, _ in drafters]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--drafter labels {labels} repeat one; name repeated presets 'label=name ...'")
    out = Path(args.out)
    rows: list[dict[str, Any]] = []
    for label, name, own in drafters:
        print(f"=== {label}: conf={name}.yaml {' '.join(own + shared)}", flush=True)
        run = argparse.Namespace(data=args.data, budgets=str(args.budget), epochs=args.epochs, threads=args.threads,
                                 out=str(out / label), no_engine=args.no_engine)
        (row,) = curve(run, [f"conf={name}.yaml", *own, *shared])
        rows.append({"label": label, "drafter": name, "overrides": own + shared, **row})
        (out / "drafters.json").write_text(json.dumps(rows, indent=1) + "\n")
    plot(rows, out / "drafters.png")
    print(f"\n{'drafter':<16} {'γ':>3} {'passes':>6} {'steps':>6} {'s/step':>7} {'τ (1−TV)':>9} {'sim τ':>6} {'α1':>6} "
          f"{'engine τ':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['label']:<16} {r['gamma']:>3} {r['passes_per_round']:>6} {r['steps']:>6} {r['s_per_step']:>7.2f} "
              f"{r['tau_tv']:>9.3f} {r['sim_tau']:>6.3f} "
              f"{r['alpha1']:>6.3f} {r.get('engine_tau', float('nan')):>9.3f} {r.get('speedup', float('nan')):>7.2f}x")


if __name__ == "__main__":
    main(sys.argv[1:])
