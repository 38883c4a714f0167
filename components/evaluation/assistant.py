"""The separate small LM that transformers' assisted generation drafts with (``hf_assisted``).

Assisted generation needs an assistant that shares the target's tokenizer. For a real target
that is a smaller member of its family (``eval.assistant=Qwen/Qwen3-0.6B`` for Qwen3-8B). For
the embedded target none exists, so ``eval.assistant=auto`` pretrains one: a Qwen3 with
``eval.assistant_layers`` layers of width ``eval.assistant_hidden_size``, on the embedded
target's *training* split (``corpus/train.jsonl`` documents and ``chat/train.jsonl``
conversations, packed as the target's own pretraining stream is), with the target's tokenizer
copied as is. It is cached beside the target (``assistant-<hash>`` in ``target.cache_dir``,
keyed by the target directory, its tokenizer and the assistant settings) and written to a
temporary directory first, so an interrupted build leaves nothing behind.

Knows HF checkpoints and the embedded target's split files; knows nothing about engines,
drafters or how methods are timed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from components.config import ConfigError, EvalConfig, TinyTargetConfig
from components.io import replace_dir
from components.target import pretrain
from components.target.tokenizer import tokenizer_hash

INFO_FILE = "specline_assistant.json"


def assistant_tiny_config(base: TinyTargetConfig, ev: EvalConfig) -> TinyTargetConfig:
    """The embedded target's pretraining settings, shrunk to the assistant's size and steps."""
    hidden = ev.assistant_hidden_size
    heads = max(1, hidden // 64)
    return dataclasses.replace(
        base, num_layers=ev.assistant_layers, hidden_size=hidden, intermediate_size=3 * hidden,
        num_heads=heads, num_kv_heads=max(1, heads // 2), train_steps=ev.assistant_train_steps,
        warmup_steps=min(base.warmup_steps, max(1, ev.assistant_train_steps // 10)))


def _cache_path(target_dir: Path, cache_dir: Path, tok_hash: str, cfg: TinyTargetConfig) -> Path:
    blob = json.dumps({"target": str(target_dir), "tokenizer": tok_hash, **dataclasses.asdict(cfg)},
                      sort_keys=True)
    return cache_dir / f"assistant-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.is_file() else []


def training_stream(target_dir: Path, tokenizer: Any) -> torch.Tensor:
    """The target's training split as one packed stream [T]: <bos> text <eos> <bos> ...

    Documents first, then the chat conversations rendered with the chat template."""
    texts = [d["text"] for d in _read_jsonl(target_dir / "corpus" / "train.jsonl")]
    for row in _read_jsonl(target_dir / "chat" / "train.jsonl"):
        rendered = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        texts.append(rendered.removeprefix(tokenizer.bos_token or ""))
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return torch.tensor([t for seq in ids for t in [bos, *seq, eos]], dtype=torch.long)


def _build(target_dir: Path, tokenizer: Any, cfg: TinyTargetConfig, dest: Path, progress: bool) -> None:
    """Pretrains the assistant and saves it (HF checkpoint + tokenizer + info) into ``dest``."""
    stream = training_stream(target_dir, tokenizer)
    special = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
    model = pretrain.init_model(pretrain.model_config(cfg, len(tokenizer), special), cfg.seed)
    stats = pretrain.pretrain(model, stream, cfg, progress=progress, what="hf_assisted's assistant")
    target_gen = GenerationConfig.from_pretrained(target_dir)
    model.generation_config = target_gen
    model.save_pretrained(dest, safe_serialization=True)
    tokenizer.save_pretrained(dest)
    info = {"target": str(target_dir), "tokenizer_hash": tokenizer_hash(tokenizer),
            "config": dataclasses.asdict(cfg), "parameters": sum(p.numel() for p in model.parameters()),
            "stream_tokens": int(stream.numel()), "pretrain": dataclasses.asdict(stats)}
    (dest / INFO_FILE).write_text(json.dumps(info, indent=2))


def ensure_embedded_assistant(target_dir: Path, base: TinyTargetConfig, ev: EvalConfig, cache_dir: Path,
                              progress: bool = True) -> Path:
    """The cached assistant for the embedded target at ``target_dir`` (built when missing)."""
    if not (target_dir / "corpus" / "train.jsonl").is_file():
        raise ConfigError(f"eval.assistant: 'auto' builds an assistant only for the embedded target; "
                          f"{target_dir} has no corpus/train.jsonl. Give an HF directory or hub id")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    cfg = assistant_tiny_config(base, ev)
    dest = _cache_path(target_dir, cache_dir, tokenizer_hash(tokenizer), cfg)
    if (dest / INFO_FILE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    threads = torch.get_num_threads()
    try:
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        _build(target_dir, tokenizer, cfg, tmp, progress)
        replace_dir(tmp, dest)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load_assistant(name_or_path: str, target: Any) -> Any:
    """The assistant model on the target's device and dtype; its tokenizer must be the target's."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=target.dtype)
    except (OSError, ValueError) as err:
        raise ConfigError(f"eval.assistant: cannot load '{name_or_path}': {str(err).splitlines()[0]}") from None
    if tokenizer_hash(tokenizer) != target.tokenizer_hash:
        raise ConfigError(f"eval.assistant: '{name_or_path}' has another tokenizer than the target "
                          f"({tokenizer_hash(tokenizer)} vs {target.tokenizer_hash}); assisted "
                          "generation here needs the same tokenizer")
    return model.to(target.device).eval().requires_grad_(False)
