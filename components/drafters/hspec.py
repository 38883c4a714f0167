"""H-Spec: a parallel block drafter that keeps no context cache of its own (survey, "H-Spec").

DFlash projects the target's taps into keys/values of its own for every context position, so
its state grows with the context. H-Spec splits that job in two, both fed by what the target
computes anyway:

* a **summary**: the target's taps at the last committed position (n fused by ``fc`` +
  ``hidden_norm``, DFlash's fusion) are projected, per layer, into the initial state U₀
  [heads, N, P] of a Mamba-2-style selective scan (``SelectiveScan``) that runs over the
  block's positions only, from U₀, in one parallel pass;
* **detail**: attention in the last ``len(kv_layers)`` layers reads the keys/values of target
  layers ``kv_layers`` *in place* (``DraftState.target_kv``: views the engine made of its own
  cache, ``Capability.TARGET_KV``), the last ``kv_window`` committed slots, beside the block's
  own keys/values (bidirectional in the block, as DFlash's).

Layer i: x += scan(norm(x), U₀ᵢ); [x += attention(norm(x), target K/V of kv_layers[j] ‖ block)];
x += MLP(norm(x)). DSpark's Markov and confidence heads on top (its readout, layout
``sample_from_anchor=True``: a block of 7 drafts 7).

What the drafter keeps between rounds is its committed length and the fused summaries of the
last ``TAIL`` positions (for rollback): nothing grows with the context. Training has no cache
to read: the target's K/V of layer l are recomputed from the stored tap at l − 1 with the
target's own frozen layer-l projections (``SharedParts.target_kv``), so every entry of
``kv_layers`` must be one past a tap (default: one past each of the three deepest taps, fewer
with fewer layers).

Where the survey is silent, chosen here: the scan has no short convolution (Mamba-2's conv1d;
the block is 7 tokens) and no expansion (heads × P = the model width); N (``ssm_state_size``)
is 4 as in the survey's Qwen3-8B figure; the first layer is scan-only and the attention layers
read the kv layers shallow to deep; a block anchored at position 0 starts from U₀ = 0. The
batch engine's ``propose_many`` pads the rows' windows into one tensor per round (a transient
copy, as DFlash's padded contexts); the state never holds any of it.

Knows nothing about losses, verification or how an engine lays out its cache.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from components.drafters.base import (
    DraftBatch,
    DrafterError,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    SharedParts,
    TargetKV,
    gather_positions,
)
from components.drafters.capabilities import Capability
from components.drafters.dflash import blocks_mask, sample_anchors
from components.drafters.dspark import DSparkDrafter
from components.drafters.layers import KV, MLP, Attention, LayerSizes, RMSNorm, pad_kv_rows
from components.drafters.registry import register_drafter

TAIL = 16  # positions whose fused summaries a state keeps: rollback reaches back TAIL - 1 of them


class SelectiveScan(nn.Module):
    """Mamba-2's recurrence over a block from a given state, in parallel (SSD's quadratic form):

        U_i = a_i U_{i-1} + k_i v_iᵀ,   o_i = U_iᵀ q_i + D ⊙ x_i,   a_i = exp(-exp(A_log) Δ_i)

    per head (U [N, P]); Δ_i = softplus(dt(x_i) + dt_bias), v_i = x_i Δ_i, and the output is
    gated by silu(z_i) before ``out_proj``. Unrolled: o_i = (∏_{j≤i} a_j) q_iᵀU₀ +
    Σ_{j≤i} (∏_{j<m≤i} a_m)(q_i·k_j) v_j."""

    def __init__(self, hidden: int, heads: int, head_dim: int, state: int, eps: float):
        super().__init__()
        self.heads, self.p, self.n = heads, head_dim, state
        width = heads * head_dim
        self.in_proj = nn.Linear(hidden, 2 * width + 2 * heads * state + heads, bias=False)  # x, z, k, q, Δ
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = RMSNorm(width, eps)
        self.out_proj = nn.Linear(width, hidden, bias=False)
        self.reset_scan()

    @torch.no_grad()
    def reset_scan(self) -> None:
        """Mamba-2's initialisation: A in [1, 16], Δ in [1e-3, 1e-1] at dt(x) = 0."""
        self.A_log.copy_(torch.log(torch.linspace(1.0, 16.0, self.heads)))
        dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), self.heads))
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus⁻¹(dt)

    def forward(self, x: Tensor, u0: Tensor) -> Tensor:  # x [R, Q, H], u0 [R, h, N, P] -> [R, Q, H]
        r, q_len, _ = x.shape
        h, n, p = self.heads, self.n, self.p
        xs, z, k, q, dt = self.in_proj(x).split([h * p, h * p, h * n, h * n, h], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())  # [R, Q, h]
        cum = (-torch.exp(self.A_log.float()) * dt).cumsum(dim=1)  # [R, Q, h] Σ_{j≤i} log a_j
        xs = xs.view(r, q_len, h, p)
        v = xs * dt.unsqueeze(-1).to(xs.dtype)  # [R, Q, h, P]
        k, q = k.view(r, q_len, h, n), q.view(r, q_len, h, n)
        o = torch.exp(cum).unsqueeze(-1).to(x.dtype) * torch.einsum("rqhn,rhnp->rqhp", q, u0)
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=x.device).tril()  # [i, j]: j ≤ i
        seg = cum.unsqueeze(2) - cum.unsqueeze(1)  # [R, Qi, Qj, h]: Σ_{j<m≤i} log a_m
        decay = torch.where(causal[None, :, :, None], seg, float("-inf")).exp().to(x.dtype)
        o = o + torch.einsum("rijh,rihn,rjhn,rjhp->rihp", decay, q, k, v)
        o = o + self.D.to(x.dtype).view(1, 1, h, 1) * xs
        return self.out_proj(self.norm(o.reshape(r, q_len, h * p) * F.silu(z)))


