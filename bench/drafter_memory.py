"""Drafter memory per request against context length, and the draft round's time, same run.

    python bench/drafter_memory.py [--contexts 256,1024,4096,8192 --drafters dspark,dflash,hspec
                                    --rounds 10 --threads 2 --out bench-drafter-memory]

On the embedded target (SmolLM2-135M-Instruct, float32), for each context length: one target
prefill over that many random tokens (taps captured, KV cache kept), then each drafter (its
preset, ``conf/<name>.yaml``'s drafter section; random weights: neither bytes nor time depend on
them) consumes the context, and we count the bytes of every tensor its state holds (its own
context K/V, kept features, carryover rows: everything ``DraftState`` owns; the target's K/V
views an H-Spec state reads are the target's cache, counted once, in the target's column) and
time a greedy ``propose`` (median of ``--rounds``; the state attached to the target's cache as
the engines attach it). The target's own KV cache at that length is the yardstick. The longest
context is the embedded target's ``max_position_embeddings`` by default.

Prints one table, writes ``<out>/drafter_memory.json`` and ``<out>/drafter_memory.png``
(bytes per request against context). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import components.drafters  # noqa: F401  (registers every family)
from components.config import TargetConfig
from components.confload import load
from components.drafters.registry import build_drafter
from components.engine.core import attach_target_kv
from components.spec.sampling import GREEDY
from components.target import load_target


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--contexts", default="", help="context lengths (default: 256, 1024, 4096, the target's longest)")
    ap.add_argument("--drafters", default="dspark,dflash,hspec", help="preset names (conf/<name>.yaml)")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-drafter-memory")
    return ap.parse_args()


def owned_bytes(state: Any) -> int:
    """Bytes of the tensors a drafter state owns (not the target-cache views it is handed)."""
    tensors = [t for kv in (state.kv or []) for t in kv] + [t for kv in (state.carry or []) for t in kv]
    tensors += [state.feats] if state.feats is not None else []
    return sum(t.numel() * t.element_size() for t in tensors)


def cache_bytes(cache: Any) -> int:
    return sum(x.numel() * x.element_size() for layer in cache.layers for x in (layer.keys, layer.values))


def drafter_for(name: str, target: Any) -> Any:
    cfg = load(f"{name}.yaml").drafter
    drafter = build_drafter(cfg, target).eval()
    if drafter.vocab is not None:  # arbitrary ids: neither bytes nor time depend on which
        drafter.set_draft_vocab(torch.arange(drafter.vocab.size))
    return drafter


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig(name_or_path="embedded", dtype="float32", device="cpu"), progress=False)
    longest = int(target.model.config.max_position_embeddings)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else [256, 1024, 4096, longest]
    drafters = {name: drafter_for(name, target) for name in args.drafters.split(",")}
    taps = sorted({i for d in drafters.values() for i in d.layer_ids})
    rows: list[dict[str, Any]] = []
    gen = torch.Generator().manual_seed(0)
    for length in contexts:
        ids = torch.randint(100, target.vocab_size, (1, length + 1), generator=gen)
        with torch.no_grad():
            out = target.forward(ids[:, :length], layer_ids=taps, use_cache=True)
        row: dict[str, Any] = {"context": length, "target_kv_bytes": cache_bytes(out.cache)}
        for name, drafter in drafters.items():
            hidden = out.hidden[:, :, [taps.index(i) for i in drafter.layer_ids]]
            with torch.no_grad():
                state = drafter.consume(drafter.init_state(1), ids[:, :length], hidden)
                state = attach_target_kv(drafter, state, out.cache)
                times = []
                for _ in range(args.rounds + 1):
                    t0 = time.perf_counter()
                    drafter.propose(state, ids[:, length], GREEDY)
                    times.append(time.perf_counter() - t0)
            row[f"{name}_bytes"] = owned_bytes(state)
            row[f"{name}_propose_ms"] = 1000 * statistics.median(times[1:])
        rows.append(row)
        print(" | ".join(f"{k} {v:,.1f}" if isinstance(v, float) else f"{k} {v:,}" for k, v in row.items()), flush=True)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "drafter_memory.json").write_text(json.dumps(rows, indent=2))
    print("\n| context | target KV | " + " | ".join(f"{n} state | {n} propose ms" for n in drafters) + " |")
    print("|---|---|" + "---|---|" * len(drafters))
    for row in rows:
        cells = [f"{row['context']:,}", f"{row['target_kv_bytes'] / 2**20:,.1f} MiB"]
        for n in drafters:
            cells += [f"{row[f'{n}_bytes'] / 2**10:,.1f} KiB", f"{row[f'{n}_propose_ms']:.1f}"]
        print("| " + " | ".join(cells) + " |")
    plot(rows, list(drafters), out_dir / "drafter_memory.png")


def plot(rows: list[dict[str, Any]], names: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["context"] for r in rows]
    for n in names:
        ax.plot(xs, [r[f"{n}_bytes"] / 2**20 for r in rows], marker="o", label=n)
    ax.plot(xs, [r["target_kv_bytes"] / 2**20 for r in rows], linestyle="--", color="gray", label="target KV cache")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context tokens")
    ax.set_ylabel("MiB per request")
    ax.set_title("Drafter state per request")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp)
    tmp.rename(path)


if __name__ == "__main__":
    main()
