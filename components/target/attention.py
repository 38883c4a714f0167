"""The target's attention kernel: scaled-dot-product attention with grouped KV heads broadcast
inside the kernel, registered with transformers as ``GQA_SDPA``.

Transformers' own ``sdpa`` path, for a model with fewer KV heads than query heads, copies every
KV head ``num_key_value_groups`` times (``repeat_kv``) whenever a mask is given and more than one
query token is new, which is every verify pass of a speculative batch (ragged rows need a mask;
each row brings x_{n-1} and its drafts). That copy is the whole KV cache of every layer, each
round. ``torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`` reads the KV
heads in place; its output is bit-identical on CPU (``tests/components/target/test_attention.py``)
and it saves the copy (``docs/results.md`` has the timing).
Transformers keeps ``repeat_kv`` for masked passes on CUDA because the masked GQA kernel there
falls back to the math path, so ``attention = "auto"`` takes this kernel on CPU only.

Knows transformers' attention interface; nothing about drafters, caches or the engine.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

GQA_SDPA = "specline_gqa_sdpa"
_registered = False


def gqa_sdpa_forward(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """query [B, Hq, T, D], key/value [B, Hkv, S, D] (Hq a multiple of Hkv), mask [B, 1, T, S]
    bool/additive or None → attention output [B, T, Hq, D] (transformers' layout)."""
    unsupported = sorted(k for k in ("softcap", "position_bias", "s_aux", "sinks") if kwargs.get(k) is not None)
    if unsupported:
        raise ValueError(f"attention '{GQA_SDPA}' does not support {unsupported}; set target.attention: sdpa")
    q_len = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(causal) and q_len > 1 and attention_mask is None
    if causal and key.shape[2] > q_len:  # as transformers: only a prefill into an empty static cache
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, dropout_p=dropout,
                                         scale=scaling, is_causal=causal, enable_gqa=key.shape[1] != query.shape[1])
    return out.transpose(1, 2).contiguous(), None


def register_gqa_sdpa() -> bool:
    """Registers ``GQA_SDPA`` (attention and its sdpa-style mask) with transformers, once;
    False where this transformers has no attention interface to register with."""
    global _registered
    if _registered:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(GQA_SDPA, gqa_sdpa_forward)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)
    _registered = True
    return True


def choose_attention(model: Any, setting: str, device: torch.device) -> str:
    """Sets ``model``'s attention implementation from ``target.attention`` and returns it:
    ``auto`` = ``GQA_SDPA`` on CPU for a model loaded with transformers' ``sdpa`` (else left as
    loaded); any other value is passed to ``model.set_attn_implementation`` as given."""
    current = str(getattr(model.config, "_attn_implementation", ""))
    if setting == "auto":
        if device.type != "cpu" or current != "sdpa" or not register_gqa_sdpa():
            return current
        setting = GQA_SDPA
    elif setting == GQA_SDPA and not register_gqa_sdpa():
        raise ValueError(f"target.attention: '{GQA_SDPA}' needs transformers' AttentionInterface")
    if setting != current:
        model.set_attn_implementation(setting)
    return str(model.config._attn_implementation)
