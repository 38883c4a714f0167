"""DFlash: a parallel block drafter; also the backbone that DSpark extends.

Backbone (reference/dspark-dflash-facts.md §1): the target taps [B, T, n, H] are fused by
``fc`` (n·H → H) + ``hidden_norm`` once; every draft layer projects the fused context with its
own k/v proj (+ k_norm, RoPE at absolute positions) and its block queries attend to
[context keys < anchor position ‖ the whole block, bidirectionally]. A block is
[last verified token, mask × (block_size − 1)] at positions anchor + 0..block_size−1, embedded
with the target's frozen table; the drafter's own ``norm`` then the shared LM head give logits.
One backbone pass drafts a whole block.

Readout layout (``sample_from_anchor``): True (DeepSpec) = slot k predicts x_{anchor+k+1},
γ = block_size; False (z-lab / vLLM ``dflash``, DFlash's default) = slots 1.. predict
x_{anchor+k}, γ = block_size − 1. Either way draft j predicts x_{anchor+j+1}.

Inference keeps only committed context K/V (``DraftState.kv``); block K/V never persist, so
rollback is a crop. With a draft vocabulary (``drafter.vocab``) the readout is over it and
proposals come back in target ids. Knows nothing about losses, verification or engines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from components.config import DrafterConfig
from components.drafters.base import (
    DEFAULT_SAMPLING,
    DraftBatch,
    Drafter,
    DrafterError,
    DrafterSpec,
    DraftState,
    DraftTrainOutput,
    Proposal,
    Recycled,
    SharedParts,
    gather_positions,
    is_greedy,
    row_settings,
    train_output,
)
from components.drafters.capabilities import Capability
from components.drafters.layers import (
    KV,
    DecoderLayer,
    LayerSizes,
    RMSNorm,
    init_weights,
    pad_kv_rows,
)
from components.drafters.registry import register_drafter
from components.drafters.retrace import RecycleGate, align, stack_recycled
from components.spec.sampling import SamplingParams


class BlockBackbone(nn.Module):
    """fc + hidden_norm fusion, decoder layers with context K/V, final norm."""

    def __init__(self, sizes: LayerSizes, num_taps: int, num_layers: int):
        super().__init__()
        h = sizes.hidden_size
        self.fc = nn.Linear(num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, sizes.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(sizes) for _ in range(num_layers))
        self.norm = RMSNorm(h, sizes.rms_norm_eps)
        # (x [Q, H], start, context) -> the layers' output [Q, H] or None: a batch-1 block's layers
        # in one fused call each (``use_layer_kernel``); None: torch's layers
        self.layer_kernel: Callable[[Tensor, int, list[KV]], Tensor | None] | None = None

    def fuse(self, hidden: Tensor) -> Tensor:  # taps [B, T, n, H] -> context features [B, T, H]
        return self.hidden_norm(self.fc(hidden.flatten(2)))

    def features_kv(self, feats: Tensor, positions: Tensor) -> list[KV]:
        """Per-layer context K/V [B, h_kv, T, d] from context features [B, T, H] at positions [B, T]."""
        return [layer.self_attn.project_kv(feats, positions) for layer in self.layers]

    def context_kv(self, hidden: Tensor, positions: Tensor) -> list[KV]:
        """Per-layer context K/V [B, h_kv, T, d] from taps hidden [B, T, n, H] at positions [B, T]."""
        return self.features_kv(self.fuse(hidden), positions)

    def forward(
        self,
        x: Tensor,  # [B, Q, H] embedded block tokens
        positions: Tensor,  # [B, Q] absolute positions
        context: list[KV],  # per layer k, v [B, h_kv, S, d]; [] = no context
        mask: Tensor | None,  # [B, 1, Q, S + Q] bool, or None = attend to everything
    ) -> Tensor:  # [B, Q, H] final-normed block states z
        if self.layer_kernel is not None and x.shape[0] == 1 and mask is None:  # a batch-1 draft block
            out = self.layer_kernel(x[0], int(positions[0, 0]), context)
            if out is not None:
                return self.norm(out[None])
        for i, layer in enumerate(self.layers):
            x, _ = layer(x, positions, context[i] if context else None, mask)
        return self.norm(x)


def blocks_mask(visible: Tensor, block_size: int) -> Tensor:
    """visible [B, A, S] bool (context rows block a may read) → [B, 1, A·bs, S + A·bs] bool:
    each block's queries see their visible context rows and their own block, bidirectionally."""
    b, a, _ = visible.shape
    block_of = torch.arange(a, device=visible.device).repeat_interleave(block_size)  # [A·bs]
    ctx = visible.repeat_interleave(block_size, dim=1)  # [B, A·bs, S]
    own = (block_of.view(-1, 1) == block_of.view(1, -1)).expand(b, -1, -1)  # [B, Q, Q]
    return torch.cat([ctx, own], dim=-1).unsqueeze(1)


