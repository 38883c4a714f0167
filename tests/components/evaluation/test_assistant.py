"""The embedded target's assistant LM: built once from the training split with the target's own
tokenizer, cached, and refused when a tokenizer differs."""

from __future__ import annotations

import json

import pytest

from components.config import ConfigError, EvalConfig
from components.evaluation.assistant import (
    INFO_FILE,
    assistant_tiny_config,
    ensure_embedded_assistant,
    load_assistant,
)

SMALL = EvalConfig(assistant_layers=1, assistant_hidden_size=32, assistant_train_steps=3)


def test_assistant_config_keeps_the_corpus_and_shrinks_the_model(tiny_target_cfg):
    cfg = assistant_tiny_config(tiny_target_cfg.tiny, EvalConfig())
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (2, 128, 2, 1)
    assert cfg.vocab_size == tiny_target_cfg.tiny.vocab_size and cfg.seq_len == tiny_target_cfg.tiny.seq_len


def test_embedded_assistant_is_built_once_with_the_target_tokenizer(tiny_target, tiny_target_cfg,
                                                                    tiny_target_build, tmp_path):
    path = ensure_embedded_assistant(tiny_target_build[0], tiny_target_cfg.tiny, SMALL, tmp_path, progress=False)
    info = json.loads((path / INFO_FILE).read_text())
    assert info["tokenizer_hash"] == tiny_target.tokenizer_hash and info["config"]["num_layers"] == 1
    model = load_assistant(str(path), tiny_target)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    mtime = (path / INFO_FILE).stat().st_mtime
    assert ensure_embedded_assistant(tiny_target_build[0], tiny_target_cfg.tiny, SMALL, tmp_path,
                                     progress=False) == path
    assert (path / INFO_FILE).stat().st_mtime == mtime  # cached, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary leftovers


def test_other_tokenizer_or_no_corpus_is_refused(tiny_target, tiny_target_cfg, tmp_path):
    with pytest.raises(ConfigError, match="eval.assistant"):
        ensure_embedded_assistant(tmp_path, tiny_target_cfg.tiny, SMALL, tmp_path / "cache")
    tok = tiny_target.tokenizer
    tok.save_pretrained(tmp_path / "tok")
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tmp_path / "tok")
    other.add_tokens(["<|extra|>"])
    tiny_target.model.save_pretrained(tmp_path / "model")
    other.save_pretrained(tmp_path / "model")
    with pytest.raises(ConfigError, match="another tokenizer"):
        load_assistant(str(tmp_path / "model"), tiny_target)
