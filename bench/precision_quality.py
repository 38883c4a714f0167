"""What each ``target.step_precision`` costs in quality: the fast step's logits over held-out
records, teacher-forced, beside the float32 step's.

For every precision the CPU declares (``kernels.precisions``), the same records (prompt and the
target's response, read from a data stage's shards: every ``--every``-th record up to
``--records``) go through the step in one pass each, and it prints:

* perplexity of the prompt tokens (the records' prompts: text the target did not write) and of
  the response tokens (the float32 target's own greedy output, so near 1);
* the share of positions whose argmax equals the float32 step's (1.0 for float32 itself): a
  greedy continuation stays on float32's text only while every one of its tokens agrees.

    python bench/precision_quality.py --data runs/data [--records 60 --every 8 --threads 2]

Nothing is asserted; the numbers describe the arithmetic, not this machine's speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import SMOLLM2_TARGET, TargetConfig
from components.data.shards import read_records
from components.target import load_target
from components.target.fast import step_target
from components.target.kernels import precisions


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a data stage's output directory (its shards)")
    ap.add_argument("--records", type=int, default=60)
    ap.add_argument("--every", type=int, default=8, help="take every N-th record")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=str(Path("~/.cache/specline/targets").expanduser()))
    return ap.parse_args(argv)


@dataclasses.dataclass
class Tally:
    prompt_nll: float = 0.0
    prompt_tokens: int = 0
    response_nll: float = 0.0
    response_tokens: int = 0
    agree: int = 0
    positions: int = 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    records = list(itertools.islice(read_records(Path(args.data)), 0, None, args.every))[:args.records]
    base = TargetConfig(name_or_path=SMOLLM2_TARGET, dtype="float32", device="cpu", cache_dir=args.cache_dir,
                        step="fast", static_len=max(r.num_tokens for r in records) + 1)
    target = load_target(base)
    steps = {p: step_target(target, dataclasses.replace(base, step_precision=p)) for p in precisions()}
    tallies = {p: Tally() for p in steps}
    for record in records:
        ids = torch.tensor(record.input_ids, dtype=torch.long)[None]  # [1, T]
        cut = record.prompt_len - 1  # positions before it predict prompt tokens
        reference = None
        for precision, step in steps.items():
            logits = step.forward(ids, use_cache=True).logits[0, :-1].float()  # [T - 1, V]
            nll = F.cross_entropy(logits, ids[0, 1:], reduction="none")
            top = logits.argmax(-1)
            reference = top if reference is None else reference  # float32 comes first
            t = tallies[precision]
            t.prompt_nll += nll[:cut].sum().item()
            t.prompt_tokens += cut
            t.response_nll += nll[cut:].sum().item()
            t.response_tokens += nll.numel() - cut
            t.agree += int((top == reference).sum())
            t.positions += top.numel()
    print(f"{len(records)} records of {args.data} ({sum(t.positions for t in tallies.values()) // len(tallies):,} "
          f"positions), {args.threads} threads\n")
    print("| step_precision | prompt perplexity | response perplexity | argmax = float32's |")
    print("|---|---|---|---|")
    for precision, t in tallies.items():
        print(f"| {precision} | {math.exp(t.prompt_nll / t.prompt_tokens):.3f} | "
              f"{math.exp(t.response_nll / t.response_tokens):.4f} | {t.agree / t.positions:.3%} ({t.positions - t.agree} differ) |")


if __name__ == "__main__":
    main()
