"""Evaluation prompts come from the held-out split, never from the documents drafters train on."""

from __future__ import annotations

import json

import pytest

from components.config import ConfigError, DataConfig, EvalConfig
from components.data.prompts import collect_prompts
from components.evaluation import eval_prompts


def _names(path) -> set[str]:
    return {json.loads(line)["name"] for line in path.read_text().splitlines() if line}


def test_embedded_prompts_are_heldout_documents(tiny_target, tiny_target_build):
    target_dir = tiny_target_build[0]
    prompts = eval_prompts(EvalConfig(num_prompts=6, text_prompt_tokens=20), tiny_target.tokenizer, target_dir)
    heldout, train = _names(target_dir / "corpus" / "heldout.jsonl"), _names(target_dir / "corpus" / "train.jsonl")
    assert len(prompts) == 6 and not heldout & train
    docs = {p.prompt_id.split("/", 1)[1].rsplit("@", 1)[0] for p in prompts}
    assert docs <= heldout
    assert all(1 <= len(p.input_ids) <= 21 for p in prompts)  # bos + 20 tokens
    training_prompts, _ = collect_prompts(DataConfig(max_prompts=32), tiny_target.tokenizer, target_dir)
    assert not {p.input_ids for p in prompts} & {p.input_ids for p in training_prompts}
    again = eval_prompts(EvalConfig(num_prompts=6, text_prompt_tokens=20), tiny_target.tokenizer, target_dir)
    assert again == prompts  # deterministic


def test_embedded_source_needs_the_embedded_target(tiny_target, tmp_path):
    with pytest.raises(ConfigError, match="eval.prompt_source"):
        eval_prompts(EvalConfig(), tiny_target.tokenizer, tmp_path)


def test_a_prompt_file_is_read_like_the_data_stage_does(tiny_target, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"question {i}"}) for i in range(5)))
    prompts = eval_prompts(EvalConfig(prompt_source=str(path), num_prompts=3), tiny_target.tokenizer, None)
    assert len(prompts) == 3
