"""Drafter checkpoints: an HF-style directory (config.json + model.safetensors), no pickle.

config.json is flat: every :class:`DrafterConfig` field as resolved (layer ids, mask token id,
sizes...), the layer sizes copied from the target (hidden size, RoPE θ, RMSNorm ε), the layer-id
convention, and the target it was trained for (model id, tokenizer hash, hidden size, vocabulary,
layer count). The shared frozen embedding/LM head are stored only with ``store_shared``. A
draft vocabulary is stored as weights: ``vocab.head.weight`` [DV, H], ``vocab.d2t`` [DV] int64
offsets (target id = draft id + d2t), ``vocab.t2d`` [V] bool.

Loading refuses, with a message that names every difference, a different target (hidden size,
vocabulary, tokenizer hash, layer count), unknown config keys, and missing, unexpected or
misshapen weights (a draft vocabulary whose d2t/t2d/head sizes differ from config.json's
``draft_vocab_size``), and d2t/t2d that disagree. Writes go to a temporary sibling directory
renamed into place.
Knows nothing about training state (optimizer, step): that is the trainer's checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from components.config import DrafterConfig
from components.drafters.base import (
    LAYER_ID_CONVENTION,
    Drafter,
    DrafterError,
    DrafterSpec,
    TargetInfo,
)
from components.drafters.layers import LayerSizes
from components.drafters.registry import build_from_spec
from components.io import write_checkpoint_dir

FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
SHARED_KEYS = ("embed_tokens.weight", "lm_head.weight")
_TARGET_FIELDS = {  # config.json key -> (TargetInfo field, what it is called in errors)
    "target_hidden_size": ("hidden_size", "hidden size"),
    "target_vocab_size": ("vocab_size", "vocabulary size"),
    "target_tokenizer_hash": ("tokenizer_hash", "tokenizer hash"),
    "num_target_layers": ("num_layers", "layer count"),
}
_SIZE_FIELDS = ("hidden_size", "rope_theta", "rms_norm_eps")
# Config fields added after the format's first version, with the value that reproduces the
# behaviour of checkpoints written before them (so those still load).
ADDED_FIELDS = {"carryover": False, "draft_vocab_size": None, "init_from_target": False, "edit_passes": 2,
                "loop_prefix": None, "kv_layers": None, "kv_window": 2048, "ssm_state_size": 4,
                "retrace": False, "selector_candidates": 16}
RENAMED_FIELDS = {"num_drafts": "num_speculative_tokens"}  # old config.json name -> today's
_META_FIELDS = ("architectures", "model_type", "specline_format_version", "layer_id_convention",
                "target_model_id", "torch_dtype")


def drafter_config_json(drafter: Drafter) -> dict[str, Any]:
    """The flat config.json of a drafter."""
    spec = drafter.spec
    out: dict[str, Any] = {
        "architectures": [type(drafter).__name__],
        "model_type": "specline_drafter",
        "specline_format_version": FORMAT_VERSION,
        "layer_id_convention": LAYER_ID_CONVENTION,
        "target_model_id": spec.target.name_or_path,
        "torch_dtype": str(next(drafter.parameters()).dtype).removeprefix("torch."),
    }
    out.update(dataclasses.asdict(spec.config))
    out.update({k: getattr(spec.sizes, k) for k in _SIZE_FIELDS})
    out.update({key: getattr(spec.target, f) for key, (f, _) in _TARGET_FIELDS.items()})
    return out


def save_drafter(drafter: Drafter, path: str | Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Writes ``path``/config.json and model.safetensors atomically (temp dir, then rename).

    ``weights``: the drafter's state dict to write instead of ``drafter.state_dict()`` (sharded
    training passes the gathered full tensors)."""
    if drafter.vocab is not None:
        drafter.vocab.readout()  # refuses a draft vocabulary that was never chosen
    tensors = dict(drafter.state_dict() if weights is None else weights)
    if drafter.cfg.store_shared:
        tensors["embed_tokens.weight"] = drafter.shared.embed_tokens.weight
        tensors["lm_head.weight"] = drafter.shared.lm_head.weight
    return write_checkpoint_dir(path, drafter_config_json(drafter), tensors, WEIGHTS)


def read_config(path: str | Path) -> dict[str, Any]:
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise DrafterError(f"{path}: not a drafter checkpoint (no config.json)")
    return json.loads(file.read_text())


