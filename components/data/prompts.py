"""Prompt sources for the data stage: where prompts come from and how they become token ids.

Sources (``data.prompt_source``):

- ``embedded``: a built-in target's *training* split only, interleaved by ``embedded_kinds``:
  ``chat`` (``chat/train.jsonl``: the turns before a conversation's first assistant turn,
  rendered with the chat template; the embedded SmolLM2's are the user turns it wrote itself),
  ``instruct`` (a chat turn asking to explain, summarise or continue a passage of at most
  ``instruct_passage_tokens`` tokens from a ``corpus/train.jsonl`` document) and ``text``
  (``text_prompt_tokens`` tokens from a window of a document, no template). The held-out split
  is never read.
- in files (below), every assistant turn of a conversation gives one prompt: the turns before it.
- a local ``.jsonl`` / ``.json`` / ``.parquet`` file of rows in one of these schemas:
  ``{"messages": [{"role", "content"}, ...]}`` (UltraChat-200k / OpenAI style),
  ``{"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}`` (ShareGPT),
  ``{"data": [user, assistant, ...]}`` (original UltraChat), ``{"prompt": str}`` (one user
  turn) or ``{"text": str}`` (raw text, no chat template).
- ``hf:<dataset dir or hub id>[:split]``: a Hugging Face dataset saved with ``save_to_disk``,
  or loaded from the hub when online; rows as above.

Empty and over-long prompts are skipped and counted; a malformed jsonl line is reported with
``file:line`` and skipped. This module knows tokenizers and file formats; it knows nothing
about models, Ray or records.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.config import ConfigError, DataConfig

log = logging.getLogger(__name__)
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "bot": "assistant", "model": "assistant", "system": "system"}


class PromptError(ConfigError):
    """Prompts cannot be read as configured; the message names the file or field."""


@dataclass(frozen=True)
class RawPrompt:
    prompt_id: str  # stable id: "<source>:<row>[:<turn>]"
    messages: tuple[tuple[str, str], ...] | None = None  # (role, content) turns before a reply
    text: str | None = None  # raw text prompt (no chat template)
    max_tokens: int | None = None  # keep only a prefix of this many tokens (document prompts)


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    input_ids: tuple[int, ...]  # [P] token ids, special tokens included
    seed: int  # per-prompt sampling seed (from data.seed and the prompt id)


@dataclass
class PromptStats:
    read: int = 0  # candidate prompts looked at
    used: int = 0
    empty: int = 0  # fewer than data.min_prompt_tokens tokens (or no content)
    too_long: int = 0  # more than data.max_prompt_tokens tokens
    malformed: int = 0  # rows that could not be parsed or mapped to a prompt
    malformed_where: list[str] = field(default_factory=list)  # first few "file:line: why"

    def note_malformed(self, where: str) -> None:
        self.malformed += 1
        if len(self.malformed_where) < 20:
            self.malformed_where.append(where)
        log.warning("%s; skipped", where)


# ----------------------------------------------------------------------------- row → prompts
def _messages(row: dict[str, Any]) -> list[tuple[str, str]] | None:
    if isinstance(row.get("messages"), list):
        return [(ROLE_ALIASES[m["role"]], str(m["content"])) for m in row["messages"]]
    if isinstance(row.get("conversations"), list):
        return [(ROLE_ALIASES[m["from"]], str(m["value"])) for m in row["conversations"]]
    if isinstance(row.get("data"), list):
        return [(("user", "assistant")[i % 2], str(t)) for i, t in enumerate(row["data"])]
    if isinstance(row.get("prompt"), str):
        return [("user", row["prompt"])]
    return None


def row_prompts(row: Any, prompt_id: str) -> list[RawPrompt]:
    """One prompt per assistant turn (the turns before it), or the whole row if none.

    Raises KeyError/TypeError/ValueError when the row fits no known schema.
    """
    if not isinstance(row, dict):
        raise TypeError(f"expected an object, got {type(row).__name__}")
    turns = _messages(row)
    if turns is None:
        if isinstance(row.get("text"), str):
            return [RawPrompt(prompt_id, text=row["text"])]
        raise KeyError("no messages/conversations/data/prompt/text field")
    replies = [i for i, (role, _) in enumerate(turns) if role == "assistant"]
    if not replies:
        return [RawPrompt(prompt_id, messages=tuple(turns))]
    return [RawPrompt(f"{prompt_id}:{i}", messages=tuple(turns[:i])) for i in replies if i > 0]


# ----------------------------------------------------------------------------- sources
def _jsonl_rows(path: Path, stats: PromptStats) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path.name}:{lineno}", json.loads(line)
            except json.JSONDecodeError as err:
                stats.note_malformed(f"{path}:{lineno}: malformed JSON ({err.msg})")


def _file_rows(path: Path, stats: PromptStats) -> Iterator[tuple[str, Any]]:
    if not path.is_file():
        raise PromptError(f"data.prompt_source: '{path}' is not a file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path.name}:{i}", row
    elif path.suffix in (".jsonl", ".json"):
        yield from _jsonl_rows(path, stats)
    else:
        raise PromptError(f"data.prompt_source: '{path}' is not .jsonl/.json/.parquet")


def _hf_rows(spec: str) -> Iterator[tuple[str, Any]]:
    name, _, split = spec.partition(":")
    split = split or "train"
    import datasets

    try:
        if Path(name).is_dir():
            ds = datasets.load_from_disk(name)
            ds = ds[split] if isinstance(ds, datasets.DatasetDict) else ds
        else:
            ds = datasets.load_dataset(name, split=split)
    except Exception as err:  # noqa: BLE001 -- datasets raises many types; report one line
        raise PromptError(f"data.prompt_source: cannot load dataset 'hf:{spec}': {str(err).splitlines()[0]}") from None
    for i, row in enumerate(ds):
        yield f"{Path(name).name}:{i}", row


def spread(items: list[Any], n: int) -> list[Any]:
    """``n`` items evenly spaced over ``items`` (all of them if fewer)."""
    if n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


WINDOW_LINES = 40  # lines of a document window (training and eval prompts alike)


def doc_window(text: str, key: str, lines: int = WINDOW_LINES) -> str:
    """A deterministic ``lines``-line window of a document, starting at a line chosen by ``key``'s hash."""
    rows = text.splitlines(keepends=True)
    start = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % max(1, len(rows) - lines)
    return "".join(rows[start:start + lines])


