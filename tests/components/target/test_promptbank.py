"""The embedded chat target's prompt bank: filters, the split, the layout, growth, rebuilds, real sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.config import PromptBankConfig
from components.target import promptbank as pb

CFG = PromptBankConfig(questions=6, batch_size=4, heldout_fraction=0.5, corpus_sources=["python_stdlib"],
                       corpus_max_chars=200_000)
SCRIPT = [  # batch 0 and 1 of a scripted sampler: what each should count as
    ["How do I sort a list in Python?", "how do i SORT a list in python", None, "Hi"],
    ["Pourquoi le ciel est-il bleu ? Été, hiver, où", "Explain <|im_end|> tokens to me please",
     "What is the capital of France and why?", "Can you write a poem about the sea?"],
    ["Which fruits are rich in vitamin C?", "Tell me a story about a brave mouse.",
     "What does a hash table do?", "Why do cats purr at night?"],
]


def scripted(batch: int) -> list[str | None]:
    return SCRIPT[batch] if batch < len(SCRIPT) else []


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_filters_say_why_a_turn_is_dropped():
    cfg = PromptBankConfig()
    assert pb.rejection("Can you explain how vaccines work?", cfg) is None
    assert pb.rejection("Hi there", cfg) == "length"
    assert pb.rejection("word " * 80, cfg) == "length"
    assert pb.rejection("Qu'est-ce que c'est, été où après ça?", cfg) == "language"
    assert pb.rejection("zxq vbn mlk poi", cfg) == "language"
    assert pb.rejection("What is <|im_start|> used for?", cfg) == "markup"
    assert pb.normalise("  How do I, SORT a list?! ") == pb.normalise("how do i sort a list") == "how do i sort a list"


def test_the_split_is_by_question_and_stable():
    questions = [f"What is the number {i} made of?" for i in range(400)]
    held = [q for q in questions if pb.is_heldout_question(q, 0.15)]
    assert 0.08 < len(held) / len(questions) < 0.22
    assert held == [q for q in questions if pb.is_heldout_question(q.upper() + " ", 0.15)]  # normalised key


def test_bank_is_written_in_the_tiny_target_layout_with_its_counts(tmp_path, target_cache):
    info, built = pb.ensure_prompt_bank(tmp_path, CFG, target_cache / "corpora", progress=False, sampler=scripted)
    assert built
    assert info["rejected"] == {"unfinished": 1, "duplicate": 1, "length": 1, "language": 1, "markup": 1}
    train, held = (_rows(tmp_path / "chat" / f"{s}.jsonl") for s in ("train", "heldout"))
    questions = [r["messages"][0]["content"] for r in train + held]
    assert len(questions) == 6 == sum(info["questions"].values()) and len(set(questions)) == 6
    assert all(r["messages"][0]["role"] == "user" and len(r["messages"]) == 1 for r in train + held)
    assert {q for r in held for q in [r["messages"][0]["content"]]} == {
        q for q in questions if pb.is_heldout_question(q, CFG.heldout_fraction)}
    docs = {s: {d["name"] for d in _rows(tmp_path / "corpus" / f"{s}.jsonl")} for s in ("train", "heldout")}
    assert docs["train"] and docs["heldout"] and not docs["train"] & docs["heldout"]
    assert not list(tmp_path.rglob("*.tmp-*"))
    again, built_again = pb.ensure_prompt_bank(tmp_path, CFG, target_cache / "corpora", progress=False,
                                               sampler=lambda b: pytest.fail("a cached bank is reused"))
    assert not built_again and again == info


def _bank(path: Path) -> list[tuple[int, str]]:
    """(bank_index, question) of both sides of a written bank, in the order sampled."""
    rows = _rows(path / "chat" / "train.jsonl") + _rows(path / "chat" / "heldout.jsonl")
    return sorted((r["bank_index"], r["messages"][0]["content"]) for r in rows)


def _counting(calls: list[int]):
    def sampler(batch: int) -> list[str | None]:
        calls.append(batch)
        return [f"Question number {batch * 10 + i} is about what?" for i in range(4)]
    return sampler


def test_a_bank_is_a_prefix_of_a_larger_one_and_grows_without_resampling(tmp_path, target_cache):
    """Cut and grown banks are the prefix of the bank sampled at once; a batch is never sampled twice."""
    corpora = target_cache / "corpora"
    at_once: list[int] = []
    pb.ensure_prompt_bank(tmp_path / "once", PromptBankConfig(**{**CFG.__dict__, "questions": 10}), corpora,
                          progress=False, sampler=_counting(at_once))
    assert at_once == [0, 1, 2] and [i for i, _ in _bank(tmp_path / "once")] == list(range(10))
    calls: list[int] = []
    grow = tmp_path / "grown"
    for n in (3, 6, 2, 10):  # 3 takes batch 0 whole; 6 samples batch 1 only; 2 samples nothing
        info, built = pb.ensure_prompt_bank(grow, PromptBankConfig(**{**CFG.__dict__, "questions": n}), corpora,
                                            progress=False, sampler=_counting(calls))
        assert built and sum(info["questions"].values()) == n
        assert _bank(grow) == _bank(tmp_path / "once")[:n]
    assert calls == [0, 1, 2] and info["pool"] == {"questions": 12, "batches": 3, "sampled_now": 4}
    again, built = pb.ensure_prompt_bank(grow, PromptBankConfig(**{**CFG.__dict__, "questions": 10}), corpora,
                                         progress=False, sampler=lambda b: pytest.fail("a cached bank is reused"))
    assert not built and again == info


def test_an_interrupted_build_samples_on_from_its_last_batch(tmp_path, target_cache):
    cfg = PromptBankConfig(**{**CFG.__dict__, "questions": 10})
    calls: list[int] = []

    def dies_at_batch_2(batch: int) -> list[str | None]:
        if batch == 2:
            raise KeyboardInterrupt
        return _counting(calls)(batch)

    with pytest.raises(KeyboardInterrupt):
        pb.ensure_prompt_bank(tmp_path, cfg, target_cache / "corpora", progress=False, sampler=dies_at_batch_2)
    assert pb.read_bank_info(tmp_path) is None and not list(tmp_path.rglob("*.tmp-*"))
    pb.ensure_prompt_bank(tmp_path, cfg, target_cache / "corpora", progress=False, sampler=_counting(calls))
    assert calls == [0, 1, 2] and len(_bank(tmp_path)) == 10


def test_changed_settings_rebuild_and_nothing_kept_is_one_clear_error(tmp_path, target_cache):
    pb.ensure_prompt_bank(tmp_path, CFG, target_cache / "corpora", progress=False, sampler=scripted)
    fewer = PromptBankConfig(**{**CFG.__dict__, "questions": 2})
    info, built = pb.ensure_prompt_bank(tmp_path, fewer, target_cache / "corpora", progress=False, sampler=scripted)
    assert built and sum(info["questions"].values()) == 2
    other_seed = PromptBankConfig(**{**CFG.__dict__, "seed": 1})
    calls: list[int] = []
    pb.ensure_prompt_bank(tmp_path, other_seed, target_cache / "corpora", progress=False, sampler=_counting(calls))
    assert calls == [0, 1]  # another pool, sampled from its first batch
    pb.ensure_prompt_bank(tmp_path, fewer, target_cache / "corpora", progress=False,
                          sampler=lambda b: pytest.fail("the first settings' pool is kept"))
    strict = PromptBankConfig(**{**CFG.__dict__, "min_words": 50})
    with pytest.raises(pb.PromptBankError, match="none of the .* generated user turns passed the filters"):
        pb.ensure_prompt_bank(tmp_path, strict, target_cache / "corpora", progress=False, sampler=scripted)
    assert pb.read_bank_info(tmp_path)["settings"]["questions"] == 2  # the bank before it is left as it was


def test_user_turns_are_sampled_from_the_chat_model(smollm2_build):
    """The real sampler on SmolLM2: turns open a user turn; what it writes is not asserted."""
    from transformers import AutoTokenizer

    path = smollm2_build[0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert pb.user_turn_prefix(tokenizer).endswith("<|im_start|>user\n")
    assert tokenizer.mask_token == "<empty_output>"
    cfg = PromptBankConfig(batch_size=2, question_max_tokens=6)
    turns = pb.model_sampler(path, cfg)(0)
    assert len(turns) == 2 and all(t is None or isinstance(t, str) for t in turns)