def check_target(raw: dict[str, Any], target: Any, where: str) -> None:
    """Raises naming every field where the checkpoint's target and ``target`` differ."""
    actual = TargetInfo.of(target)
    diffs = [f"{label}: checkpoint {raw.get(key)!r}, target {getattr(actual, f)!r}"
             for key, (f, label) in _TARGET_FIELDS.items() if raw.get(key) != getattr(actual, f)]
    if diffs:
        raise DrafterError(
            f"{where}: drafter was trained for another target ({raw.get('target_model_id')}), "
            f"not {actual.name_or_path}: " + "; ".join(diffs)
        )


def spec_from_config(raw: dict[str, Any], where: str) -> DrafterSpec:
    names = {f.name for f in dataclasses.fields(DrafterConfig)}
    raw = {RENAMED_FIELDS.get(k, k): v for k, v in raw.items()}  # checkpoints written under an old name
    known = names | set(_SIZE_FIELDS) | set(_META_FIELDS) | set(_TARGET_FIELDS)
    unknown = sorted(set(raw) - known)
    raw = {**ADDED_FIELDS, **raw}  # checkpoints written before a field existed get its old behaviour
    missing = sorted((names | set(_SIZE_FIELDS) | set(_TARGET_FIELDS)) - set(raw))
    if unknown or missing:
        raise DrafterError(f"{where}: config.json has unknown fields {unknown} and lacks fields {missing}")
    cfg = DrafterConfig(**{k: raw[k] for k in names})
    sizes = LayerSizes(raw["hidden_size"], cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                       cfg.head_dim, raw["rope_theta"], raw["rms_norm_eps"])
    target = TargetInfo(raw.get("target_model_id", ""), raw["target_tokenizer_hash"], raw["target_hidden_size"],
                        raw["target_vocab_size"], raw["num_target_layers"])
    return DrafterSpec(cfg, sizes, target)


def _check_shared(tensors: dict[str, torch.Tensor], target: Any, where: str) -> None:
    """Stored frozen copies must equal the target's own embedding / LM head."""
    own = {"embed_tokens.weight": target.embed_tokens.weight, "lm_head.weight": target.lm_head.weight}
    for key in SHARED_KEYS:
        if key in tensors:
            mine = own[key].detach().cpu().to(tensors[key].dtype)
            if tensors[key].shape != mine.shape or not torch.equal(tensors[key], mine):
                raise DrafterError(f"{where}: stored {key} differs from the target's")
            del tensors[key]


def check_weights(drafter: Drafter, tensors: dict[str, torch.Tensor], where: str,
                  allow_missing: set[str] | frozenset[str] = frozenset()) -> None:
    """Raises naming missing (beyond ``allow_missing``), unexpected and misshapen weights."""
    expected = drafter.state_dict()
    missing = sorted(set(expected) - set(tensors) - set(allow_missing))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = [f"{k}: checkpoint {tuple(tensors[k].shape)}, drafter {tuple(expected[k].shape)}"
              for k in sorted(set(expected) & set(tensors)) if tensors[k].shape != expected[k].shape]
    problems = []
    if missing:
        problems.append(f"missing weights {missing}")
    if unexpected:
        problems.append(f"unexpected weights {unexpected}")
    if shapes:
        problems.append("shape mismatch " + "; ".join(shapes))
    if problems:
        raise DrafterError(f"{where}: " + ", ".join(problems))


def load_drafter(path: str | Path, target: Any, overrides: dict[str, Any] | None = None) -> Drafter:
    """A drafter from a checkpoint directory, bound to ``target``'s shared embedding/LM head, in
    evaluation mode (as transformers' ``from_pretrained``: a trainer switches it to training, which
    changes what e.g. DEdit's ``training_forward`` computes).

    ``overrides``: drafter config fields to change (a training objective that adds parts, e.g.
    a learned embedding); weights that only the changed architecture has keep their fresh
    initialisation, every other weight must be in the checkpoint."""
    where = str(path)
    raw = read_config(path)
    check_target(raw, target, where)
    spec = spec_from_config(raw, where)
    new_keys: set[str] = set()
    if overrides:
        base = set(build_from_spec(spec, target).state_dict())
        spec = dataclasses.replace(spec, config=dataclasses.replace(spec.config, **overrides))
    drafter = build_from_spec(spec, target)
    if overrides:
        new_keys = set(drafter.state_dict()) - base
    file = Path(path).expanduser() / WEIGHTS
    if not file.is_file():
        raise DrafterError(f"{where}: no {WEIGHTS}")
    tensors = load_file(str(file))
    _check_shared(tensors, target, where)
    check_weights(drafter, tensors, where, allow_missing=new_keys)
    drafter.load_state_dict(tensors, strict=not new_keys)
    if drafter.vocab is not None:
        drafter.vocab.check(where)
    return drafter.eval()
