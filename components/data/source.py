"""What the data stage needs to know about the target without loading its weights.

Resolves the target path (building the embedded default if needed), reads its config and
tokenizer into a :class:`TargetDescription`, and derives the :class:`RecordMeta` that every
record of this run carries: the drafter's layer ids (``drafter.layer_ids``, or its family's
default for this depth), the last layer, hidden size and storage dtype. Knows configs and
tokenizers; nothing about Ray or model weights.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.config import ConfigError, DataConfig, SpeclineConfig, TargetConfig
from components.data.records import STORAGE_DTYPES, RecordMeta
from components.drafters import TargetInfo
from components.drafters.registry import resolve_layer_ids


class DataConfigError(ConfigError):
    """A data-stage setting is invalid; the message names the field."""


@dataclass
class TargetDescription:
    """The target as its files describe it: enough to plan and check records, no weights loaded."""

    target_cfg: TargetConfig  # name_or_path resolved to a directory or hub id
    tokenizer: Any  # the target's HF tokenizer
    info: TargetInfo  # name, tokenizer hash, sizes and depth (drafters.base)
    corpus_dir: Path | None  # the embedded target's directory (chat/ and corpus/ splits)


def describe_target(cfg: SpeclineConfig, target_path: str | None = None) -> TargetDescription:
    from transformers import AutoConfig, AutoTokenizer

    from components.target.hf import resolve_target_path
    from components.target.tokenizer import tokenizer_hash

    path = target_path or resolve_target_path(cfg.target, progress=True)
    kw = {"revision": cfg.target.revision, "trust_remote_code": cfg.target.trust_remote_code}
    tokenizer = AutoTokenizer.from_pretrained(path, **kw)
    hf_cfg = AutoConfig.from_pretrained(path, **kw)
    hf_cfg = getattr(hf_cfg, "text_config", None) or hf_cfg
    local = Path(path)
    info = TargetInfo(path, tokenizer_hash(tokenizer), int(hf_cfg.hidden_size), int(hf_cfg.vocab_size),
                      int(hf_cfg.num_hidden_layers))
    return TargetDescription(dataclasses.replace(cfg.target, name_or_path=path), tokenizer, info,
                             local if (local / "chat").is_dir() else None)


def check_data_config(cfg: DataConfig) -> None:
    checks = [("mode", cfg.mode, ("shards", "stream")), ("storage", cfg.storage, tuple(STORAGE_DTYPES)),
              ("format", cfg.format, ("parquet", "safetensors")), ("backend", cfg.backend, ("transformers", "vllm"))]
    for name, value, allowed in checks:
        if value not in allowed:
            raise DataConfigError(f"data.{name}: '{value}' is not one of {list(allowed)}")
    for name in ("max_prompts", "max_new_tokens", "batch_size", "num_actors", "shard_size"):
        if getattr(cfg, name) < 1:
            raise DataConfigError(f"data.{name}: must be at least 1 (got {getattr(cfg, name)})")


def record_meta(cfg: SpeclineConfig, desc: TargetDescription) -> RecordMeta:
    """The meta of this run's records (after checking ``cfg.data``)."""
    check_data_config(cfg.data)
    return RecordMeta.of(desc.info, resolve_layer_ids(cfg.drafter, desc.info.num_layers), cfg.data.storage)


def generation_params(cfg: DataConfig) -> dict[str, Any]:
    return {"backend": cfg.backend, "max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature,
            "top_p": cfg.top_p, "seed": cfg.seed, "batch_size": cfg.batch_size}
