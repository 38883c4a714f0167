"""What a CPU cannot time: a full-size target's forward-time curve, the drafter's cost per round
relative to one target step (the survey's c), and the engine's tokens/s at batch 1 and 32.

    python bench/gpu_timing.py [--shape qwen3-8b] [--device cuda] [--new-tokens 64] [--out FILE]

The target has Qwen3-8B's shape with random bfloat16 weights (timing only; nothing is
downloaded), the drafters their default configurations on it. Printed and written as JSON:

* ``T(n)``      -- median seconds of one forward over n = 1..512 new tokens (batch 1) on top of a
                   ``--context``-token KV cache;
* ``c``         -- one drafting round (``propose`` of γ tokens after a ``--context`` context) over
                   T(1), per drafter (goal for DSpark: ≤ 0.05);
* engine        -- ``BatchEngine`` tokens/s at batch 1 and 32, plain vs speculative, with the real
                   DSpark drafter's cost but a synthetic acceptance pattern: each request's drafts
                   are replaced by its own greedy continuation for the first k slots, k ~ the
                   number of successes before a failure at rate ``--alpha``, then a wrong token,
                   so τ is set by ``--alpha`` and the verification is real (outputs are checked
                   equal to plain decoding); plain decoding also with the KV cache grown by
                   ``torch.cat`` every round (``preallocate=False``) beside the preallocated one.

``--shape tiny`` runs the same script on a small random model in seconds (CPU check). Needs
torch and transformers (and this repository's components, which import without omegaconf, Ray or
vLLM).
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
from components.config import DrafterConfig
from components.drafters.registry import build_drafter
from components.engine.batch import BatchEngine, Request
from components.target.hf import Target

SHAPES = {  # Qwen3-8B's config.json sizes; "tiny" for a quick CPU run of this script
    "qwen3-8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936},
    "tiny": {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024},
}


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--alpha", type=float, default=0.8, help="synthetic per-draft acceptance rate")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="")
    return ap.parse_args()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median_seconds(fn: Any, dev: torch.device, reps: int) -> float:
    fn()
    sync(dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def random_target(shape: str, dev: torch.device, dtype: torch.dtype) -> Target:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(dev):
        model = Qwen3ForCausalLM(cfg).to(dtype)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    return Target(model, tok, f"random-{shape}")


@torch.no_grad()
def forward_curve(target: Target, context: int, reps: int) -> dict[int, float]:
    dev, out = target.device, {}
    prefix = torch.randint(0, target.vocab_size, (1, context), device=dev)
    for n in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512):
        new = torch.randint(0, target.vocab_size, (1, n), device=dev)
        cache = target.forward(prefix, use_cache=True).cache

        def step(cache: Any = cache, new: torch.Tensor = new, n: int = n) -> None:
            target.forward(new, cache=cache, use_cache=True)
            cache.crop(-n)
        out[n] = median_seconds(step, dev, reps)
    return out


@torch.no_grad()
def drafter_cost(target: Target, name: str, context: int, reps: int) -> dict[str, float]:
    drafter = build_drafter(DrafterConfig(name=name, mask_token_id=0), target).eval()
    dev = target.device
    ids = torch.randint(0, target.vocab_size, (1, context), device=dev)
    hidden = target.forward(ids, layer_ids=drafter.layer_ids).hidden
    state = drafter.consume(drafter.init_state(1), ids[:, :-1], hidden[:, :-1])
    seconds = median_seconds(lambda: drafter.propose(state, ids[:, -1]), dev, reps)
    return {"seconds": seconds, "num_speculative_tokens": drafter.num_speculative_tokens, "layers": drafter.cfg.num_layers,
            "params": drafter.num_parameters()}


class SyntheticAcceptance:
    """Runs the real drafter (its cost is real), then replaces its drafts: the request's own
    greedy continuation for k ~ Geometric slots, then a token that is certainly wrong."""

    def __init__(self, drafter: Any, references: dict[tuple[int, ...], list[int]], alpha: float):
        self.inner, self.references, self.alpha = drafter, references, alpha
        self.layer_ids, self.num_speculative_tokens = drafter.layer_ids, drafter.num_speculative_tokens
        self.gen = torch.Generator().manual_seed(0)

    def capabilities(self) -> frozenset:
        """None: it wraps ``propose``/``consume`` only, so the engine drafts its rows one by one."""
        return frozenset()

    def init_state(self, batch_size: int) -> dict:
        return {"inner": self.inner.init_state(batch_size), "ref": None, "length": 0, "prompt": 0}

    def consume(self, state: dict, tokens: torch.Tensor, hidden: torch.Tensor | None) -> dict:
        ref = state["ref"]
        if ref is None:  # the prompt: find this request's reference continuation
            ref = self.references[tuple(tokens[0].tolist())]
        return {"inner": self.inner.consume(state["inner"], tokens, hidden), "ref": ref,
                "length": state["length"] + tokens.shape[1], "prompt": state["prompt"] or tokens.shape[1]}

    def propose(self, state: dict, last_token: torch.Tensor, sampling: Any = None, generator: Any = None,
                num_speculative_tokens: int | None = None) -> Any:
        prop = self.inner.propose(state["inner"], last_token, sampling, generator, num_speculative_tokens)
        gamma = prop.tokens.shape[1]
        start = state["length"] + 1 - state["prompt"]  # index in the reference of draft 1
        k = 0
        while k < gamma and float(torch.rand((), generator=self.gen)) < self.alpha:
            k += 1
        ref = state["ref"][start:start + gamma]
        tokens = prop.tokens.clone()
        for j in range(gamma):
            right = ref[j] if j < len(ref) else 0
            tokens[0, j] = right if j < k else (right + 1) % prop.logits.shape[-1]
        prop.tokens = tokens
        return prop


def engine_throughput(target: Target, batches: list[int], new_tokens: int, alpha: float) -> list[dict]:
    drafter = build_drafter(DrafterConfig(name="dspark", mask_token_id=0), target).eval()
    rows = []
    for bsz in batches:
        prompts = [torch.randint(0, target.vocab_size, (64,)).tolist() for _ in range(bsz)]

        def reqs(prompts: list[list[int]] = prompts) -> list[Request]:
            return [Request(p, new_tokens) for p in prompts]
        plain = BatchEngine(target, None, max_batch_size=bsz)
        plain.generate(reqs()[:1])  # warmup
        t0 = time.perf_counter()
        base = plain.generate(reqs())
        sync(target.device)
        plain_s = time.perf_counter() - t0
        t0 = time.perf_counter()  # the same with a KV cache grown by torch.cat every round
        cat = BatchEngine(target, None, max_batch_size=bsz, preallocate=False).generate(reqs())
        sync(target.device)
        cat_s = time.perf_counter() - t0
        refs = {tuple(p): r.tokens for p, r in zip(prompts, base)}
        spec = BatchEngine(target, SyntheticAcceptance(drafter, refs, alpha), max_batch_size=bsz)
        t0 = time.perf_counter()
        out = spec.generate(reqs())
        sync(target.device)
        spec_s = time.perf_counter() - t0
        accepted = [a for r in out for a in r.accepted]
        rows.append({"batch": bsz, "plain_tok_s": bsz * new_tokens / plain_s, "spec_tok_s": bsz * new_tokens / spec_s,
                     "plain_cat_cache_tok_s": bsz * new_tokens / cat_s, "speedup": plain_s / spec_s,
                     "tau": 1 + sum(accepted) / max(1, len(accepted)),
                     "lossless": [r.tokens for r in out] == [r.tokens for r in base] == [r.tokens for r in cat]})
    return rows


def main() -> None:
    args = parse_args()
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = random_target(args.shape, dev, dtype)
    info = {"shape": args.shape, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": args.dtype, "context": args.context, "torch": torch.__version__}
    curve = forward_curve(target, args.context, args.reps)
    print("T(n) ms: " + ", ".join(f"{n}:{1000 * s:.2f}" for n, s in curve.items()), flush=True)
    costs = {}
    for name in ("dspark", "dflash", "eagle3"):
        costs[name] = drafter_cost(target, name, args.context, args.reps)
        costs[name]["c"] = costs[name]["seconds"] / curve[1]
        print(f"{name}: {costs[name]['layers']} layers, γ={costs[name]['num_speculative_tokens']}, "
              f"round {1000 * costs[name]['seconds']:.2f} ms, c = {costs[name]['c']:.3f}", flush=True)
    engine = engine_throughput(target, [int(b) for b in args.batches.split(",")], args.new_tokens, args.alpha)
    for row in engine:
        print(f"batch {row['batch']}: plain {row['plain_tok_s']:.1f} tok/s (KV cache by cat: "
              f"{row['plain_cat_cache_tok_s']:.1f}), speculative {row['spec_tok_s']:.1f} tok/s "
              f"({row['speedup']:.2f}x, τ {row['tau']:.2f}, lossless {row['lossless']})", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({**info, "forward_seconds": curve, "drafters": costs,
                                              "engine": engine}, indent=1))


if __name__ == "__main__":
    main()
