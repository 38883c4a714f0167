"""Drafters by name: the only place that maps a config's ``name`` to a class.

``build_drafter(cfg, target)`` resolves every optional field of a :class:`DrafterConfig` against
the target (layer ids, sizes copied from the target's HF config, mask token id, γ, the draft
vocabulary's size) and builds the drafter with the target's frozen embedding/LM head. A draft
vocabulary is data: ``token_counts`` (of the training rollouts' response tokens) choose it, at
build time or later with :func:`with_draft_vocab`. Adding a drafter = one module with a
``@register_drafter("name")`` class, imported in ``components/drafters/__init__.py``.
This module knows nothing about any family's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from components.config import DrafterConfig
from components.drafters.base import (
    Drafter,
    DrafterError,
    DrafterSpec,
    SharedParts,
    TargetInfo,
    resolved,
)
from components.drafters.capabilities import Capability, require
from components.drafters.layers import LayerSizes
from components.drafters.vocab import select_draft_vocab, special_token_ids

DRAFTERS: dict[str, type[Drafter]] = {}


def register_drafter(name: str) -> Callable[[type[Drafter]], type[Drafter]]:
    def add(cls: type[Drafter]) -> type[Drafter]:
        if name in DRAFTERS and DRAFTERS[name] is not cls:
            raise DrafterError(f"drafter '{name}' registered twice ({DRAFTERS[name].__name__}, {cls.__name__})")
        DRAFTERS[name] = cls
        cls.registry_name = name
        return cls
    return add


def drafter_class(name: str) -> type[Drafter]:
    if name not in DRAFTERS:
        raise DrafterError(f"drafter.name: unknown drafter '{name}'; registered: {', '.join(sorted(DRAFTERS))}")
    return DRAFTERS[name]


def _rope_theta(tcfg: Any) -> float:
    params = getattr(tcfg, "rope_parameters", None) or {}
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(tcfg, "rope_theta", 10000.0))


def layer_sizes(cfg: DrafterConfig, target: Any) -> LayerSizes:
    """Draft layer sizes: the config's overrides, else the target's own."""
    tcfg = target.model.config
    heads = cfg.num_heads or int(tcfg.num_attention_heads)
    head_dim = cfg.head_dim or getattr(tcfg, "head_dim", None) or target.hidden_size // heads
    return LayerSizes(
        hidden_size=int(target.hidden_size),
        intermediate_size=int(cfg.intermediate_size or tcfg.intermediate_size),
        num_heads=int(heads),
        num_kv_heads=int(cfg.num_kv_heads or getattr(tcfg, "num_key_value_heads", None) or heads),
        head_dim=int(head_dim),
        rope_theta=_rope_theta(tcfg),
        rms_norm_eps=float(getattr(tcfg, "rms_norm_eps", 1e-6)),
    )


def resolve_layer_ids(cfg: DrafterConfig, num_layers: int) -> list[int]:
    """The target layers the drafter reads: configured, or its family's default for a target of
    ``num_layers`` decoder layers (the one place layer ids are resolved; the data stage calls it
    before any weights are loaded)."""
    layer_ids = list(cfg.layer_ids) if cfg.layer_ids is not None else \
        drafter_class(cfg.name).default_layer_ids(num_layers, cfg)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad or not layer_ids:
        raise DrafterError(
            f"drafter.layer_ids {layer_ids}: {bad or 'none'} out of range for a target with "
            f"{num_layers} layers (valid 0..{num_layers - 1}; layer i = HF hidden_states[i+1])"
        )
    return layer_ids


def resolve_spec(cfg: DrafterConfig, target: Any) -> DrafterSpec:
    """Every None of cfg filled from the drafter's defaults and the target."""
    cls = drafter_class(cfg.name)
    layer_ids = resolve_layer_ids(cfg, target.num_layers)
    mask_id = cfg.mask_token_id if cfg.mask_token_id is not None else getattr(target.tokenizer, "mask_token_id", None)
    full = resolved(
        cfg,
        layer_ids=layer_ids,
        num_layers=cfg.num_layers or cls.default_num_layers,
        sample_from_anchor=cls.default_sample_from_anchor if cfg.sample_from_anchor is None else cfg.sample_from_anchor,
        mask_token_id=mask_id,
    )
    sizes = layer_sizes(cfg, target)
    limit = cls.max_speculative_tokens_for(full)
    if cfg.num_speculative_tokens is not None and not 1 <= cfg.num_speculative_tokens <= (limit or cfg.num_speculative_tokens):
        raise DrafterError(f"drafter.num_speculative_tokens: {cfg.num_speculative_tokens} is not in 1..{limit or 'any'} "
                           f"for drafter '{cfg.name}'" + (f" (one block of block_size {full.block_size} drafts at "
                                                         f"most {limit})" if limit else ""))
    full = resolved(full, num_speculative_tokens=cfg.num_speculative_tokens or cls.default_num_speculative_tokens(full),
                    intermediate_size=sizes.intermediate_size, num_heads=sizes.num_heads,
                    num_kv_heads=sizes.num_kv_heads, head_dim=sizes.head_dim,
                    draft_vocab_size=resolve_draft_vocab_size(cfg.draft_vocab_size, int(target.vocab_size)))
    return DrafterSpec(full, sizes, TargetInfo.of(target))