def sample_anchors(
    loss_mask: Tensor,  # [B, T] bool
    num_anchors: int,
    generator: torch.Generator | None = None,
) -> Tensor:  # [B, A] long, sorted, -1 = unused
    """Uniform anchors a without replacement among positions whose next token is supervised."""
    b, t = loss_mask.shape
    cand = loss_mask[:, 1:].bool()  # anchor a predicts x_{a+1} first
    a = min(num_anchors, t - 1)
    scores = torch.rand(b, t - 1, generator=generator, device=loss_mask.device)
    scores = torch.where(cand, scores, torch.full_like(scores, -1.0))
    top, idx = scores.topk(a, dim=1)
    idx = torch.where(top >= 0, idx, torch.full_like(idx, t))  # unused sort last
    idx = idx.sort(dim=1).values
    return torch.where(idx < t, idx, torch.full_like(idx, -1))


@register_drafter("dflash")
class DFlashDrafter(Drafter):
    """DFlash: the block backbone with independent (parallel) sampling of every slot."""

    default_num_layers = 5
    default_sample_from_anchor = False

    def __init__(self, spec: DrafterSpec, shared: SharedParts):
        super().__init__(spec, shared)
        if self.cfg.mask_token_id is None:
            raise DrafterError(f"drafter '{self.cfg.name}' needs a mask token: set drafter.mask_token_id "
                               "or use a tokenizer with a mask token")
        if self.cfg.block_size < 2:
            raise DrafterError(f"drafter.block_size must be >= 2, got {self.cfg.block_size}")
        self.backbone = self.build_backbone()
        init_weights(self)
        if self.cfg.carryover:  # E_carry [n·H], added to rejected target taps before fc; zero = no-op
            self.carry_embed = nn.Parameter(torch.zeros(self.backbone.fc.in_features))
        if self.cfg.retrace:  # the rejected suffix's gated residual into the block inputs; zero = no-op
            self.recycle = RecycleGate(self.sizes.hidden_size, self.sizes.rms_norm_eps)

    def build_backbone(self) -> nn.Module:
        """The block backbone (drafters with another backbone over DFlash's block layout override it)."""
        return BlockBackbone(self.sizes, len(self.layer_ids), int(self.cfg.num_layers))

    @staticmethod
    def default_num_speculative_tokens(cfg: DrafterConfig) -> int:
        return cfg.block_size - (0 if cfg.sample_from_anchor else 1)

    @staticmethod
    def max_speculative_tokens_for(cfg: DrafterConfig) -> int | None:
        return cfg.block_size - (0 if cfg.sample_from_anchor else 1)  # one block's draft slots

    @property
    def first_slot(self) -> int:
        return 0 if self.cfg.sample_from_anchor else 1

    @property
    def max_speculative_tokens(self) -> int:
        """Draft slots of one block: the most one round (one DLoop stage) drafts."""
        return self.cfg.block_size - self.first_slot

    def sequential_passes(self, gamma: int) -> int:
        return math.ceil(gamma / self.max_speculative_tokens)

    # ---------------------------------------------------------------- training
    def training_forward(self, batch: DraftBatch, generator: torch.Generator | None = None,
                         targets: bool = True) -> DraftTrainOutput:
        anchors, context, visible = self.block_inputs(batch, generator)
        z = self.block_states(batch.input_ids, anchors, context, visible)  # [B, A, bs, H]
        return self.block_output(batch, anchors, z, targets)

    def block_inputs(self, batch: DraftBatch, generator: torch.Generator | None = None) -> tuple[Tensor, list[KV], Tensor]:
        """The batch's anchors [B, A] (given, else sampled), the target's context K/V per layer and
        which context rows each block reads, visible [B, A, T] (those before its anchor)."""
        t = batch.input_ids.shape[1]
        loss_mask = batch.loss_mask if batch.loss_mask is not None else torch.ones_like(batch.input_ids, dtype=torch.bool)
        anchors = batch.anchors if batch.anchors is not None else sample_anchors(loss_mask, self.cfg.num_anchors, generator)
        visible = torch.arange(t, device=anchors.device).view(1, 1, -1) < anchors.clamp_min(0).unsqueeze(-1)
        return anchors, self.target_context(batch.hidden), visible

    # Block-level pieces, public so that training objectives (DLoop stages, carryover) can put
    # other context rows beside the target's: the drafter's own states, rejected target states.
    def target_context(self, hidden: Tensor) -> list[KV]:
        """Context K/V of target taps hidden [B, T, n, H] at positions 0..T-1."""
        b, t = hidden.shape[:2]
        positions = torch.arange(t, device=hidden.device).expand(b, t)
        return self.backbone.context_kv(hidden.to(self.backbone.fc.weight.dtype), positions)

    def block_states(self, input_ids: Tensor, anchors: Tensor, context: list[KV], visible: Tensor,
                     block_ids: Tensor | None = None, recycled: Recycled | None = None) -> Tensor:
        """Every anchor's block in one backbone pass → z [B, A, bs, H].

        input_ids [B, T] (block slot 0 = the token at the anchor), anchors [B, A] (-1 unused),
        context per layer K/V [B, h_kv, S, d], visible [B, A, S] bool: rows block a may read;
        block_ids [B, A, bs]: the blocks' input tokens (default ``anchor_blocks``: anchor, masks);
        recycled (ReTrace, states [B, A, bs, H]): rejected drafts fused into the inputs."""
        b, a = anchors.shape
        bs = self.cfg.block_size
        ids = block_ids if block_ids is not None else self.anchor_blocks(input_ids, anchors)
        positions = anchors.clamp_min(0).unsqueeze(-1) + torch.arange(bs, device=anchors.device)
        mask = blocks_mask(visible, bs)
        x = self.block_embed(ids, recycled)  # [B, A, bs, H]
        z = self.backbone(x.view(b, a * bs, -1), positions.view(b, a * bs), context, mask)
        return z.view(b, a, bs, -1)

    def block_embed(self, ids: Tensor, recycled: Recycled | None) -> Tensor:
        """Block input tokens [..., bs] → embeddings [..., bs, H], with any recycled drafts fused in."""
        x = self.embed(ids)
        return x if recycled is None else self.recycle(x, recycled)

    def anchor_blocks(self, input_ids: Tensor, anchors: Tensor) -> Tensor:
        """[B, T], anchors [B, A] → the blocks' input tokens [B, A, bs]: the anchor's token, masks."""
        anchor_tok = gather_positions(input_ids, anchors)
        anchor_tok = torch.where(anchors >= 0, anchor_tok, torch.full_like(anchor_tok, self.cfg.mask_token_id))
        ids = torch.full((*anchors.shape, self.cfg.block_size), int(self.cfg.mask_token_id), dtype=torch.long,
                         device=input_ids.device)
        ids[:, :, 0] = anchor_tok
        return ids

    def draft_states(self, z: Tensor) -> Tensor:
        """z [B, A, bs, H] → the states of the γ draft slots [B, A, γ, H] (draft j → x_{a+j+1})."""
        return z[:, :, self.first_slot:self.first_slot + self.max_speculative_tokens]

    def block_output(self, batch: DraftBatch, anchors: Tensor, z: Tensor, targets: bool = True) -> DraftTrainOutput:
        """Teacher-forced readout of blocks z [B, A, bs, H] at anchors [B, A], with their targets
        (``targets=False``: data tokens and validity only, no target logits)."""
        gamma = self.max_speculative_tokens
        zd = self.draft_states(z).reshape(-1, gamma, z.shape[-1])  # [N, γ, H]
        prev_pos = anchors.clamp_min(0).unsqueeze(-1) + torch.arange(gamma, device=anchors.device)
        prev = gather_positions(batch.input_ids, prev_pos).reshape(-1, gamma)  # [N, γ] x_{a+j}
        logits, conf, base = self.train_readout_base(zd, prev)
        return train_output(logits, batch, anchors, self.shared, targets, self.vocab, conf, base)

    def train_readout(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None]:
        """z [N, γ, H], previous target tokens prev [N, γ] → logits [N, γ, R], confidence [N, γ] | None."""
        return self.lm_head(z), None

    def train_readout_base(self, z: Tensor, prev: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``train_readout`` plus the backbone's own logits [N, γ, R] before a causal head (None
        without one; drafters that have one declare ``Capability.BASE_LOGITS``)."""
        return (*self.train_readout(z, prev), None)

    # ---------------------------------------------------------------- inference
    def consume(self, state: DraftState, tokens: Tensor, hidden: Tensor) -> DraftState:
        b, t = tokens.shape
        positions = state.length + torch.arange(t, device=tokens.device).expand(b, t)
        new = self.backbone.context_kv(hidden.to(self.backbone.fc.weight.dtype), positions)
        if state.kv:
            new = [(torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(state.kv, new)]
        return DraftState(state.length + t, new, None)

    def consume_many(self, states: list[DraftState], tokens: list[Tensor], hidden: list[Tensor]) -> list[DraftState]:
        """``consume`` for many batch-1 states at once (the batch engine's rows): one context
        projection over the rows' new positions, padded to the longest (tokens[i] [1, t_i],
        hidden[i] [1, t_i, n, H]); each state keeps only its own t_i rows."""
        if len(states) == 1:  # nothing to pad: the batch-1 path, without copying the taps
            return [self.consume(states[0], tokens[0], hidden[0])]
        lens = [t.shape[1] for t in tokens]
        width, dev = max(lens), tokens[0].device
        taps = torch.zeros(len(states), width, *hidden[0].shape[2:], dtype=hidden[0].dtype, device=dev)
        for i, h in enumerate(hidden):
            taps[i, :lens[i]] = h[0]
        starts = torch.tensor([s.length for s in states], device=dev)
        positions = starts[:, None] + torch.arange(width, device=dev)[None, :]  # [R, width]
        new = self.backbone.context_kv(taps.to(self.backbone.fc.weight.dtype), positions)  # per layer [R, h, w, d]
        out = []
        for i, (state, t) in enumerate(zip(states, lens)):
            rows = [(k[i:i + 1, :, :t], v[i:i + 1, :, :t]) for k, v in new]
            if state.kv:
                rows = [(torch.cat([k0, k], 2), torch.cat([v0, v], 2)) for (k0, v0), (k, v) in zip(state.kv, rows)]
            out.append(DraftState(state.length + t, rows, None))
        return out

    def propose(self, state: DraftState, last_token: Tensor, sampling: SamplingParams = DEFAULT_SAMPLING,
                generator: torch.Generator | None = None, num_speculative_tokens: int | None = None) -> Proposal:
        gamma = self.check_gamma(num_speculative_tokens or self.max_speculative_tokens)
        z = self.block_runner(state, last_token.shape[0])(self.mask_block(last_token))
        z = z[:, self.first_slot:self.first_slot + gamma]  # [B, γ, H]
        proposal = self.sample_readout(z, last_token, sampling, generator)
        proposal.states = z
        return proposal

    def propose_many(self, states: list[DraftState], last_tokens: Tensor,
                     sampling: SamplingParams | list[SamplingParams], num_speculative_tokens: int | list[int] | None = None,
                     generators: list[torch.Generator | None] | None = None) -> list[Proposal]:
        """``propose`` for many batch-1 states in ONE backbone pass (the batch engine's rows):
        contexts of different lengths are right-padded and masked. last_tokens [R]. ``sampling``
        is shared or one per row; with ``generators`` (one per row) each row's readout draws
        from its own generator, as ``propose`` for that row alone would. ``num_speculative_tokens`` is shared
        or one per row; each row's proposal has its own γ (all-greedy rows, which use no
        randomness, are read out together at the longest γ and then cut)."""
        per_row, samplings, gens = row_settings(len(states), sampling, num_speculative_tokens, generators, self.max_speculative_tokens)
        gamma = self.check_gamma(max(per_row))
        z = self.rows_runner(states, last_tokens.device)(self.mask_block(last_tokens))[:, self.first_slot:self.first_slot + gamma]
        if all(is_greedy(s) for s in samplings):
            prop = self.sample_readout(z, last_tokens, samplings[0], None)
            prop.states = z
            return [prop.rows(i, g) for i, g in enumerate(per_row)]
        props = [self.sample_readout(z[i:i + 1, :per_row[i]], last_tokens[i:i + 1], samplings[i], gens[i])
                 for i in range(len(states))]
        for i, prop in enumerate(props):
            prop.states = z[i:i + 1, :per_row[i]]
        return props

    def check_gamma(self, gamma: int) -> int:
        if gamma > self.max_speculative_tokens:
            raise DrafterError(f"{self.cfg.name} drafts at most {self.max_speculative_tokens} tokens per block, asked {gamma}")
        return gamma

    def mask_block(self, last_tokens: Tensor) -> Tensor:
        """last_tokens [R] → the round's first block [R, bs]: the last verified token, then masks."""
        ids = torch.full((last_tokens.shape[0], self.cfg.block_size), int(self.cfg.mask_token_id), dtype=torch.long,
                         device=last_tokens.device)
        ids[:, 0] = last_tokens
        return ids

    def block_runner(self, state: DraftState, rows: int) -> Callable[[Tensor], Tensor]:
        """One backbone pass over a block at the state's next positions: ids [rows, bs] → z [rows, bs, H]
        (drafters that run several passes per round reuse it with other block tokens)."""
        bs, context = self.cfg.block_size, self.propose_context(state)
        positions = state.length + torch.arange(bs).expand(rows, bs)
        return lambda ids: self.backbone(self.block_embed(ids, state.recycled), positions.to(ids.device), context, None)

    def rows_runner(self, states: list[DraftState], dev: torch.device) -> Callable[[Tensor], Tensor]:
        """``block_runner`` for many batch-1 states at once: their contexts right-padded and masked
        (one state: ``block_runner`` itself, its context read in place, unpadded)."""
        if len(states) == 1:
            return self.block_runner(states[0], 1)
        ctxs = [self.propose_context(s) for s in states]  # per row: per layer (k, v) [1, h, L_r, d]
        bs, r = self.cfg.block_size, len(states)
        padded = [pad_kv_rows([c[layer] for c in ctxs], dev) for layer in range(len(ctxs[0]))]
        context, seen = [kv for kv, _ in padded], padded[0][1]  # per layer [R, h, W, d]; [R, W]
        width = seen.shape[1]
        mask = torch.cat([seen, seen.new_ones(r, bs)], dim=1)[:, None, None, :].expand(r, 1, bs, width + bs)
        starts = torch.tensor([s.length for s in states], device=dev)
        positions = starts[:, None] + torch.arange(bs, device=dev)[None, :]  # [R, bs]
        recycled = stack_recycled([s.recycled for s in states], bs, self.sizes.hidden_size, dev)
        return lambda ids: self.backbone(self.block_embed(ids, recycled), positions, context, mask)

    def kernel_layers(self) -> tuple[list[nn.Module], LayerSizes]:
        """The block's decoder layers and their sizes, for a fused layer call (``use_layer_kernel``)."""
        return list(self.backbone.layers), self.sizes

    def identity(self) -> str:
        """As every drafter's, and whether its block layers run fused (which changes its time)."""
        return super().identity() + (":fused" if self.backbone.layer_kernel is not None else "")

    def use_layer_kernel(self, run: Callable[[Tensor, int, list[KV]], Tensor | None] | None) -> None:
        """Batch-1 draft blocks (no grad, no mask) run their layers through ``run`` (e.g. the fast
        step's kernel: ``target.draft_layers``), which may decline a call (None: torch's layers);
        None restores torch's layers everywhere. Drafts may change by the rounding, not output."""
        self.backbone.layer_kernel = run

    def propose_context(self, state: DraftState) -> list[KV]:
        """The K/V a block reads: committed rows [B, h_kv, length, d] then any carryover rows
        [B, h_kv, carry_rows, d] (batch 1: the block sees all of them, no mask needed)."""
        if not state.carry_rows or not state.carry:
            return state.kv
        if not state.kv:
            return state.carry
        return [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(state.kv, state.carry)]

    def capabilities(self) -> frozenset[Capability]:
        caps = {Capability.BATCHED_PROPOSE, Capability.BATCHED_CONSUME, Capability.OWN_CONTEXT,
                Capability.BLOCK_INTERNALS, Capability.HEAD_START, Capability.ROUND_LIMIT}
        if self.cfg.carryover:  # carry_embed exists only then
            caps.add(Capability.CARRYOVER)
        if self.cfg.retrace:  # the recycle gate exists only then
            caps.add(Capability.RECYCLES)
        if isinstance(self.backbone, BlockBackbone) and all(type(layer) is DecoderLayer for layer in self.backbone.layers):
            caps.add(Capability.LAYER_KERNEL)  # plain layers (not DFlash2's convolutions)
        return frozenset(caps)

    def with_recycled(self, state: DraftState, proposal: Proposal, accepted: int, next_token: Tensor) -> DraftState:
        """ReTrace: the state plus this round's rejected drafts (``proposal.states`` [B, G, H] and
        tokens [B, G], ``accepted`` of them accepted, ``next_token`` [B] the target's correction),
        aligned with the next block's slots (``retrace.align``); none after a full accept or
        without slot states (a multi-stage round)."""
        if Capability.RECYCLES not in self.capabilities():
            raise DrafterError(f"drafter '{self.cfg.name}' has no recycle gate: build or load it with "
                               "drafter.retrace=true (and train it with the 'retrace' objective)")
        g = proposal.tokens.shape[1]
        if proposal.states is None or accepted >= g:
            return dataclasses.replace(state, recycled=None)
        m = torch.full(proposal.tokens.shape[:1], accepted, dtype=torch.long, device=proposal.tokens.device)
        rec = align(proposal.states, proposal.tokens, m, next_token, self.cfg.block_size, self.first_slot, self.embed)
        return dataclasses.replace(state, recycled=rec)

    @torch.no_grad()
    def head_start(self, model: nn.Module) -> None:
        """Initialises the backbone from the target ``model`` (an HF Llama/Qwen3-style decoder):
        draft layer i ← target layer L − n + i (norms, q/k/v/o, MLP; q/k norms where the target
        has them, else they stay ones), ``fc`` passes the deepest tap through (identity on its
        slice, zero elsewhere), ``hidden_norm`` ← the first copied layer's input norm (the norm
        the target applies before that layer's k/v), ``norm`` ← the target's final norm. So a
        block's first slot starts as the target's last layers reading the target's own states."""
        layers, n = model.model.layers, len(self.backbone.layers)
        if n > len(layers):
            raise DrafterError(f"drafter.init_from_target: {n} draft layers, the target has {len(layers)}")
        for mine, theirs in zip(self.backbone.layers, layers[len(layers) - n:]):
            state = {k: v for k, v in theirs.state_dict().items() if "rotary" not in k}
            own = mine.state_dict()
            bad = [f"{k} {tuple(v.shape)} vs {tuple(own[k].shape)}" for k, v in state.items()
                   if k in own and v.shape != own[k].shape]
            unknown = sorted(set(state) - set(own))
            if bad or unknown:
                raise DrafterError(f"drafter.init_from_target: the draft layers are not the target's shape "
                                   f"({'; '.join(bad[:3]) or 'unknown weights ' + ', '.join(unknown[:3])}); drop the "
                                   "drafter size overrides or set drafter.init_from_target: false")
            mine.load_state_dict(state, strict=False)  # q_norm/k_norm missing on Llama targets: kept ones
        h = self.sizes.hidden_size
        deepest = max(range(len(self.layer_ids)), key=lambda i: self.layer_ids[i])
        self.backbone.fc.weight.zero_()
        self.backbone.fc.weight[:, deepest * h:(deepest + 1) * h] = torch.eye(h)
        self.backbone.hidden_norm.weight.copy_(self.backbone.layers[0].input_layernorm.weight)
        self.backbone.norm.weight.copy_(model.model.norm.weight)

    def with_carry(self, state: DraftState, hidden_rej: Tensor, start_position: int) -> DraftState:
        """Carryover rows from the target taps hidden_rej [B, k, n, H] of rejected drafts:
        ``features_kv(fuse(hidden_rej + E_carry))`` at positions start_position..+k-1, exactly as
        the carryover objective builds them; any earlier carry is replaced, k = 0 clears it. The
        rest of ``state`` (target K/V views, recycled drafts) is kept."""
        if Capability.CARRYOVER not in self.capabilities():
            raise DrafterError(f"drafter '{self.cfg.name}' has no carryover embedding: build or load it with "
                               "drafter.carryover=true (and train it with the 'carryover' objective)")
        b, k, n, h = hidden_rej.shape
        if k > self.max_speculative_tokens:
            raise DrafterError(f"carryover context is bounded by one block ({self.max_speculative_tokens} rows), got {k}")
        if k == 0:
            return dataclasses.replace(state, carry=None, carry_rows=0)
        x = hidden_rej.to(self.backbone.fc.weight.dtype) + self.carry_embed.view(n, h)  # [B, k, n, H]
        positions = start_position + torch.arange(k, device=hidden_rej.device).expand(b, k)
        carry = self.backbone.features_kv(self.backbone.fuse(x), positions)
        return dataclasses.replace(state, carry=carry, carry_rows=k)

    def consume_own(self, state: DraftState, states: Tensor) -> DraftState:
        """DLoop: the draft slots' own states [B, k, H] become context rows at positions
        state.length.. (in the fused-feature slot, as if they were target features); rollback
        crops them like any other row. Carryover rows are dropped: only the round's first stage
        (the re-draft block the carryover objective trains) reads them; later stages see the
        committed and own rows, as DLoop trains them."""
        b, k = states.shape[:2]
        positions = state.length + torch.arange(k, device=states.device).expand(b, k)
        new = self.backbone.features_kv(states.to(self.backbone.fc.weight.dtype), positions)
        if state.kv:
            new = [(torch.cat([k0, k1], 2), torch.cat([v0, v1], 2)) for (k0, v0), (k1, v1) in zip(state.kv, new)]
        return DraftState(state.length + k, new, None)

    def sample_readout(self, z: Tensor, last_token: Tensor, sampling: SamplingParams,
                       generator: torch.Generator | None) -> Proposal:
        """z [B, γ, H], last_token [B] → a proposal; DFlash samples every slot independently."""
        logits = self.lm_head(z)  # [B, γ, R]
        tokens, probs = self.draw(logits, sampling, generator)
        return self.proposal(tokens, logits, probs)
