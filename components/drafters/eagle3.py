"""EAGLE-3: fused low/mid/high target features + token embedding → one decoder layer, autoregressive.

At drafter position j the input is the token x_j and a hidden g_j: at the first step
g_j = fc([h^{l1}; h^{l2}; h^{l3}] at j−1) (the target's taps of the previous position), at later
steps the drafter's own output of the previous step. The layer (vLLM's ``midlayer``) attends
with q/k/v over [input_layernorm(e(x_j)); hidden_norm(g_j)] (2H wide), its residual is g_j,
and ``norm`` + the shared LM head give the logits for x_{j+1}.

Training unrolls ``ttt_steps`` steps (training-time test): step s at base position j feeds
x_{j+s} with the step s−1 output and attends to step-0 keys at positions ≤ j plus its own
chain's keys at j — exactly what inference sees. Inference keeps the step-0 K/V of committed
positions and the fused features (``DraftState.feats``), so rollback is a crop.
With a draft vocabulary (``drafter.vocab``) each step reads out over it and feeds the drafted
token back as its target id; knows nothing else about d2t/t2d (components/drafters/vocab.py).
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
    spread_layer_ids,
)
from components.drafters.capabilities import Capability
from components.drafters.layers import (
    KV,
    MLP,
    Attention,
    RMSNorm,
    causal_mask,
    init_weights,
    pad_kv_rows,
)
from components.drafters.registry import register_drafter
from components.spec.sampling import SamplingParams


class Eagle3Layer(nn.Module):
    """vLLM's ``midlayer``: attention over [norm(embedding); norm(hidden)], residual = hidden."""

    def __init__(self, spec: DrafterSpec):
        super().__init__()
        s = spec.sizes
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.hidden_norm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s, in_features=2 * s.hidden_size, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s.hidden_size, s.intermediate_size)

    def inputs(self, emb: Tensor, g: Tensor) -> Tensor:  # [B, T, H] x2 -> [B, T, 2H]
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(g)], dim=-1)

    def forward(
        self,
        x: Tensor,  # [B, T, 2H] from inputs()
        g: Tensor,  # [B, T, H] residual
        positions: Tensor,  # [B, T]
        past: KV | None,  # k, v [B, h_kv, S, d] placed before x's own
        mask: Tensor | None,  # [B|1, 1, T, S + T] bool
    ) -> tuple[Tensor, KV]:  # out [B, T, H], x's own (k, v)
        q = self.self_attn.project_q(x, positions)
        k, v = self.self_attn.project_kv(x, positions)
        keys = torch.cat([past[0], k], 2) if past is not None else k
        values = torch.cat([past[1], v], 2) if past is not None else v
        out = g + self.self_attn.attend(q, keys, values, mask)
        return out + self.mlp(self.post_attention_layernorm(out)), (k, v)


