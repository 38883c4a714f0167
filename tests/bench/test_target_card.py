"""The target card's quality measurements run on the fixture target (the card itself is a
benchmark of SmolLM2 and is not run here); its windows and tables are checked directly."""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

import torch

from tests.bench.benches import load_bench

card = load_bench("target_card")


def test_spaced_windows_spread_evenly_and_never_overlap():
    stream = torch.arange(100)
    windows = card.spaced_windows(stream, count=5, window=9)
    assert [w[0].item() for w in windows] == [0, 20, 40, 60, 80]
    assert all(w.numel() == 10 for w in windows)
    assert len(card.spaced_windows(stream, count=50, window=9)) == 10  # no more than fit apart
    assert card.spaced_windows(stream[:9], count=1, window=9) == []


def test_markdown_table_escapes_pipes_and_aligns_numbers():
    table = card.markdown_table(["what", "n"], [["a|b", "1"]])
    assert table.splitlines() == ["| what | n |", "|:---|---:|", "| a\\|b | 1 |"]


def test_quality_on_the_fixture_target(tiny_target, tiny_target_build, tmp_path):
    path, _ = tiny_target_build
    (tmp_path / "corpus").mkdir()  # the fixture's held-out documents; its corpus has no chats
    shutil.copy(Path(path) / "corpus" / "heldout.jsonl", tmp_path / "corpus" / "heldout.jsonl")
    (tmp_path / "chat").mkdir()
    rows = [{"messages": [{"role": "user", "content": q}]} for q in ("What does os.path do?", "Why?", "How?")]
    (tmp_path / "chat" / "heldout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(eval_tokens=512, eval_window=64, chat_prompts=2, new_tokens_quality=12, seed=0)
    q = card.measure_quality(tiny_target, tmp_path, args)
    per_source = {s: p for s, (p, _) in q.perplexity.items() if s != "all"}
    overall, tokens = q.perplexity["all"]
    assert per_source and tokens == sum(n for s, (_, n) in q.perplexity.items() if s != "all") <= 512
    assert 1.0 < min(per_source.values()) <= overall <= max(per_source.values()) < tiny_target.vocab_size
    for r in (q.greedy, q.sampled):
        assert r.count == 2 and 0.0 < r.distinct4 <= 1.0 and 0 <= r.mean_tokens <= 12 and r.capped <= 2
    assert q.questions == ["What does os.path do?", "Why?"] and q.heldout_questions == 3


def test_pooled_perplexity_lies_between_its_sources(tiny_target):
    gen = torch.Generator().manual_seed(0)
    streams = {"a": torch.randint(3, tiny_target.vocab_size, (400,), generator=gen),
               "b": torch.arange(400) % 7 + 3}  # a repeating stream: far easier than random tokens
    ppl = card.heldout_perplexity(tiny_target.model, streams, eval_tokens=256, window=32)
    assert ppl["a"][1] == ppl["b"][1] == 128 and ppl["all"][1] == 256
    expected = math.exp((math.log(ppl["a"][0]) + math.log(ppl["b"][0])) / 2)  # equal token counts
    assert math.isclose(ppl["all"][0], expected, rel_tol=1e-9)
