"""Forward+backward time of every registered drafter loss, as a ratio to one torch.softmax.

    python bench/losses.py                      # batch 32 × γ 16 × vocab 32000, CPU float32
    python bench/losses.py --dtype bfloat16 --device cuda --reps 20

The baseline is one `torch.softmax` over the same [B, γ, V] draft logits, timed right before
every rep of every loss in the same run (median of all those samples, their range printed), so
the ratios say how many softmax passes a loss costs and stay comparable across machines.
Nothing is asserted; read the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import components  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.losses import LOSSES, LossInputs, build_loss, decay_weights


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=32, help="draft blocks N")
    ap.add_argument("--gamma", type=int, default=16, help="draft positions per block")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--losses", nargs="*", default=sorted(LOSSES), help="registry names")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def make_inputs(args: argparse.Namespace) -> LossInputs:
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    shape = (args.batch, args.gamma, args.vocab)
    dtype, dev = getattr(torch, args.dtype), torch.device(args.device)

    def randn(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g).to(device=dev, dtype=dtype)

    valid = torch.rand(shape[:2], generator=g) > 0.1
    return LossInputs(
        draft_logits=(2.0 * randn(*shape)).requires_grad_(True),
        target_logits=2.0 * randn(*shape),
        target_tokens=torch.randint(0, args.vocab, shape[:2], generator=g).to(dev),
        valid=valid.to(dev),
        position_weights=decay_weights(args.gamma, 7.0, device=dev),
        confidence_logits=randn(*shape[:2]).requires_grad_(True),
    )


def once(fn: Callable[[], object], sync: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def interleaved(
    fn: Callable[[], object],
    base: Callable[[], object],
    base_times: list[float],
    args: argparse.Namespace,
    dev: torch.device,
) -> float:
    """Median seconds of fn; each rep also times base right before fn and appends it to
    base_times, so the baseline samples the same machine state as every loss."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for _ in range(args.warmup):
        base(), fn()
    times = []
    for _ in range(args.reps):
        base_times.append(once(base, sync))
        times.append(once(fn, sync))
    return statistics.median(times)


def forward_backward(name: str, inputs: LossInputs) -> Callable[[], None]:
    loss = build_loss(name)

    def step() -> None:
        inputs.draft_logits.grad = None
        inputs.confidence_logits.grad = None
        loss(inputs).loss.backward()

    return step


def main() -> None:
    args = parse_args()
    inputs = make_inputs(args)
    dev = inputs.draft_logits.device
    print(
        f"# losses: B={args.batch} γ={args.gamma} V={args.vocab} {args.dtype} on {dev}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"median of {args.reps} reps after {args.warmup} warmup"
    )

    def softmax() -> None:
        with torch.no_grad():
            torch.softmax(inputs.draft_logits, -1)

    base_times: list[float] = []
    results = [
        (name, interleaved(forward_backward(name, inputs), softmax, base_times, args, dev))
        for name in args.losses
    ]
    base = statistics.median(base_times)
    spread = f"{min(base_times) * 1e3:.1f}..{max(base_times) * 1e3:.1f}"
    print(f"{'softmax (baseline, forward only)':<34} {base * 1e3:9.1f} ms   1.00x  ({spread} ms)")
    for name, t in results:
        print(f"{name + ' (fwd+bwd)':<34} {t * 1e3:9.1f} ms {t / base:6.2f}x")


if __name__ == "__main__":
    main()