def eagle3_layer_ids(num_target_layers: int) -> list[int]:
    """[1, L//2 − 1, L − 4] (SpecForge/HF outputs convention); a spread over 0..L−2 if degenerate."""
    L = num_target_layers
    ids = [1, L // 2 - 1, L - 4]
    if ids == sorted(set(ids)) and ids[0] >= 0:
        return ids
    return spread_layer_ids(L, 3)


def shift_right(x: Tensor, first: Tensor | None = None) -> Tensor:
    """[B, T, F] → x at j−1 for every j; position 0 gets ``first`` [B, F] (zeros if None)."""
    head = first.unsqueeze(1) if first is not None else torch.zeros_like(x[:, :1])
    return torch.cat([head, x[:, :-1]], dim=1)


@register_drafter("eagle3")
class Eagle3Drafter(Drafter):
    default_num_layers = 1

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        h = self.sizes.hidden_size
        self.fc = nn.Linear(len(self.layer_ids) * h, h, bias=False)
        self.midlayer = Eagle3Layer(spec)
        self.norm = RMSNorm(h, self.sizes.rms_norm_eps)
        init_weights(self)

    @staticmethod
    def default_layer_ids(num_target_layers: int, cfg: DrafterConfig) -> list[int]:
        return eagle3_layer_ids(num_target_layers)

    @staticmethod
    def default_num_speculative_tokens(cfg: DrafterConfig) -> int:
        return cfg.ttt_steps

    def sequential_passes(self, gamma: int) -> int:
        return gamma

    def fuse(self, hidden: Tensor) -> Tensor:  # [B, T, n, H] -> [B, T, H]
        return self.fc(hidden.to(self.fc.weight.dtype).flatten(2))

    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        b, t = batch.input_ids.shape
        steps = int(self.cfg.ttt_steps)
        base = torch.arange(t, device=batch.input_ids.device).expand(b, t)
        g = shift_right(self.fuse(batch.hidden))
        causal = causal_mask(t, g.device)
        eye = torch.eye(t, dtype=torch.bool, device=g.device).view(1, 1, t, t)
        keys: list[Tensor] = []
        values: list[Tensor] = []
        logits = []
        for s in range(steps):
            x = self.midlayer.inputs(self.embed(gather_positions(batch.input_ids, base + s)), g)
            pos = base + s
            k, v = self.midlayer.self_attn.project_kv(x, pos)
            past = (torch.cat(keys, 2), torch.cat(values, 2)) if keys else None
            mask = torch.cat([causal] + [eye] * s, dim=-1)
            g, _ = self.midlayer(x, g, pos, past, mask)
            keys.append(k)
            values.append(v)
            logits.append(self.lm_head(self.norm(g)))  # [B, T, V]: row j's draft s
        return rows_at_anchors(torch.stack(logits, dim=2), batch, base, self.shared, targets, self.vocab)

    def consume(self, state: DraftState, tokens: Tensor, hidden: Tensor) -> DraftState:
        """Only K/V are needed for committed positions: one projection, no attention."""
        b, t = tokens.shape
        feats = self.fuse(hidden)  # [B, T, H]
        prev = state.feats[:, -1] if state.feats is not None else None
        x = self.midlayer.inputs(self.embed(tokens), shift_right(feats, prev))
        pos = state.length + torch.arange(t, device=tokens.device).expand(b, t)
        k, v = self.midlayer.self_attn.project_kv(x, pos)
        if state.kv:
            k, v = torch.cat([state.kv[0][0], k], 2), torch.cat([state.kv[0][1], v], 2)
            feats = torch.cat([state.feats, feats], 1)
        return DraftState(state.length + t, [(k, v)], feats)

    def propose(self, state: DraftState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = num_speculative_tokens or self.num_speculative_tokens
        b = last_token.shape[0]
        g = (state.feats[:, -1:] if state.feats is not None
             else torch.zeros(b, 1, self.sizes.hidden_size, device=last_token.device, dtype=self.fc.weight.dtype))
        past = state.kv[0] if state.kv else None
        tok = last_token
        out_tokens, out_logits, out_probs = [], [], []
        for s in range(gamma):
            pos = torch.full((b, 1), state.length + s, device=tok.device, dtype=torch.long)
            x = self.midlayer.inputs(self.embed(tok.unsqueeze(1)), g)
            g, (k, v) = self.midlayer(x, g, pos, past, None)
            past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
            logits = self.lm_head(self.norm(g[:, 0]))  # [B, R]
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
        """``propose`` for many batch-1 states at once (the batch engine's rows): each of the γ
        steps is one layer pass over all rows, their committed K/V right-padded to the longest
        and masked. last_tokens [R]. ``sampling`` and ``num_speculative_tokens`` are shared or one per row;
        each row draws from its own generator (``generators``) only at its own γ steps, so its
        tokens are the ones ``propose`` would draw for it alone."""
        r, dev = len(states), last_tokens.device
        per_row, samplings, gens = row_settings(r, sampling, num_speculative_tokens, generators, self.num_speculative_tokens)
        past, seen = pad_kv_rows([s.kv[0] if s.kv else None for s in states], dev)  # [R, h, W, d], [R, W]
        zeros = torch.zeros(1, 1, self.sizes.hidden_size, device=dev, dtype=self.fc.weight.dtype)
        g = torch.cat([s.feats[:, -1:] if s.feats is not None else zeros for s in states])  # [R, 1, H]
        pos = torch.tensor([s.length for s in states], device=dev)[:, None]  # [R, 1]
        tok, draws = last_tokens, RowDraws(samplings, per_row, gens, self.vocab)
        for step in range(max(per_row)):
            mask = torch.cat([seen, seen.new_ones(r, step + 1)], dim=1)[:, None, None, :]  # [R, 1, 1, W+s+1]
            x = self.midlayer.inputs(self.embed(tok.unsqueeze(1)), g)
            g, (k, v) = self.midlayer(x, g, pos + step, past, mask)
            past = (torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)) if past is not None else (k, v)
            tok = draws.draw(self.lm_head(self.norm(g[:, 0])))  # readout logits [R, D] → target ids [R]
        return draws.proposals()
