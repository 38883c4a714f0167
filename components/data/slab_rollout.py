"""Rollouts on the fast target step: a continuous batch over a static KV slab, hidden states
captured in the same passes that generate the response.

    records = slab_rollouts(decoder, prompts, cfg, stop_ids, meta, rows=cfg.batch_size)

The transformers path (``rollout.generate`` then ``rollout.capture``) decodes a left-padded batch
whose finished rows keep riding along, then runs a second forward over prompt + response to
capture hidden states. Here every prompt gets its own row of a slab ([rows, h_kv, S, d] per
layer, ``step.StaticDecoder``): it is prefilled alone (its prompt's hidden states kept), then
decodes one token per step beside the other rows (``StaticDecoder.forward_rows``: one kernel
call per layer for all rows), and each step's hidden states are kept as they are computed. A
row whose response has ended is fed its last token once more (its hidden states, the logits
unused) and then hands its row to the next prompt. No second pass, no padding.

Sampling matches ``rollout.generate``: one ``torch.Generator`` per prompt, seeded from its
seed, drawn once per token in order, so a prompt's response does not depend on its row or
neighbours; greedy output equals the transformers path's token for token in float32 except
at near-ties (the products sum in another order), and the hidden states agree to float32
rounding. Knows the decoder's slab API, prompts and records; nothing of Ray or shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from components.config import DataConfig
from components.data.emit import sample_next, to_record
from components.data.prompts import Prompt
from components.data.records import Record, RecordMeta
from components.target.step import StaticDecoder


@dataclass
class _Row:
    """One prompt in flight: its tokens so far and the hidden states of the tokens fed."""

    order: int  # index into the prompts, for returning records in order
    prompt: Prompt
    generator: torch.Generator
    tokens: list[int]  # prompt + response so far
    hidden: list[Tensor] = field(default_factory=list)  # [t, n, H] chunks, one per pass
    last: list[Tensor] = field(default_factory=list)  # [t, H] chunks
    ended: bool = False  # the response is complete; its last token still needs its pass

    @property
    def response_len(self) -> int:
        return len(self.tokens) - len(self.prompt.input_ids)


def _admit(decoder: StaticDecoder, k: list[Tensor], v: list[Tensor], slot: int, order: int,
           prompt: Prompt) -> tuple[_Row, Tensor]:
    """``prompt`` prefilled into slab row ``slot`` → its row in flight (prompt hidden states kept)
    and its last token's logits [1, V]."""
    logits, taps, last = decoder.prefill_row(torch.tensor([prompt.input_ids], dtype=torch.long), k, v, slot)
    row = _Row(order, prompt, torch.Generator().manual_seed(prompt.seed), list(prompt.input_ids))
    row.hidden.append(taps[0]), row.last.append(last[0])
    return row, logits[0]


def _pick(row: _Row, logits: Tensor, cfg: DataConfig, stops: set[int]) -> None:
    """Draws the row's next token from logits [1, V] with its own generator; marks the end."""
    token = int(sample_next(logits, cfg.temperature, cfg.top_p, [row.generator])[0])
    row.tokens.append(token)
    row.ended = token in stops or row.response_len >= cfg.max_new_tokens


def _record(row: _Row, meta: RecordMeta) -> Record:
    return to_record(row.prompt, row.tokens, torch.cat(row.hidden).float().numpy(),
                     torch.cat(row.last).float().numpy(), meta)


@torch.no_grad()
def slab_rollouts(decoder: StaticDecoder, prompts: Sequence[Prompt], cfg: DataConfig, stop_ids: Sequence[int],
                  meta: RecordMeta, rows: int, on_records: Callable[[list[Record]], None] | None = None
                  ) -> list[Record]:
    """Records of ``prompts`` (in their order), at most ``rows`` decoding at once; the decoder's
    ``taps`` must be ``meta.layer_ids``. ``on_records`` gets each group of finished records."""
    if tuple(decoder.taps) != tuple(meta.layer_ids):
        raise ValueError(f"the decoder taps layers {decoder.taps}, the records want {meta.layer_ids}")
    if not prompts:
        return []
    longest = max(len(p.input_ids) for p in prompts) + cfg.max_new_tokens
    if longest > decoder.capacity:
        raise ValueError(f"a prompt of {longest - cfg.max_new_tokens} tokens + data.max_new_tokens "
                         f"{cfg.max_new_tokens} is past the fast step's {decoder.capacity} slots (target.static_len)")
    k, v = decoder.new_slab(max(1, min(rows, len(prompts))), slots=longest)
    stops = {int(i) for i in stop_ids}
    waiting = list(enumerate(prompts))[::-1]  # popped from the end: prompts in order
    live: dict[int, _Row] = {}  # slab row -> prompt in flight
    done: dict[int, Record] = {}

    def admit(slot: int) -> None:
        live[slot], logits = _admit(decoder, k, v, slot, *waiting.pop())
        _pick(live[slot], logits, cfg, stops)

    for slot in range(k[0].shape[0]):
        admit(slot)
    while live:
        slots = sorted(live)
        seq = torch.tensor(slots, dtype=torch.long)
        pos = torch.tensor([len(live[s].tokens) - 1 for s in slots], dtype=torch.long)
        ids = torch.tensor([live[s].tokens[-1] for s in slots], dtype=torch.long)
        logits, taps, last = decoder.forward_rows(ids, seq, pos, k, v)  # [R, V], [R, n, H], [R, H]
        records = []
        for r, slot in enumerate(slots):
            row = live[slot]
            row.hidden.append(taps[r:r + 1]), row.last.append(last[r:r + 1])
            if not row.ended:
                _pick(row, logits[r:r + 1], cfg, stops)
                continue
            del live[slot]  # its last token's hidden states are in: the record is complete
            records.append(done.setdefault(row.order, _record(row, meta)))
            if waiting:
                admit(slot)
        if records and on_records is not None:
            on_records(records)
    return [done[i] for i in range(len(prompts))]
