"""Build (once) and cache the embedded default target: corpus → BPE tokenizer → pretrained LM.

The result is an ordinary HF checkpoint directory (config.json, model.safetensors, tokenizer
files, generation_config.json) that transformers and vLLM load like any model, plus:

- ``specline_target.json``: build info (config, corpus fingerprint, token counts, quality
  metrics, build time, a sampled text);
- ``corpus/{train,heldout}.jsonl`` and ``chat/{train,heldout}.jsonl``: the corpus splits, so
  later stages draw training prompts from the train split and evaluate on the held-out one.

The directory name is keyed by a hash of the tiny-target config and the builder version; a
build writes into a temporary sibling and renames it into place, so an interrupted build never
leaves a half-written target behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast

from components.config import TargetConfig, TinyTargetConfig
from components.target import corpus as corpus_mod
from components.target import pretrain, quality
from components.target.tokenizer import stop_token_ids, tokenizer_hash, train_tokenizer

BUILDER_VERSION = 1
INFO_FILE = "specline_target.json"


def cache_key(cfg: TinyTargetConfig) -> str:
    blob = json.dumps({"builder": BUILDER_VERSION, **asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def tiny_target_dir(cfg: TargetConfig) -> Path:
    return Path(cfg.cache_dir) / f"tiny-{cache_key(cfg.tiny)}"


def read_info(path: Path) -> dict[str, Any]:
    return json.loads((path / INFO_FILE).read_text())


def ensure_tiny_target(cfg: TargetConfig, progress: bool = True) -> tuple[Path, dict[str, Any], bool]:
    """(checkpoint dir, build info, built_now). Builds only when no cached build exists."""
    dest = tiny_target_dir(cfg)
    if (dest / INFO_FILE).is_file():
        return dest, read_info(dest), False
    corpus_cache = corpus_mod.corpus_cache(cfg.cache_dir)
    tmp = dest.with_name(f"{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        info = build_tiny_target(cfg.tiny, tmp, corpus_cache, progress)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process finished the same build first: keep theirs
            if not (dest / INFO_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest, info, True


# ----------------------------------------------------------------------------- build steps
def _encode_docs(tok: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """Documents → one packed stream [T]: <bos> doc <eos> <bos> doc <eos> ..."""
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    bos, eos = tok.bos_token_id, tok.eos_token_id
    flat = [t for seq in ids for t in [bos, *seq, eos]]
    return torch.tensor(flat, dtype=torch.long)


def _render_chats(tok: PreTrainedTokenizerFast, convs: list[list[dict[str, str]]]) -> list[str]:
    """Conversations rendered with the chat template (the stream adds bos/eos itself)."""
    return [tok.apply_chat_template(c, tokenize=False).removeprefix(tok.bos_token) for c in convs]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _save_splits(dest: Path, train: list, heldout: list, convs: dict[str, list]) -> None:
    for split, docs in (("train", train), ("heldout", heldout)):
        _write_jsonl(dest / "corpus" / f"{split}.jsonl", [asdict(d) for d in docs])
        _write_jsonl(dest / "chat" / f"{split}.jsonl", [{"messages": c} for c in convs[split]])


def _evaluate(model: torch.nn.Module, tok: PreTrainedTokenizerFast, cfg: TinyTargetConfig,
              train_stream: torch.Tensor, heldout: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Held-out perplexity (all and per source), unigram baseline, distinct-4 of samples."""
    per_source = max(cfg.seq_len + 1, cfg.eval_tokens // max(1, len(heldout)))
    capped = {s: t[:per_source] for s, t in heldout.items()}
    all_heldout = torch.cat(list(capped.values()))
    metrics: dict[str, Any] = {
        "heldout_perplexity": quality.perplexity(model, all_heldout, cfg.seq_len),
        "unigram_perplexity": quality.unigram_perplexity(train_stream, all_heldout, len(tok), cfg.seq_len),
        "heldout_tokens_scored": int(all_heldout.numel()),
    }
    for source, stream in capped.items():
        metrics[f"heldout_perplexity_{source}"] = quality.perplexity(model, stream, cfg.seq_len)
    gen = torch.Generator().manual_seed(cfg.seed)
    prompts = pretrain.sample_windows(all_heldout, cfg.sample_count, 31, gen)  # [n, 32]
    metrics["distinct4_sampled"] = quality.mean_distinct_4(model, prompts, cfg.sample_new_tokens, 1.0, cfg.seed)
    metrics["distinct4_greedy"] = quality.mean_distinct_4(model, prompts, cfg.sample_new_tokens, 0.0, cfg.seed)
    sample = quality.sample_continuations(model, prompts[:1], cfg.sample_new_tokens, 1.0, cfg.seed)
    metrics["sample_text"] = tok.decode(torch.cat([prompts[0], sample[0]]), skip_special_tokens=False)
    return metrics


def build_tiny_target(cfg: TinyTargetConfig, dest: Path, corpus_cache: Path,
                      progress: bool = True) -> dict[str, Any]:
    """Builds the tiny target into ``dest`` (a fresh directory) and returns its build info."""
    t0 = time.perf_counter()
    torch.set_num_threads(cfg.num_threads or max(1, os.cpu_count() or 1))
    docs = corpus_mod.load_documents(cfg.corpus_sources, cfg.corpus_max_chars, corpus_cache)
    train, heldout = corpus_mod.split_documents(docs, cfg.heldout_fraction)
    convs = {
        "train": [c for d in train if d.source == "shakespeare" for c in corpus_mod.conversations(d)],
        "heldout": [c for d in heldout if d.source == "shakespeare" for c in corpus_mod.conversations(d)],
    }
    tok = train_tokenizer((d.text for d in train), cfg.vocab_size)
    train_stream = _encode_docs(tok, [d.text for d in train] + _render_chats(tok, convs["train"]))
    heldout_streams = {
        s: _encode_docs(tok, [d.text for d in heldout if d.source == s])
        for s in sorted({d.source for d in heldout})
    }
    special = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    model = pretrain.init_model(pretrain.model_config(cfg, len(tok), special), cfg.seed)
    stats = pretrain.pretrain(model, train_stream, cfg, progress=progress)
    metrics = _evaluate(model, tok, cfg, train_stream, heldout_streams)

    dest.mkdir(parents=True, exist_ok=False)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=stop_token_ids(tok), pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    _save_splits(dest, train, heldout, convs)
    info = {
        "builder_version": BUILDER_VERSION,
        "cache_key": cache_key(cfg),
        "config": asdict(cfg),
        "parameters": sum(p.numel() for p in model.parameters()),
        "tokenizer_hash": tokenizer_hash(tok),
        "corpus_fingerprint": corpus_mod.corpus_fingerprint(docs),
        "documents": {"train": len(train), "heldout": len(heldout)},
        "conversations": {k: len(v) for k, v in convs.items()},
        "tokens": {"train": int(train_stream.numel()), "heldout": sum(int(t.numel()) for t in heldout_streams.values())},
        "pretrain": asdict(stats),
        "metrics": metrics,
        "build_seconds": time.perf_counter() - t0,
    }
    (dest / INFO_FILE).write_text(json.dumps(info, indent=2))
    return info
