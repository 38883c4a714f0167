"""MTP-style drafter: one sequential module per depth (DeepSeek-V3 MTP, used as a drafter).

Module m at position j: x = eh_proj([enorm(e(x_j)); hnorm(g_j)]) → a Qwen3 decoder layer
(causal, with its own K/V over the context) → its own ``norm`` → the shared LM head, predicting
x_{j+1}. Module 0 reads g_j = the target's last hidden state at j−1; module m > 0 reads module
m−1's output at j−1. A round of γ drafts chains modules 0, 1, …, D−1 and reuses the last module
beyond depth D, feeding each step the token drafted by the previous one.

Training is teacher-forced and parallel per depth: step s runs module min(s, D−1) over the
whole sequence with the previous step's outputs shifted by one; draft s of the block anchored at
a is step s's output at position a+s. At inference, module m > 0 has no K/V for the positions
between the committed context and its own step (as in engines' MTP serving); DraftState.feats
keeps [h, a^0, …, a^{D−2}] per committed position so rollback is a crop.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from components.config import DrafterConfig
from components.drafters.base import (
    DEFAULT_SAMPLING,
    DraftBatch,
    Drafter,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    Proposal,
    RowDraws,
    SharedParts,
    gather_positions,
    row_settings,
    rows_at_anchors,
)
from components.drafters.capabilities import Capability
from components.drafters.eagle3 import shift_right
from components.drafters.layers import (
    KV,
    DecoderLayer,
    RMSNorm,
    causal_mask,
    init_weights,
    pad_kv_rows,
)
from components.drafters.registry import register_drafter
from components.spec.sampling import SamplingParams


class MTPModule(nn.Module):
    def __init__(self, spec: DrafterSpec):
        super().__init__()
        s = spec.sizes
        self.enorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hnorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * s.hidden_size, s.hidden_size, bias=False)
        self.layer = DecoderLayer(s)
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(
        self,
        emb: Tensor,  # [B, T, H] token embeddings e(x_j)
        g: Tensor,  # [B, T, H] previous depth's hidden at j−1
        positions: Tensor,  # [B, T]
        past: KV | None,  # k, v [B, h_kv, S, d]
        mask: Tensor | None,  # [B|1, 1, T, S + T] bool
    ) -> tuple[Tensor, KV]:  # out [B, T, H] (pre-norm), own (k, v)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(g)], dim=-1))
        return self.layer(x, positions, past, mask)


def _past_mask(t: int, s: int, device: torch.device) -> Tensor:  # -> [1, 1, t, s + t]
    return torch.cat([torch.ones(1, 1, t, s, dtype=torch.bool, device=device), causal_mask(t, device)], -1)


@register_drafter("mtp")
class MTPDrafter(Drafter):
    default_num_layers = 1

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        self.layers = nn.ModuleList(MTPModule(spec) for _ in range(int(self.cfg.mtp_depth)))
        init_weights(self)

    @staticmethod
    def default_layer_ids(num_target_layers: int, cfg: DrafterConfig) -> list[int]:
        return [num_target_layers - 1]

    @staticmethod
    def default_num_speculative_tokens(cfg: DrafterConfig) -> int:
        return cfg.mtp_depth

    def sequential_passes(self, gamma: int) -> int:
        return gamma

    def _module(self, step: int) -> MTPModule:
        return self.layers[min(step, len(self.layers) - 1)]

    def _h(self, hidden: Tensor) -> Tensor:  # [B, T, n, H] -> [B, T, H] the target's last layer
        return hidden[:, :, -1].to(self.layers[0].eh_proj.weight.dtype)

    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        b, t = batch.input_ids.shape
        gamma = self.num_speculative_tokens
        pos = torch.arange(t, device=batch.input_ids.device).expand(b, t)
        emb, g, mask = self.embed(batch.input_ids), shift_right(self._h(batch.hidden)), causal_mask(t, pos.device)
        drafts = []
        for s in range(gamma):
            module = self._module(s)
            out, _ = module(emb, g, pos, None, mask)
            logits = self.lm_head(module.norm(out))  # [B, T, R], position j predicts x_{j+1}
            drafts.append(gather_positions(logits, pos + s))  # block anchored at a: step s at a+s
            g = shift_right(out)
        return rows_at_anchors(torch.stack(drafts, dim=2), batch, pos, self.shared, targets, self.vocab)

    def consume(self, state: DraftState, tokens: Tensor, hidden: Tensor) -> DraftState:
        b, t = tokens.shape
        h = self._h(hidden)
        emb = self.embed(tokens)
        pos = state.length + torch.arange(t, device=tokens.device).expand(b, t)
        width = h.shape[-1]
        chain, kv, feats = h, [], [h]
        for m, module in enumerate(self.layers):
            prev = state.feats[:, -1, m * width:(m + 1) * width] if state.feats is not None else None
            past = state.kv[m] if state.kv else None
            out, (k, v) = module(emb, shift_right(chain, prev), pos, past, _past_mask(t, state.length, h.device))
            kv.append((torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v))
            chain = out
            if m < len(self.layers) - 1:
                feats.append(out)
        new = torch.cat(feats, -1)
        return DraftState(state.length + t, kv, torch.cat([state.feats, new], 1) if state.feats is not None else new)

    def propose(self, state: DraftState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        b, hsz = last_token.shape[0], self.sizes.hidden_size
        g = (state.feats[:, -1:, :hsz] if state.feats is not None
             else torch.zeros(b, 1, hsz, device=last_token.device, dtype=self.layers[0].eh_proj.weight.dtype))
        temps: dict[int, KV] = {}
        tok, out_tokens, out_logits, out_probs = last_token, [], [], []
        for s in range(gamma):
            m = min(s, len(self.layers) - 1)
            past = _concat_kv(state.kv[m] if state.kv else None, temps.get(m))
            pos = torch.full((b, 1), state.length + s, device=tok.device, dtype=torch.long)
            g, kv = self.layers[m](self.embed(tok.unsqueeze(1)), g, pos, past, None)
            temps[m] = _concat_kv(temps.get(m), kv)
            logits = self.lm_head(self.layers[m].norm(g[:, 0]))  # [B, R]
            tok, probs = self.draw(logits, sampling, generator)  # target ids [B], probs [B, R]
            out_tokens.append(tok)
            out_logits.append(logits)
            out_probs.append(probs)
        return self.proposal(torch.stack(out_tokens, 1), torch.stack(out_logits, 1), torch.stack(out_probs, 1))

    @torch.no_grad()
    def capabilities(self) -> frozenset[Capability]:
        return frozenset({Capability.BATCHED_PROPOSE})

    def propose_many(self, states: list[DraftState], last_tokens: Tensor,
                     sampling: SamplingParams | list[SamplingParams], num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """``propose`` for many batch-1 states at once (the batch engine's rows): each draft step
        is one module pass over all rows, each module's committed K/V right-padded to the
        longest and masked. ``sampling`` and ``num_speculative_tokens`` shared or one per row; each row draws
        from its own generator only at its own γ steps, as ``propose`` would for it alone."""
        r, dev, hsz = len(states), last_tokens.device, self.sizes.hidden_size
        per_row, samplings, gens = row_settings(r, sampling, num_speculative_tokens, generators, self.num_speculative_tokens)
        committed = [pad_kv_rows([s.kv[m] if s.kv else None for s in states], dev) for m in range(len(self.layers))]
        zeros = torch.zeros(1, 1, hsz, device=dev, dtype=self.layers[0].eh_proj.weight.dtype)
        g = torch.cat([s.feats[:, -1:, :hsz] if s.feats is not None else zeros for s in states])  # [R, 1, H]
        pos = torch.tensor([s.length for s in states], device=dev)[:, None]  # [R, 1]
        temps: dict[int, KV] = {}
        tok, draws = last_tokens, RowDraws(samplings, per_row, gens, self.vocab)
        for step in range(max(per_row)):
            m = min(step, len(self.layers) - 1)
            (past, seen), own = committed[m], temps.get(m)
            mask = torch.cat([seen, seen.new_ones(r, (own[0].shape[2] if own else 0) + 1)], 1)[:, None, None, :]
            g, kv = self.layers[m](self.embed(tok.unsqueeze(1)), g, pos + step, _concat_kv(past, own), mask)
            temps[m] = _concat_kv(own, kv)
            tok = draws.draw(self.lm_head(self.layers[m].norm(g[:, 0])))  # readout logits [R, D] → target ids [R]
        return draws.proposals()


def _concat_kv(a: KV | None, b: KV | None) -> KV | None:
    if a is None or b is None:
        return a if b is None else b
    return torch.cat([a[0], b[0]], 2), torch.cat([a[1], b[1]], 2)