def _text_prompts(docs: list[dict[str, Any]], n: int, max_tokens: int) -> list[RawPrompt]:
    """``n`` document windows: documents spread evenly, several windows each if there are few."""
    out = []
    for j in range(n if docs else 0):
        d = docs[(j * max(1, len(docs) // n)) % len(docs)] if n < len(docs) else docs[j % len(docs)]
        w = j // len(docs) if n >= len(docs) else 0
        pid = f"text:{d['source']}/{d['name']}@{w}"
        out.append(RawPrompt(pid, text=doc_window(d["text"], pid), max_tokens=max_tokens))
    return out


# What an instruction prompt asks of a passage, per corpus source; one chosen per passage by hash.
INSTRUCTIONS: dict[str, tuple[str, ...]] = {
    "python_stdlib": ("Explain what the following Python code does.\n\n```python\n{passage}```",
                      "Summarise the purpose of this Python code in a few sentences.\n\n```python\n{passage}```",
                      "Continue this Python code.\n\n```python\n{passage}```"),
    "shakespeare": ("Summarise this passage from Shakespeare in plain modern English.\n\n{passage}",
                    "Explain what is happening in this passage.\n\n{passage}",
                    "Continue this passage in the same style.\n\n{passage}"),
}
GENERIC_INSTRUCTIONS = ("Summarise the following passage.\n\n{passage}", "Explain the following passage.\n\n{passage}")
KINDS = ("chat", "instruct", "text")


def _pick(key: str, options: tuple[str, ...]) -> str:
    return options[int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % len(options)]


def _instruct_prompts(docs: list[dict[str, Any]], n: int, max_tokens: int, tokenizer: Any) -> list[RawPrompt]:
    """``n`` chat turns, each an instruction around a passage of ≤ ``max_tokens`` tokens (cut at a line end)."""
    out = []
    for raw in _text_prompts(docs, n, max_tokens):
        ids = tokenizer(raw.text or "", add_special_tokens=False)["input_ids"][:max_tokens]
        passage = tokenizer.decode(ids)
        if "\n" in passage.rstrip("\n"):
            passage = passage[: passage.rstrip("\n").rindex("\n") + 1]  # whole lines only
        source = raw.prompt_id.removeprefix("text:").split("/", 1)[0]
        template = _pick(raw.prompt_id, INSTRUCTIONS.get(source, GENERIC_INSTRUCTIONS))
        out.append(RawPrompt(raw.prompt_id.replace("text:", "instruct:", 1),
                             messages=(("user", template.format(passage=passage)),)))
    return out


def embedded_prompts(target_dir: Path, cfg: DataConfig, tokenizer: Any) -> Iterator[RawPrompt]:
    """Chat turns, instructions on passages and document prefixes of the training split, interleaved."""
    kinds = list(cfg.embedded_kinds)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        raise PromptError(f"data.embedded_kinds: {kinds} must be a non-empty subset of {list(KINDS)}")
    per_kind = cfg.max_prompts * 2 // len(kinds) + 1  # spare candidates for skipped prompts
    docs = [json.loads(x) for x in (target_dir / "corpus" / "train.jsonl").read_text().splitlines() if x]
    lists: list[list[RawPrompt]] = []
    for kind in kinds:
        if kind == "chat":
            rows = [json.loads(x) for x in (target_dir / "chat" / "train.jsonl").read_text().splitlines() if x]
            chosen = spread(list(enumerate(rows)), per_kind)
            lists.append([p for i, r in chosen for p in row_prompts(r, f"chat:{i}")[:1]])
        elif kind == "instruct":
            lists.append(_instruct_prompts(docs, per_kind, cfg.instruct_passage_tokens, tokenizer))
        else:
            lists.append(_text_prompts(docs, per_kind, cfg.text_prompt_tokens))
    for group in itertools.zip_longest(*lists):  # interleaved; a kind with no rows just ends early
        yield from (p for p in group if p is not None)


def raw_prompts(cfg: DataConfig, target_dir: Path | None, stats: PromptStats,
                tokenizer: Any = None) -> Iterator[RawPrompt]:
    """The configured source's candidate prompts, in a stable order."""
    source = cfg.prompt_source
    if source == "embedded":
        if target_dir is None or not (target_dir / "chat" / "train.jsonl").is_file():
            raise PromptError("data.prompt_source=embedded needs a built-in target (embedded or tiny: "
                              "their chat/ and corpus/ splits); give a prompt file or 'hf:<dataset>' for other targets")
        yield from embedded_prompts(target_dir, cfg, tokenizer)
        return
    rows = _hf_rows(source[3:]) if source.startswith("hf:") else _file_rows(Path(source), stats)
    for where, row in rows:
        try:
            yield from row_prompts(row, where)
        except (KeyError, TypeError, ValueError) as err:
            stats.note_malformed(f"{where}: not a prompt row ({err})")


# ----------------------------------------------------------------------------- tokenization
def prompt_seed(base_seed: int, prompt_id: str) -> int:
    digest = hashlib.sha256(f"{base_seed}/{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & 0x7FFF_FFFF_FFFF_FFFF


def encode(raw: RawPrompt, tokenizer: Any) -> list[int]:
    """Token ids of a prompt: chat turns with the template and a generation prompt, or text."""
    if raw.messages is not None:
        if not any(content.strip() for _, content in raw.messages):
            return []
        chat = [{"role": r, "content": c} for r, c in raw.messages]
        rendered = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    text = raw.text or ""
    if not text.strip():
        return []
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if raw.max_tokens is not None:
        ids = ids[: raw.max_tokens]
    return document_start(tokenizer) + ids


CHAT_TURN_OPENERS = ("<|im_start|>",)  # a bos that opens a chat turn (ChatML) does not start a document


def document_start(tokenizer: Any) -> list[int]:
    """What precedes a raw-text prompt: the tokenizer's bos, unless that bos opens a chat turn
    (SmolLM2's is ``<|im_start|>``: its documents start bare, as its tokenizer encodes them)."""
    bos = tokenizer.bos_token_id
    return [] if bos is None or tokenizer.bos_token in CHAT_TURN_OPENERS else [int(bos)]


def collect_prompts(cfg: DataConfig, tokenizer: Any, target_dir: Path | None) -> tuple[list[Prompt], PromptStats]:
    """Up to ``max_prompts`` tokenized prompts within the length limits, plus what was skipped."""
    stats = PromptStats()
    prompts: list[Prompt] = []
    seen: set[str] = set()
    for raw in raw_prompts(cfg, target_dir, stats, tokenizer):
        if len(prompts) >= cfg.max_prompts:
            break
        stats.read += 1
        ids = encode(raw, tokenizer)
        if len(ids) < max(1, cfg.min_prompt_tokens):
            stats.empty += 1
        elif len(ids) > cfg.max_prompt_tokens:
            stats.too_long += 1
        elif raw.prompt_id not in seen:
            seen.add(raw.prompt_id)
            prompts.append(Prompt(raw.prompt_id, tuple(ids), prompt_seed(cfg.seed, raw.prompt_id)))
    stats.used = len(prompts)
    return prompts, stats
