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

- ``chat/{train,heldout}.jsonl``: ``{"messages": [{"role": "user", "content": ...}], "bank_index": i}``,
  ``i`` the turn's place in the order sampled;
- ``chat/pool-<hash of the settings but questions>.json``: every turn kept so far, in the order
  sampled, and where sampling stopped. The bank of ``questions`` turns is the pool's first
  ``questions``: a larger bank samples on from where a smaller one stopped, a smaller one is cut
  from a larger (see :func:`grow_pool`);
- ``corpus/{train,heldout}.jsonl``: ``{"source", "name", "text"}``
- ``prompt_bank.json``: settings, counts, rejections by reason, the pool's size, seconds.

Each file is written to a temporary name and renamed, the info file last, so an interrupted
build is redone (from the pool it had reached). Knows HF models, tokenizers and the corpus;
nothing about drafters or Ray.
"""

from __future__ import annotations

import hashlib
import json
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
from components.io import write_text
from components.target import corpus as corpus_mod
from components.target.hfbars import no_hf_bars
from components.target.tokenizer import stop_token_ids

BANK_VERSION = 2  # 2: the bank is a prefix of a pool that grows (1 kept no pool)
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


def grow_pool(pool: dict[str, Any], sampler: Sampler, cfg: PromptBankConfig, progress: bool,
              save: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The pool with batches sampled after its last until it keeps ``cfg.questions`` turns.

    A pool is ``{"questions": kept turns in the order sampled, "next_batch", "rejected": by reason}``.
    Every batch is taken whole (a pool may keep a few more than asked), and a batch's turns depend
    only on the seed and its index, so a pool grown in steps equals one sampled at once and any
    prefix of it is the bank of that size. Gives up after 3× the candidates needed. ``save`` gets
    the pool after every batch, so an interrupted build samples on from there.
    """
    from tqdm.auto import tqdm

    kept = {normalise(q): q for q in pool["questions"]}
    rejected = Counter(pool["rejected"])
    batch = pool["next_batch"]
    max_batches = -(-cfg.questions * 3 // cfg.batch_size)
    bar = tqdm(total=cfg.questions, initial=min(len(kept), cfg.questions), desc="prompt bank: questions",
               unit="q", disable=not progress)
    while len(kept) < cfg.questions and batch < max_batches:
        for turn in sampler(batch):
            why = "unfinished" if turn is None else rejection(turn, cfg)
            if why is None and normalise(turn) in kept:
                why = "duplicate"
            if why is not None:
                rejected[why] += 1
            else:
                kept[normalise(turn)] = turn
                bar.update(1 if len(kept) <= cfg.questions else 0)
        batch += 1
        pool = {"questions": list(kept.values()), "next_batch": batch, "rejected": dict(rejected)}
        if save is not None:
            save(pool)
    bar.close()
    if not kept:
        raise PromptBankError(f"target.prompts: none of the {sum(rejected.values())} generated user turns "
                              f"passed the filters ({dict(rejected)}); loosen min_words/max_words")
    return pool


# ----------------------------------------------------------------------------- the bank
def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    write_text(path, "".join(json.dumps(row) + "\n" for row in rows))


def bank_settings(cfg: PromptBankConfig) -> dict[str, Any]:
    return {"bank_version": BANK_VERSION, **asdict(cfg)}


def pool_settings(cfg: PromptBankConfig) -> dict[str, Any]:
    """What the pool's turns depend on: the bank's settings but for how many it holds."""
    return {k: v for k, v in bank_settings(cfg).items() if k != "questions"}


def read_bank_info(target_dir: Path) -> dict[str, Any] | None:
    path = target_dir / INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def pool_path(target_dir: Path, cfg: PromptBankConfig) -> Path:
    """One pool per setting of what its turns depend on, so switching settings back samples nothing."""
    digest = hashlib.sha256(json.dumps(pool_settings(cfg), sort_keys=True).encode()).hexdigest()[:12]
    return target_dir / "chat" / f"pool-{digest}.json"


def read_pool(target_dir: Path, cfg: PromptBankConfig) -> dict[str, Any]:
    """The pool of ``target_dir`` sampled with ``cfg``'s settings, or an empty one."""
    path = pool_path(target_dir, cfg)
    pool = json.loads(path.read_text()) if path.is_file() else {}
    if pool.get("settings") != pool_settings(cfg):
        return {"questions": [], "next_batch": 0, "rejected": {}}
    return pool


def ensure_prompt_bank(target_dir: Path, cfg: PromptBankConfig, corpus_cache: Path, progress: bool = True,
                       sampler: Sampler | None = None) -> tuple[dict[str, Any], bool]:
    """(bank info, written_now): the bank of ``target_dir``, written when missing or of another size.

    The bank is the first ``cfg.questions`` turns of the pool (``pool_path``); a pool with fewer
    is sampled further, one with other settings is sampled anew. So switching between bank
    sizes rewrites the split files in a second and samples only what no smaller bank had; two runs
    with different sizes at once on one target directory would each rewrite the other's splits.
    ``sampler`` replaces sampling from the checkpoint in ``target_dir`` (tests script the turns).
    """
    info = read_bank_info(target_dir)
    if info is not None and info.get("settings") == bank_settings(cfg):
        return info, False
    t0 = time.perf_counter()
    docs = corpus_mod.load_documents(cfg.corpus_sources, cfg.corpus_max_chars, corpus_cache)
    train_docs, heldout_docs = corpus_mod.split_documents(docs, cfg.heldout_fraction)
    pool = read_pool(target_dir, cfg)
    sampled_before = len(pool["questions"])
    if sampled_before < cfg.questions:
        path, settings = pool_path(target_dir, cfg), pool_settings(cfg)
        pool = grow_pool(pool, sampler or model_sampler(target_dir, cfg), cfg, progress,
                         save=lambda grown: write_text(path, json.dumps({"settings": settings, **grown})))
    questions = pool["questions"][: cfg.questions]  # in the order sampled: a prefix of any larger bank
    sides = {"train": [(i, q) for i, q in enumerate(questions) if not is_heldout_question(q, cfg.heldout_fraction)],
             "heldout": [(i, q) for i, q in enumerate(questions) if is_heldout_question(q, cfg.heldout_fraction)]}
    (target_dir / INFO_FILE).unlink(missing_ok=True)  # the files below are being replaced
    for split, docs_side in (("train", train_docs), ("heldout", heldout_docs)):
        _write_jsonl(target_dir / "corpus" / f"{split}.jsonl", [asdict(d) for d in docs_side])
        _write_jsonl(target_dir / "chat" / f"{split}.jsonl",  # bank_index: the turn's place in the pool
                     [{"messages": [{"role": "user", "content": q}], "bank_index": i} for i, q in sides[split]])
    info = {"settings": bank_settings(cfg),
            "questions": {k: len(v) for k, v in sides.items()}, "rejected": pool["rejected"],
            "pool": {"questions": len(pool["questions"]), "batches": pool["next_batch"],
                     "sampled_now": len(pool["questions"]) - sampled_before},
            "documents": {"train": len(train_docs), "heldout": len(heldout_docs)},
            "corpus_fingerprint": corpus_mod.corpus_fingerprint(docs),
            "examples": [q for _, q in sides["train"][:5]], "seconds": time.perf_counter() - t0}
    write_text(target_dir / INFO_FILE, json.dumps(info, indent=2))
    return info, True
