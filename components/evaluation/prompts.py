"""Evaluation prompts: the held-out side of the data, never the prompts drafters trained on.

The embedded target splits its corpus by *document* (a hash of each document's name puts 5% of
them on the held-out side, ``components.target.corpus.split_documents``) and writes both sides:
``corpus/{train,heldout}.jsonl`` and ``chat/{train,heldout}.jsonl``. The data stage reads only
``train``; evaluation (``eval.prompt_source=embedded``) reads only ``heldout``: the first user
turns of held-out conversations and ``eval.text_prompt_tokens``-token windows of held-out
documents (windows start at a line chosen by a hash of the prompt id), interleaved by
``eval.embedded_kinds`` and spread evenly over the split. Any other source (a prompt file,
``hf:<dataset>[:split]``) is read by the data stage's own readers; keeping it disjoint from the
training prompts is then up to whoever chose it.

Knows tokenizers and the split files; nothing about models or methods.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path
from typing import Any

from components.config import ConfigError, DataConfig, EvalConfig
from components.data.prompts import (
    Prompt,
    RawPrompt,
    collect_prompts,
    encode,
    prompt_seed,
    row_prompts,
)

WINDOW_LINES = 40


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def _spread(items: list[Any], n: int) -> list[Any]:
    """``n`` items evenly spaced over ``items`` (all of them if fewer)."""
    return items if n >= len(items) else [items[i * len(items) // n] for i in range(n)]


def _window(text: str, key: str) -> str:
    lines = text.splitlines(keepends=True)
    start = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % max(1, len(lines) - WINDOW_LINES)
    return "".join(lines[start:start + WINDOW_LINES])


def _chat_candidates(target_dir: Path, n: int) -> list[RawPrompt]:
    rows = _spread(list(enumerate(_rows(target_dir / "chat" / "heldout.jsonl"))), n)
    return [p for i, row in rows for p in row_prompts(row, f"heldout-chat:{i}")[:1]]


def _text_candidates(target_dir: Path, n: int, max_tokens: int) -> list[RawPrompt]:
    """``n`` windows, cycling over the held-out documents (several windows each if few)."""
    docs = _rows(target_dir / "corpus" / "heldout.jsonl")
    out = []
    for j in range(n if docs else 0):
        d = docs[j % len(docs)]
        pid = f"heldout-text:{d['source']}/{d['name']}@{j // len(docs)}"
        out.append(RawPrompt(pid, text=_window(d["text"], pid), max_tokens=max_tokens))
    return out


def heldout_candidates(target_dir: Path, ev: EvalConfig) -> list[RawPrompt]:
    """Candidate prompts from the held-out split, interleaved by kind (spares for skipped ones)."""
    kinds = list(ev.embedded_kinds)
    if not kinds or set(kinds) - {"chat", "text"}:
        raise ConfigError(f"eval.embedded_kinds: {kinds} must be a non-empty subset of ['chat', 'text']")
    per_kind = 2 * ev.num_prompts // len(kinds) + 1
    lists = []
    if "chat" in kinds:
        lists.append(_chat_candidates(target_dir, per_kind))
    if "text" in kinds:
        lists.append(_text_candidates(target_dir, per_kind, ev.text_prompt_tokens))
    return [p for group in itertools.zip_longest(*lists) for p in group if p is not None]


def eval_prompts(ev: EvalConfig, tokenizer: Any, target_dir: Path | None) -> list[Prompt]:
    """Up to ``eval.num_prompts`` tokenized prompts within ``eval.max_prompt_tokens``."""
    if ev.prompt_source != "embedded":
        data = DataConfig(prompt_source=ev.prompt_source, max_prompts=ev.num_prompts, seed=ev.seed,
                          max_prompt_tokens=ev.max_prompt_tokens, text_prompt_tokens=ev.text_prompt_tokens)
        return collect_prompts(data, tokenizer, None)[0]
    if target_dir is None or not (target_dir / "corpus" / "heldout.jsonl").is_file():
        raise ConfigError("eval.prompt_source: 'embedded' needs the embedded target's held-out split "
                          "(corpus/heldout.jsonl); give a prompt file or 'hf:<dataset>' for other targets")
    prompts: list[Prompt] = []
    for raw in heldout_candidates(target_dir, ev):
        ids = encode(raw, tokenizer)
        if 1 <= len(ids) <= ev.max_prompt_tokens and len(prompts) < ev.num_prompts:
            prompts.append(Prompt(raw.prompt_id, tuple(ids), prompt_seed(ev.seed, raw.prompt_id)))
    if not prompts:
        raise ConfigError(f"eval: no held-out prompt of 1..{ev.max_prompt_tokens} tokens in {target_dir}")
    return prompts

