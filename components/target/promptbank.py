"""The embedded chat target's prompt bank: self-generated user turns and corpus documents, split.

SmolLM2-135M-Instruct arrives without prompts, so it writes its own, Magpie-style: the chat
template rendered up to the start of a user turn (``<|im_start|>user\\n`` after the default
system turn), sampled at ``temperature`` / ``top_p`` until the turn ends. Kept are the turns
that end within ``question_max_tokens``, have ``min_words``..``max_words`` words, read as
English (ASCII letters, common function words) and are not duplicates (case, spacing and
punctuation ignored); each kept turn goes to the held-out side by a hash of its normalised text
(``heldout_fraction``), so no question is on both sides. The offline corpus (Shakespeare and
the Python standard library, :mod:`components.target.corpus`) is split by document as the tiny
target's is, for instruction prompts (explain / summarise / continue a passage) on the training
side and summarisation prompts on the held-out side.

Written into the target directory, in the layout the tiny target has, so the data and
evaluation stages read either target the same way:

- ``chat/{train,heldout}.jsonl``: ``{"messages": [{"role": "user", "content": ...}]}``
- ``corpus/{train,heldout}.jsonl``: ``{"source", "name", "text"}``
- ``prompt_bank.json``: settings, counts, rejections by reason, seconds.

Each file is written to a temporary name and renamed, the info file last, so an interrupted
build is redone. Knows HF models, tokenizers and the corpus; nothing about drafters or Ray.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from components.config import PromptBankConfig
from components.target import corpus as corpus_mod
from components.target.hfbars import no_hf_bars
from components.target.tokenizer import stop_token_ids

BANK_VERSION = 1
INFO_FILE = "prompt_bank.json"
ENGLISH_WORDS = frozenset([  # a kept turn has at least one of these
    "a", "an", "the", "and", "or", "of", "to", "in", "on", "for", "with", "is", "are", "was", "be",
    "can", "you", "i", "me", "my", "what", "how", "why", "which", "who", "when", "where", "do",
    "does", "it", "this", "that"])


class PromptBankError(RuntimeError):
    """The prompt bank could not be built; the message says why and what to change."""


# ----------------------------------------------------------------------------- filtering
def normalise(text: str) -> str:
    """Lower case, letters and digits only, single spaces: the key for duplicates and the split."""
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def rejection(text: str, cfg: PromptBankConfig) -> str | None:
    """Why a generated user turn is not kept (None: kept). ``text`` is the turn, stripped."""
    words = text.split()
    if not cfg.min_words <= len(words) <= cfg.max_words:
        return "length"
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) / len(letters) < 0.98:
        return "language"
    if not ENGLISH_WORDS & {w.lower().strip(".,?!:;'\"") for w in words}:
        return "language"
    if "<|" in text or "|>" in text:
        return "markup"
    return None


def is_heldout_question(text: str, fraction: float) -> bool:
    digest = hashlib.sha256(normalise(text).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def user_turn_prefix(tokenizer: Any) -> str:
    """The chat template rendered up to where a user's words begin (default system turn included)."""
    marker = "\u2063specline\u2063"
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    if marker not in rendered:
        raise PromptBankError("the target's chat template does not render a user turn's content")
    return rendered[: rendered.index(marker)]


# ----------------------------------------------------------------------------- generation
@torch.no_grad()
def sample_turns(model: Any, tokenizer: Any, prefix_ids: list[int], count: int, stop_ids: list[int],
                 cfg: PromptBankConfig, batch_index: int) -> list[str | None]:
    """``count`` sampled user turns after ``prefix_ids``; None where the turn did not end in time."""
    torch.manual_seed(cfg.seed * 100_003 + batch_index)
    ids = torch.tensor([prefix_ids] * count)  # [B, P]: one prefix, so no padding
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                         temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=cfg.question_max_tokens,
                         eos_token_id=stop_ids, pad_token_id=stop_ids[0])
    turns: list[str | None] = []
    for row in out[:, ids.shape[1]:].tolist():  # [B, ≤ question_max_tokens]
        ends = [i for i, t in enumerate(row) if t in stop_ids]
        turns.append(tokenizer.decode(row[: ends[0]], skip_special_tokens=True).strip() if ends else None)
    return turns


