"""Microbenchmark of the verifier's side: each rule as a ratio to one softmax, same run.

    python bench/verify.py [--batch 32 --gamma 16 --vocab 32000 --tree-nodes 32 --device cpu --threads 1]

Every timing is a median over repetitions after warmup, divided by the median time of one
``torch.softmax`` over the same [B, γ+1, V] logits measured in the same run, so the numbers
are comparable across machines. Chain rules verify [B, γ] drafts; tree rules verify
best-first trees of ``--tree-nodes`` nodes per request with [B, N+1, V] distributions. Nothing
is asserted about time.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.engine.adaptive.policy import AdaptiveDraftLength
from components.spec.cost import ProfileTable
from components.spec.gumbel import gumbel_noise
from components.spec.tree_verify import verify_tree_greedy, verify_tree_sampling
from components.spec.trees import ancestor_mask, build_best_first_trees, flatten_trees
from components.spec.verify import (
    verify_block,
    verify_greedy,
    verify_gumbel,
    verify_speculative,
)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tree-nodes", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch default)")
    return ap.parse_args()


def timeit(fn: Callable[[], object], device: torch.device, warmup: int, reps: int) -> float:
    """Median wall time of fn() in seconds, synchronising the device around each call."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def chain_inputs(args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> dict:
    b, g, v = args.batch, args.gamma, args.vocab
    logits = torch.randn(b, g + 1, v, device=device, generator=gen) * 3
    p = logits.softmax(-1)
    q = (logits[:, :g] + torch.randn(b, g, v, device=device, generator=gen)).softmax(-1)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=gen).view(b, g)
    lens = torch.randint(0, g + 1, (b,), device=device, generator=gen)
    seeds = torch.arange(b, device=device)
    positions = torch.arange(g + 1, device=device).expand(b, -1)
    noise = gumbel_noise(seeds, positions, v)
    return {"logits": logits, "p": p, "q": q, "drafts": drafts, "lens": lens, "noise": noise,
            "seeds": seeds, "positions": positions}


def tree_inputs(args: argparse.Namespace, device: torch.device, gen: torch.Generator) -> dict:
    b, g, v, n = args.batch, args.gamma, args.vocab, args.tree_nodes
    marginals = (torch.randn(b, g, v, device=device, generator=gen) * 3).log_softmax(-1)
    flat = flatten_trees(build_best_first_trees(marginals, n), num_nodes=n)
    p = (torch.randn(b, n + 1, v, device=device, generator=gen) * 3).softmax(-1)
    q = (torch.randn(b, n + 1, v, device=device, generator=gen) * 3).softmax(-1)
    return {"marginals": marginals, "flat": flat, "p": p, "q": q}


def main() -> None:
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    c, t = chain_inputs(args, device, gen), tree_inputs(args, device, gen)
    f = t["flat"]
    survival = torch.rand(args.batch, args.gamma, generator=torch.Generator().manual_seed(0))
    xs = torch.arange(1, args.batch * (args.gamma + 1) + 1, dtype=torch.float64)
    policy = AdaptiveDraftLength(ProfileTable(xs, torch.clamp(xs / 256.0, min=1.0) / 100.0), calibrate=False)
    cases: list[tuple[str, Callable[[], object]]] = [
        ("softmax [B, γ+1, V] (baseline)", lambda: torch.softmax(c["logits"], dim=-1)),
        ("chain greedy", lambda: verify_greedy(c["drafts"], c["lens"], c["logits"])),
        ("chain gumbel (noise given)",
         lambda: verify_gumbel(c["drafts"], c["lens"], c["logits"], c["noise"])),
        ("gumbel_noise hash [B, γ+1, V]",
         lambda: gumbel_noise(c["seeds"], c["positions"], args.vocab)),
        ("chain speculative sampling",
         lambda: verify_speculative(c["drafts"], c["lens"], c["p"], c["q"], gen)),
        ("chain block verification",
         lambda: verify_block(c["drafts"], c["lens"], c["p"], c["q"], gen)),
        ("tree greedy", lambda: verify_tree_greedy(f.tokens, f.parents, t["p"], f.num_nodes)),
        ("tree sampling, deterministic tree",
         lambda: verify_tree_sampling(f.tokens, f.parents, t["p"], None, f.num_nodes, gen)),
        ("tree sampling, recursive rejection",
         lambda: verify_tree_sampling(f.tokens, f.parents, t["p"], t["q"], f.num_nodes, gen)),
        ("tree ancestor mask [B, N, N]", lambda: ancestor_mask(f.parents)),
        ("tree build best-first + flatten (host)",
         lambda: flatten_trees(build_best_first_trees(t["marginals"], args.tree_nodes))),
        ("draft-length cap (DSpark objective) [B, γ]", lambda: policy.cap(survival, args.gamma)),
    ]
    print(f"device={device} batch={args.batch} gamma={args.gamma} vocab={args.vocab} "
          f"tree_nodes={args.tree_nodes} torch={torch.__version__} threads={torch.get_num_threads()}")
    base = None
    for name, fn in cases:
        sec = timeit(fn, device, args.warmup, args.reps)
        base = base if base is not None else sec
        print(f"{name:42s} {sec * 1e3:9.3f} ms   {sec / base:7.2f}x softmax")


if __name__ == "__main__":
    main()
