"""What both rollout paths share (``rollout``: transformers' forward; ``slab_rollout``: the fast
step): a row's next token drawn from its own generator, and a finished sequence with its hidden
states encoded as a record. Knows records and sampling settings; nothing of targets or Ray."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from components.data.prompts import Prompt
from components.data.records import Record, RecordMeta, encode


def sample_next(logits: Tensor, temperature: float, top_p: float,
                generators: Sequence[torch.Generator]) -> Tensor:
    """logits [B, V] → next tokens [B]; row b draws only from ``generators[b]``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [B, V]
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p > top_p  # keep the smallest prefix reaching top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    return torch.cat([torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)])


def to_record(prompt: Prompt, tokens: Sequence[int], hidden: np.ndarray, last: np.ndarray,
              meta: RecordMeta) -> Record:
    """A record of ``prompt`` + its response (``tokens``: the whole sequence) and their hidden
    states (float32 [≥T, n, H] and [≥T, H]; rows past T are padding), encoded to ``meta.storage``."""
    t = len(tokens)
    h, hs = encode(hidden[:t], meta.storage)
    lh, ls = encode(last[:t], meta.storage)
    loss_mask = np.zeros(t, dtype=np.uint8)
    loss_mask[len(prompt.input_ids):] = 1
    return Record(prompt.prompt_id, np.asarray(tokens, dtype=np.int32), loss_mask, h, lh, hs, ls,
                  len(prompt.input_ids), prompt.seed)