class HSpecLayer(nn.Module):
    """A selective scan, optionally attention over [target K/V ‖ the block], then the MLP."""

    def __init__(self, sizes: LayerSizes, state: int, attention: bool):
        super().__init__()
        h, eps = sizes.hidden_size, sizes.rms_norm_eps
        self.scan_norm = RMSNorm(h, eps)
        self.scan = SelectiveScan(h, sizes.num_heads, sizes.head_dim, state, eps)
        self.u0_proj = nn.Linear(h, sizes.num_heads * state * sizes.head_dim, bias=False)
        self.input_layernorm = RMSNorm(h, eps) if attention else None
        self.self_attn = Attention(sizes) if attention else None
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, sizes.intermediate_size)

    def forward(self, x: Tensor, positions: Tensor, summary: Tensor, kv: KV | None,
                mask: Tensor | None) -> Tensor:
        """x [B, A, bs, H] blocks at positions [B, A, bs], summary [B, A, H] (their U₀ source),
        kv: the target's k, v [B, h_kv, S, d] (attention layers), mask [B, 1, A·bs, S + A·bs]."""
        b, a, bs, hid = x.shape
        scan = self.scan
        u0 = self.u0_proj(summary).view(b * a, scan.heads, scan.n, scan.p)
        x = x + self.scan(self.scan_norm(x).view(b * a, bs, hid), u0).view(b, a, bs, hid)
        if self.self_attn is not None:
            hn = self.input_layernorm(x).view(b, a * bs, hid)
            pos = positions.reshape(b, a * bs)
            q = self.self_attn.project_q(hn, pos)
            k, v = self.self_attn.project_kv(hn, pos)
            keys, values = torch.cat([kv[0].to(k.dtype), k], dim=2), torch.cat([kv[1].to(v.dtype), v], dim=2)
            x = x + self.self_attn.attend(q, keys, values, mask).view(b, a, bs, hid)
        return x + self.mlp(self.post_attention_layernorm(x))


class HSpecBackbone(nn.Module):
    """fc + hidden_norm (the summary of the last position's taps), the layers, the final norm."""

    def __init__(self, sizes: LayerSizes, num_taps: int, num_layers: int, attention_layers: int, state: int):
        super().__init__()
        h = sizes.hidden_size
        self.fc = nn.Linear(num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, sizes.rms_norm_eps)
        first_attention = num_layers - attention_layers
        self.layers = nn.ModuleList(HSpecLayer(sizes, state, i >= first_attention) for i in range(num_layers))
        self.norm = RMSNorm(h, sizes.rms_norm_eps)

    def summarize(self, taps: Tensor) -> Tensor:  # [..., n, H] -> [..., H]
        return self.hidden_norm(self.fc(taps.flatten(-2).to(self.fc.weight.dtype)))

    def forward(self, x: Tensor, positions: Tensor, summary: Tensor, kv: list[KV],
                mask: Tensor | None) -> Tensor:
        """x [B, A, bs, H] embedded blocks → z [B, A, bs, H]; kv: one (k, v) per attention layer."""
        it = iter(kv)
        for layer in self.layers:
            x = layer(x, positions, summary, next(it) if layer.self_attn is not None else None, mask)
        return self.norm(x)