Sampler = Callable[[int], list[str | None]]  # batch index → sampled user turns (None: unfinished)


def model_sampler(target_dir: Path, cfg: PromptBankConfig) -> Sampler:
    """Samples ``cfg.batch_size`` user turns per call from the checkpoint in ``target_dir``."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    with no_hf_bars():
        model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    stop_ids = stop_token_ids(tokenizer)
    prefix = tokenizer(user_turn_prefix(tokenizer), add_special_tokens=False)["input_ids"]
    return lambda batch: sample_turns(model, tokenizer, prefix, cfg.batch_size, stop_ids, cfg, batch)


def generate_questions(sampler: Sampler, cfg: PromptBankConfig, progress: bool) -> tuple[list[str], Counter]:
    """Up to ``cfg.questions`` distinct kept user turns, and how many were rejected by reason."""
    from tqdm.auto import tqdm

    kept: dict[str, str] = {}
    rejected: Counter = Counter()
    max_batches = -(-cfg.questions * 3 // cfg.batch_size)  # give up after 3× the candidates needed
    bar = tqdm(total=cfg.questions, desc="prompt bank: questions", unit="q", disable=not progress)
    for batch in range(max_batches):
        if len(kept) >= cfg.questions:
            break
        for turn in sampler(batch):
            why = "unfinished" if turn is None else rejection(turn, cfg)
            if why is None and normalise(turn) in kept:
                why = "duplicate"
            if why is not None:
                rejected[why] += 1
            elif len(kept) < cfg.questions:
                kept[normalise(turn)] = turn
                bar.update(1)
    bar.close()
    if not kept:
        raise PromptBankError(f"target.prompts: none of the {sum(rejected.values())} generated user turns "
                              f"passed the filters ({dict(rejected)}); loosen min_words/max_words")
    return list(kept.values()), rejected


# ----------------------------------------------------------------------------- the bank
def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def bank_settings(cfg: PromptBankConfig) -> dict[str, Any]:
    return {"bank_version": BANK_VERSION, **asdict(cfg)}


def read_bank_info(target_dir: Path) -> dict[str, Any] | None:
    path = target_dir / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def ensure_prompt_bank(target_dir: Path, cfg: PromptBankConfig, corpus_cache: Path, progress: bool = True,
                       sampler: Sampler | None = None) -> tuple[dict[str, Any], bool]:
    """(bank info, built_now): the bank of ``target_dir``, built when missing or made otherwise.

    ``sampler`` replaces sampling from the checkpoint in ``target_dir`` (tests script the turns).
    """
    info = read_bank_info(target_dir)
    if info is not None and info.get("settings") == bank_settings(cfg):
        return info, False
    t0 = time.perf_counter()
    docs = corpus_mod.load_documents(cfg.corpus_sources, cfg.corpus_max_chars, corpus_cache)
    train_docs, heldout_docs = corpus_mod.split_documents(docs, cfg.heldout_fraction)
    questions, rejected = generate_questions(sampler or model_sampler(target_dir, cfg), cfg, progress)
    sides = {"train": [q for q in questions if not is_heldout_question(q, cfg.heldout_fraction)],
             "heldout": [q for q in questions if is_heldout_question(q, cfg.heldout_fraction)]}
    (target_dir / INFO_FILE).unlink(missing_ok=True)  # the files below are being replaced
    for split, docs_side in (("train", train_docs), ("heldout", heldout_docs)):
        _write_jsonl(target_dir / "corpus" / f"{split}.jsonl", [asdict(d) for d in docs_side])
        _write_jsonl(target_dir / "chat" / f"{split}.jsonl",
                     [{"messages": [{"role": "user", "content": q}]} for q in sides[split]])
    info = {"settings": bank_settings(cfg),
            "questions": {k: len(v) for k, v in sides.items()}, "rejected": dict(rejected),
            "documents": {"train": len(train_docs), "heldout": len(heldout_docs)},
            "corpus_fingerprint": corpus_mod.corpus_fingerprint(docs),
            "examples": sides["train"][:5], "seconds": time.perf_counter() - t0}
    tmp = target_dir / f"{INFO_FILE}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, target_dir / INFO_FILE)
    return info, True
