import dataclasses
import json
import math

import pytest
import torch

from components.target import pretrain, quality
from components.target.tiny import INFO_FILE, cache_key, ensure_tiny_target, tiny_target_dir
from tests.conftest import FIXTURE_TINY


def test_build_writes_a_complete_checkpoint_with_metrics(tiny_target_build):
    path, info = tiny_target_build
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", INFO_FILE,
                 "corpus/train.jsonl", "corpus/heldout.jsonl"):
        assert (path / name).is_file(), name
    m = info["metrics"]
    # training did something: held-out perplexity far below a uniform guess over the vocabulary
    # (V; an untrained model sits near it). The margin is wide on purpose: how far below the
    # unigram baseline a 120-step fixture lands depends on the CPU it trained on.
    vocab = FIXTURE_TINY.vocab_size
    assert 1.0 < m["heldout_perplexity"] < 0.5 * vocab and 1.0 < m["unigram_perplexity"] < vocab
    assert 0.0 <= m["distinct4_sampled"] <= 1.0 and 0.0 <= m["distinct4_greedy"] <= 1.0
    train_names = {json.loads(line)["name"] for line in (path / "corpus/train.jsonl").open()}
    heldout_names = {json.loads(line)["name"] for line in (path / "corpus/heldout.jsonl").open()}
    assert heldout_names and train_names.isdisjoint(heldout_names)


def test_second_call_hits_the_cache(tiny_target_cfg, tiny_target_build):
    path, info = tiny_target_build
    again, info2, built_now = ensure_tiny_target(tiny_target_cfg, progress=False)
    assert again == path and not built_now and info2["cache_key"] == info["cache_key"]


def test_cache_key_follows_the_config(tiny_target_cfg):
    other = dataclasses.replace(tiny_target_cfg.tiny, num_layers=3)
    assert cache_key(other) != cache_key(tiny_target_cfg.tiny)


def test_a_crash_mid_build_leaves_nothing_behind(tiny_target_cfg, monkeypatch):
    cfg = dataclasses.replace(tiny_target_cfg, tiny=dataclasses.replace(tiny_target_cfg.tiny, seed=123))
    dest = tiny_target_dir(cfg)

    def boom(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(pretrain, "pretrain", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        ensure_tiny_target(cfg, progress=False)
    assert not dest.exists()
    assert not list(dest.parent.glob(dest.name + ".tmp-*"))


def test_distinct_n_and_unigram_baseline():
    assert quality.distinct_n([1, 2, 3, 4, 5, 6]) == 1.0
    assert quality.distinct_n([7] * 10) == pytest.approx(1 / 7)
    train = torch.tensor([0, 0, 0, 1])  # add-one: p(0)=4/7, p(1)=2/7, p(2)=1/7
    heldout = torch.tensor([0, 1, 2])  # one window of 2: targets scored are 1, 2
    ppl = quality.unigram_perplexity(train, heldout, vocab_size=3, seq_len=2)
    assert ppl == pytest.approx(math.exp(-(math.log(2 / 7) + math.log(1 / 7)) / 2))


def test_lr_schedule_warms_up_then_decays():
    cfg = dataclasses.replace(pretrain.TinyTargetConfig(), lr=1.0, warmup_steps=10, train_steps=110)
    assert pretrain.lr_at(0, cfg) == pytest.approx(0.1)
    assert pretrain.lr_at(9, cfg) == pytest.approx(1.0)
    assert pretrain.lr_at(110, cfg) == pytest.approx(0.1)