@register_drafter("hspec")
class HSpecDrafter(DSparkDrafter):
    """H-Spec: scan from the last position's summary + attention over the target's own K/V."""

    default_num_layers = 4
    default_sample_from_anchor = True

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        cfg = spec.config
        if cfg.carryover or cfg.retrace:
            raise DrafterError("drafter 'hspec' has no carryover rows or recycle gate: set drafter.carryover=false "
                               "and drafter.retrace=false")
        taps = sorted(cfg.layer_ids or [])
        below = [t + 1 for t in taps if t + 1 < spec.target.num_layers]
        deepest = below[-min(3, int(cfg.num_layers)):]
        self.target_kv_layers = list(cfg.kv_layers) if cfg.kv_layers is not None else deepest
        off = [layer for layer in self.target_kv_layers if layer - 1 not in taps or layer >= spec.target.num_layers]
        if not self.target_kv_layers or off:
            raise DrafterError(f"drafter.kv_layers {self.target_kv_layers}: each must be one past a tap of "
                               f"drafter.layer_ids {taps} (its K/V are recomputed from that tap in training) and "
                               f"below the target's {spec.target.num_layers} layers")
        if len(self.target_kv_layers) > int(cfg.num_layers):
            raise DrafterError(f"drafter.kv_layers: {len(self.target_kv_layers)} attention layers, but "
                               f"drafter.num_layers is {cfg.num_layers}")
        if cfg.kv_window < 1 or cfg.ssm_state_size < 1:
            raise DrafterError(f"drafter.kv_window ({cfg.kv_window}) and drafter.ssm_state_size "
                               f"({cfg.ssm_state_size}) must be >= 1")
        super().__init__(spec, shared)

    def build_backbone(self) -> nn.Module:
        return HSpecBackbone(self.sizes, len(self.layer_ids), int(self.cfg.num_layers), len(self.target_kv_layers),
                             int(self.cfg.ssm_state_size))

    def sequential_passes(self, gamma: int) -> int:
        return 1

    def capabilities(self) -> frozenset[Capability]:
        dropped = {Capability.OWN_CONTEXT, Capability.BLOCK_INTERNALS, Capability.HEAD_START, Capability.CARRYOVER,
                   Capability.SLOT_HEADS}  # no DFlash backbone to unroll, copy into or export
        return frozenset(set(super().capabilities()) - dropped | {Capability.TARGET_KV})

    # ---------------------------------------------------------------- training
    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        """Every anchor's block in one pass; the target's K/V recomputed from the taps."""
        t = batch.input_ids.shape[1]
        loss_mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
        anchors = batch.anchors if batch.anchors is not None else sample_anchors(loss_mask, self.cfg.num_anchors, generator)
        bs, dev = self.cfg.block_size, anchors.device
        start = anchors.clamp_min(0)
        where = torch.arange(t, device=dev).view(1, 1, -1)
        visible = (where < start.unsqueeze(-1)) & (where >= (start - self.cfg.kv_window).unsqueeze(-1))  # [B, A, T]
        summary = self.backbone.summarize(gather_positions(batch.hidden, start - 1))  # [B, A, H] taps at a-1
        summary = summary * (start > 0).unsqueeze(-1).to(summary.dtype)  # a block at 0 starts from U₀ = 0
        positions = start.unsqueeze(-1) + torch.arange(bs, device=dev)  # [B, A, bs]
        x = self.embed(self.anchor_blocks(batch.input_ids, anchors)).to(summary.dtype)
        z = self.backbone(x, positions, summary, self.training_kv(batch), blocks_mask(visible, bs))
        return self.block_output(batch, anchors, z, targets)

    def training_kv(self, batch: DraftBatch) -> list[KV]:
        """The target's K/V of ``kv_layers`` at positions 0..T-1, from the taps one layer below."""
        if self.shared.target_kv is None:
            raise DrafterError("drafter 'hspec' trains on the target's K/V, recomputed from its taps: the shared "
                               "target parts carry no K/V projection (build it with the target)")
        b, t = batch.input_ids.shape
        positions = torch.arange(t, device=batch.input_ids.device).expand(b, t)
        return [self.shared.target_kv(layer, batch.hidden[:, :, self.layer_ids.index(layer - 1)], positions)
                for layer in self.target_kv_layers]

    # ---------------------------------------------------------------- inference
    def consume(self, state: DraftState, tokens: Tensor, hidden: Tensor) -> DraftState:
        """Keeps the fused summaries of the last ``TAIL`` positions (and the length): O(1) in context."""
        t = tokens.shape[1]
        new = self.backbone.summarize(hidden[:, -TAIL:])  # [B, ≤TAIL, H]
        feats = new if state.feats is None else torch.cat([state.feats, new], dim=1)[:, -TAIL:]
        return DraftState(state.length + t, [], feats)

    def consume_many(self, states: list[DraftState], tokens: list[Tensor], hidden: list[Tensor]) -> list[DraftState]:
        return [self.consume(s, t, h) for s, t, h in zip(states, tokens, hidden)]

    def rollback(self, state: DraftState, length: int) -> DraftState:
        drop = state.length - length
        kept = state.feats.shape[1] if state.feats is not None else 0
        if not 0 <= length <= state.length:
            raise DrafterError(f"rollback to {length} outside the committed context 0..{state.length}")
        if length > 0 and drop >= kept:
            raise DrafterError(f"rollback of {drop} positions: drafter 'hspec' keeps the last {kept} only (TAIL)")
        return DraftState(length, [], state.feats[:, :kept - drop] if length > 0 else None)

    def with_target_kv(self, state: DraftState, kv: TargetKV) -> DraftState:
        """The state reading ``kv`` (the target's K/V of ``target_kv_layers``, views of its cache)."""
        if list(kv.layers) != self.target_kv_layers:
            raise DrafterError(f"hspec reads target layers {self.target_kv_layers}, was handed {list(kv.layers)}")
        k = kv.kv[0][0]
        s = self.sizes
        if k.shape[1] != s.num_kv_heads or k.shape[3] != s.head_dim:
            raise DrafterError(f"hspec's attention has {s.num_kv_heads} K/V heads of {s.head_dim}; the target's "
                               f"cache has {k.shape[1]} of {k.shape[3]} (leave drafter.num_kv_heads/head_dim unset)")
        return DraftState(state.length, state.kv, state.feats, target_kv=kv)

    def block_runner(self, state: DraftState, rows: int) -> Callable[[Tensor], Tensor]:
        """One pass over a block at the state's next positions: ids [rows, bs] → z [rows, bs, H]."""
        kv, seen = self._window(state)
        bs = self.cfg.block_size
        positions = state.length + torch.arange(bs).expand(rows, 1, bs)
        mask = None if seen is None else torch.cat([seen, seen.new_ones(rows, bs)], 1)[:, None, None].expand(rows, 1, bs, -1)
        summary = self._summary(state)
        return lambda ids: self.backbone(self.embed(ids)[:, None].to(summary.dtype), positions.to(ids.device),
                                         summary, kv, mask)[:, 0]

    def rows_runner(self, states: list[DraftState], dev: torch.device) -> Callable[[Tensor], Tensor]:
        """``block_runner`` for many batch-1 states: their windows right-padded into one tensor, masked."""
        windows = [self._window(s) for s in states]
        bs, r, masks = self.cfg.block_size, len(states), [None if m is None else m[0] for _, m in windows]
        padded: list[KV] = []
        for j in range(len(self.target_kv_layers)):  # every layer's window spans the same slots
            kv, seen = pad_kv_rows([w[j] for w, _ in windows], dev, masks)  # [R, h_kv, W, d]; [R, W]
            padded.append(kv)
        width = seen.shape[1]
        mask = torch.cat([seen, seen.new_ones(r, bs)], 1)[:, None, None].expand(r, 1, bs, width + bs)
        positions = torch.tensor([s.length for s in states], device=dev)[:, None, None] + torch.arange(bs, device=dev)
        summary = torch.cat([self._summary(s) for s in states])
        return lambda ids: self.backbone(self.embed(ids)[:, None].to(summary.dtype), positions, summary, padded,
                                         mask)[:, 0]

    def _summary(self, state: DraftState) -> Tensor:  # -> [B, 1, H] the last committed position's
        if state.feats is None:
            raise DrafterError("drafter 'hspec' drafts after a context: consume the prompt first")
        return state.feats[:, -1:]

    def _window(self, state: DraftState) -> tuple[list[KV], Tensor | None]:
        """The target's K/V the block reads (the last ``kv_window`` committed slots) and which of
        those slots are committed ([B, S] bool; None: all)."""
        kv = state.target_kv
        if kv is None:
            raise DrafterError("drafter 'hspec' reads the target's K/V cache: attach it before propose with "
                               "with_target_kv (the engines do, Capability.TARGET_KV)")
        w = self.cfg.kv_window
        if kv.valid is None:
            return [(k[:, :, -w:], v[:, :, -w:]) for k, v in kv.kv], None
        later = kv.valid.flip(-1).cumsum(-1).flip(-1)  # [B, S]: committed slots at or after each
        return list(kv.kv), kv.valid & (later <= w)
