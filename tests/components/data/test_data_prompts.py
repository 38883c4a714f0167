"""Prompt sources: schemas, the embedded training split only, limits, malformed lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.config import DataConfig
from components.data.prompts import PromptError, collect_prompts, prompt_seed, row_prompts


@pytest.fixture(scope="module")
def tokenizer(tiny_target_build):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_build[0])


def test_chat_schemas_map_to_the_turns_before_each_reply():
    share = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                               {"from": "human", "value": "again"}, {"from": "gpt", "value": "ok"}]}
    ultra = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    old_ultra = {"data": ["hi", "yo"]}
    got = row_prompts(share, "f:1")
    assert [p.prompt_id for p in got] == ["f:1:1", "f:1:3"]
    assert got[1].messages == (("user", "hi"), ("assistant", "yo"), ("user", "again"))
    assert row_prompts(ultra, "u")[0].messages == row_prompts(old_ultra, "u")[0].messages == (("user", "hi"),)
    assert row_prompts({"prompt": "q"}, "p")[0].messages == (("user", "q"),)
    assert row_prompts({"text": "raw"}, "t")[0].text == "raw"


def test_embedded_prompts_come_from_the_training_split_only(tokenizer, tiny_target_build):
    path = Path(tiny_target_build[0])
    heldout = {json.loads(x)["name"] for x in (path / "corpus" / "heldout.jsonl").read_text().splitlines() if x}
    cfg = DataConfig(max_prompts=40, embedded_kinds=["chat", "text"])
    prompts, stats = collect_prompts(cfg, tokenizer, path)
    assert len(prompts) == stats.used == 40 and len({p.prompt_id for p in prompts}) == 40
    names = {p.prompt_id.split("/", 1)[1].rsplit("@", 1)[0] for p in prompts if p.prompt_id.startswith("text:")}
    assert names and not names & heldout
    assert all(len(p.input_ids) <= DataConfig().text_prompt_tokens + 1 for p in prompts)
    again, _ = collect_prompts(cfg, tokenizer, path)
    assert again == prompts  # deterministic, seeds included
    assert prompts[0].seed == prompt_seed(0, prompts[0].prompt_id) != prompt_seed(1, prompts[0].prompt_id)


def test_instruction_prompts_wrap_training_passages_in_a_chat_turn(tokenizer, tiny_target_build):
    from components.data.prompts import GENERIC_INSTRUCTIONS, INSTRUCTIONS

    path = Path(tiny_target_build[0])
    heldout = {json.loads(x)["name"] for x in (path / "corpus" / "heldout.jsonl").read_text().splitlines() if x}
    cfg = DataConfig(max_prompts=12, embedded_kinds=["instruct"], instruct_passage_tokens=32, max_prompt_tokens=512)
    prompts, _ = collect_prompts(cfg, tokenizer, path)
    assert len(prompts) == 12 and all(p.prompt_id.startswith("instruct:") for p in prompts)
    assert not {p.prompt_id.split("/", 1)[1].rsplit("@", 1)[0] for p in prompts} & heldout
    heads = {t.split("\n", 1)[0] for opts in [*INSTRUCTIONS.values(), GENERIC_INSTRUCTIONS] for t in opts}
    for p in prompts:
        text = tokenizer.decode(list(p.input_ids))
        assert text.endswith("<|assistant|>\n") and any(h in text for h in heads)
        body = text.split("\n\n", 1)[1].rsplit("<|end|>", 1)[0].removeprefix("```python\n").removesuffix("```")
        assert len(tokenizer(body, add_special_tokens=False)["input_ids"]) <= 32 + 2  # re-tokenised cut
    mixed, _ = collect_prompts(DataConfig(max_prompts=6), tokenizer, path)  # default: chat + instruct
    chats = (path / "chat" / "train.jsonl").read_text().strip()  # the fixture's corpus has no plays
    assert [p.prompt_id.split(":", 1)[0] for p in mixed] == (["chat", "instruct"] * 3 if chats else ["instruct"] * 6)


def test_bad_rows_are_skipped_counted_and_located(tokenizer, tmp_path, caplog):
    f = tmp_path / "prompts.jsonl"
    rows = [json.dumps({"prompt": "hello there"}), "{not json", json.dumps({"prompt": "   "}),
            json.dumps({"prompt": "word " * 400}), json.dumps({"unknown": 1}),
            json.dumps({"messages": [{"role": "user", "content": "a question"}]})]
    f.write_text("\n".join(rows) + "\n")
    prompts, stats = collect_prompts(DataConfig(prompt_source=str(f), max_prompt_tokens=64), tokenizer, None)
    assert [p.prompt_id for p in prompts] == ["prompts.jsonl:1", "prompts.jsonl:6"]
    assert (stats.empty, stats.too_long, stats.malformed) == (1, 1, 2)
    assert stats.malformed_where[0].startswith(f"{f}:2: malformed JSON")
    assert "prompts.jsonl:5: not a prompt row" in stats.malformed_where[1]
    assert f"{f}:2" in caplog.text


def test_parquet_and_hf_dataset_sources(tokenizer, tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(3)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    from_parquet, _ = collect_prompts(DataConfig(prompt_source=str(tmp_path / "p.parquet")), tokenizer, None)
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    from_hf, _ = collect_prompts(DataConfig(prompt_source=f"hf:{tmp_path / 'ds'}"), tokenizer, None)
    assert len(from_parquet) == len(from_hf) == 3
    assert [p.input_ids for p in from_parquet] == [p.input_ids for p in from_hf]
    assert tokenizer.decode(list(from_hf[0].input_ids)).endswith("<|assistant|>\n")


def test_missing_source_is_one_clear_error(tokenizer, tmp_path):
    with pytest.raises(PromptError, match="nope.jsonl' is not a file"):
        collect_prompts(DataConfig(prompt_source=str(tmp_path / "nope.jsonl")), tokenizer, None)
    with pytest.raises(PromptError, match="needs a built-in target"):
        collect_prompts(DataConfig(), tokenizer, None)