def resolve_draft_vocab_size(size: int | None, vocab_size: int) -> int | None:
    """None/0 and the full size mean the full vocabulary (None); else 1..V-1."""
    if not size or size == vocab_size:
        return None
    if not 0 < size < vocab_size:
        raise DrafterError(f"drafter.draft_vocab_size: {size} is not in 1..{vocab_size} (the target has {vocab_size} "
                           "tokens; 0 or null = the full vocabulary)")
    return int(size)


def build_from_spec(spec: DrafterSpec, target: Any) -> Drafter:
    """The drafter of ``spec``; a draft vocabulary is left to choose (token counts or a state dict)."""
    drafter = drafter_class(spec.config.name)(spec, SharedParts.of(target))
    return drafter.to(device=target.device, dtype=target.dtype)


def build_drafter(cfg: DrafterConfig, target: Any, token_counts: Tensor | None = None) -> Drafter:
    """A freshly initialised drafter for ``target`` (the trainer's entry point; with
    ``drafter.init_from_target``, its layers start as the target's last ones). With
    ``drafter.draft_vocab_size``, ``token_counts`` [V] (response tokens of the training rollouts)
    choose its vocabulary; without them it stays to be chosen (:func:`with_draft_vocab`)."""
    drafter = build_from_spec(resolve_spec(cfg, target), target)
    if cfg.init_from_target:
        require(drafter, "drafter.init_from_target", Capability.HEAD_START)
        drafter.head_start(target.model)
    if drafter.vocab is not None and token_counts is not None:
        with_draft_vocab(drafter, target, token_counts)
    return drafter


def with_draft_vocab(drafter: Drafter, target: Any, token_counts: Tensor) -> Drafter:
    """Chooses ``drafter``'s draft vocabulary (in place, returned): the ``draft_vocab_size`` most
    frequent tokens of ``token_counts`` [V] (ties by id) plus ``target``'s special/stop tokens."""
    if drafter.vocab is None:
        raise DrafterError(f"drafter '{drafter.cfg.name}' has the full vocabulary (drafter.draft_vocab_size unset)")
    raw = torch.as_tensor(token_counts).flatten().double()
    counts = torch.zeros(int(target.vocab_size), dtype=torch.float64)  # [V], ids past the records' max are 0
    counts[:min(counts.shape[0], raw.shape[0])] = raw[:counts.shape[0]]
    return drafter.set_draft_vocab(select_draft_vocab(counts, drafter.vocab.size, target_special_ids(target)))


def target_special_ids(target: Any) -> list[int]:
    """The special and stop tokens ``target`` may emit (always kept in a draft vocabulary)."""
    return special_token_ids(target.tokenizer, list(target.eos_ids))
