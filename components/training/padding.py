"""Data-stage records → right-padded :class:`DraftBatch` tensors.

Records hold float16/int8/float32 hidden states of varying length T; a batch is right-padded
to the longest record (token 0, zero hidden states, loss mask False), decoded to float32.
Right padding is safe for causal drafters: padded positions come after every real one and are
never supervised. Knows records and tensors; nothing about Ray, models or losses.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from components.data.records import Record, batch_to_records
from components.drafters.base import DraftBatch


def collate(records: Sequence[Record], device: torch.device | str = "cpu") -> DraftBatch:
    """Records → one right-padded float32 batch (loss mask = the records' response tokens)."""
    if not records:
        raise ValueError("collate: no records")
    b, t = len(records), max(r.num_tokens for r in records)
    n, h = records[0].hidden.shape[1:]
    ids = np.zeros((b, t), np.int64)  # [B, T]
    mask = np.zeros((b, t), np.bool_)  # [B, T]
    hidden = np.zeros((b, t, n, h), np.float32)  # [B, T, n, H]
    last = np.zeros((b, t, h), np.float32)  # [B, T, H]
    for i, r in enumerate(records):
        k = r.num_tokens
        ids[i, :k] = r.input_ids
        mask[i, :k] = r.loss_mask.astype(np.bool_)
        hidden[i, :k] = r.hidden_f32()
        last[i, :k] = r.last_hidden_f32()
    as_t = lambda x: torch.from_numpy(x).to(device)
    return DraftBatch(as_t(ids), as_t(hidden), as_t(last), loss_mask=as_t(mask))


def numpy_batch_to_draft(batch: dict[str, Any], device: torch.device | str = "cpu") -> DraftBatch:
    """A numpy batch of record rows (as Ray Data's ``iter_batches`` yields it) → a DraftBatch."""
    return collate(batch_to_records(batch), device)


def supervised_tokens(batch: DraftBatch) -> int:
    """Response tokens in a batch (what tokens/s counts)."""
    mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids)
    return int(mask.sum())


def chunks(records: Iterable[Record], size: int) -> Iterator[list[Record]]:
    """Consecutive lists of ``size`` records (the last may be shorter)."""
    out: list[Record] = []
    for r in records:
        out.append(r)
        if len(out) == size:
            yield out
            out = []
    if out:
        yield out
