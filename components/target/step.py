"""The target's decoding step as plain PyTorch over a static KV slab, compiled once per shape.

A decode step must read every weight once; an eager HF forward adds per-op dispatch, a growing
cache and kernels that price a k-row product far above a one-row one (docs/results.md). This
module re-expresses the decoder of a Llama-family target (Llama, Mistral-style GQA, Qwen3's
q/k norms) over the HF model's *own* weight tensors (shared, never copied), gpt-fast style:

    StaticDecoder.forward(ids [B, T], pos [B, T], slots [T], mask [B, 1, T, S], k, v)
        -> logits [B, T, V], taps [B, T, n, H], last [B, T, H]

``k``/``v`` are the slab, one [B, h_kv, S, d] per layer, written in place at ``slots``; ``pos``
are the logical positions RoPE sees; ``mask`` says which of the S slots each query may read.
Every shape is fixed for a (rows, new tokens) bucket, so ``torch.compile`` (inductor) builds
one graph per bucket and never recompiles mid-request: ``StepTarget`` pads a pass of T new
tokens up to the smallest bucket that holds it (the pad's queries write slots past the real
ones, which no query reads before a real token overwrites them) and runs longer passes (the
prefill) through the same module uncompiled.

``StepTarget`` is a ``Target`` whose ``forward`` keeps its KV cache in a ``StaticCache`` (which
engines crop exactly like HF caches: ``get_seq_length``, ``crop(-n)``). It serves batch-1
chains (the plain baseline, the chain engine with any drafter); the tree engine and the batch
engine keep HF caches (they reorder and gather cache rows) and take the plain ``Target``.

Knows the HF Llama/Qwen3 module layout (``self_attn.{q,k,v,o}_proj``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, optional ``self_attn.{q,k}_norm``) and the
model's own rotary embedding; nothing about drafters, rules or engines. Compilation itself
(buckets, warm-up, the on-disk cache, falling back to eager) is ``components.target.compiled``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FAMILIES = ("llama", "mistral", "qwen3")  # model_type values whose layers this decoder knows


class StepUnsupported(ValueError):
    """The target's architecture is not one this decoder re-expresses; the message says why."""


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    eps: float
    qk_norm: bool


def decoder_shape(model: Any) -> Shape:
    """The decoder's shape, or ``StepUnsupported`` for a model this module does not know."""
    cfg = model.config
    kind = getattr(cfg, "model_type", "?")
    if kind not in FAMILIES:
        raise StepUnsupported(f"model_type '{kind}' is not one of {list(FAMILIES)}")
    layer = model.model.layers[0]
    attn = layer.self_attn
    projections = [getattr(attn, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    projections += [getattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj")]
    if any(p.bias is not None for p in projections):
        raise StepUnsupported(f"{kind}: projections with bias")
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", kind == "mistral"):
        raise StepUnsupported(f"{kind}: sliding-window attention")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        raise StepUnsupported(f"{kind}: activation {cfg.hidden_act} (only silu)")
    heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    return Shape(len(model.model.layers), heads, kv, head_dim, int(cfg.hidden_size), float(cfg.rms_norm_eps),
                 hasattr(attn, "q_norm"))


def _rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as HF computes it (in float32, then back to the input dtype)."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [B, T, h, d], cos/sin [B, T, 1, d]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class StaticDecoder(nn.Module):
    """The target's decoder for a static KV slab of ``capacity`` slots, eager, built for a
    decode step's few rows: per layer one product for q/k/v and one for gate/up (their weights
    concatenated once, a copy: the other weights are the model's own tensors), RoPE on q and k
    together, attention over the live slots only. ``taps``: the decoder layers (0-based) whose
    outputs every forward returns, in order."""

    def __init__(self, model: Any, taps: Sequence[int], capacity: int,
                 gemm: Callable[[Tensor, Any], Tensor] | None = None, kernels: Any = None):
        """``gemm(x [..., K], w) → [..., N]``: the weight products (default ``F.linear``; the fast
        step's streams the weights at the memory's pace). Where ``gemm`` has a ``prepare(w [N, K])``,
        every weight is passed through it once, here, and ``gemm`` gets what it returned (e.g. the
        weight packed for the kernel: a copy). ``kernels`` (a ``kernels.RowsGemm``, with a ``gemm``
        that packs): one sequence's float32 passes run each layer in one call."""
        super().__init__()
        self.gemm = gemm or F.linear
        self.kernels = kernels
        self.prefill_threads = 0  # the kernels' threads in a prompt's pass (0: torch's, as every other pass)
        prepare = getattr(self.gemm, "prepare", None) or (lambda w: w)
        self.shape = s = decoder_shape(model)
        self.taps = tuple(int(t) for t in taps)
        self.capacity = capacity
        inner = model.model
        self.embed, self.head = inner.embed_tokens, model.get_output_embeddings()
        self.final_norm = inner.norm.weight
        self.layers = [_Layer.of(layer, s, prepare) for layer in inner.layers]
        self.head_weight = prepare(self.head.weight)
        # RoPE tables for every slot position, from the model's own rotary embedding (its
        # scaling rules included): cos/sin [capacity, d]
        w = self.embed.weight
        cos, sin = inner.rotary_emb(w.new_zeros(1, 1, s.hidden), torch.arange(capacity, device=w.device).unsqueeze(0))
        self.cos, self.sin = cos[0].to(w.dtype).contiguous(), sin[0].to(w.dtype).contiguous()

    def new_slab(self, rows: int, slots: int | None = None) -> tuple[list[Tensor], list[Tensor]]:
        """Keys and values, one [rows, h_kv, slots, d] per layer (default: ``capacity`` slots, at
        most that many), uninitialised: a pass writes its slots start..end-1 before it reads
        slots 0..end-1, so no slot is read unwritten (and a request does not pay for zeroing
        the whole slab)."""
        s, w = self.shape, self.embed.weight
        size = (rows, s.kv_heads, min(slots or self.capacity, self.capacity), s.head_dim)
        return [w.new_empty(size) for _ in range(s.layers)], [w.new_empty(size) for _ in range(s.layers)]

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, self.shape.eps)
        return _rms(x, weight, self.shape.eps)

    def forward(self, ids: Tensor, pos: Tensor, start: int, mask: Tensor | None, k: list[Tensor],
                v: list[Tensor], last_only: bool = False, threads: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """ids/pos [B, T] (pos: the positions RoPE sees), the T new keys/values written at slots
        start..start+T-1 of k/v (per layer [B, h_kv, S, d]); queries read slots 0..start+T-1 under
        ``mask`` [B, 1, T, start+T] bool (None: T = 1, every slot) → logits [B, T, V] ([B, 1, V]
        of the last token with ``last_only``: a prefill's), taps [B, T, n, H] (n = len(taps), 0
        allowed), last [B, T, H]. ``threads``: the kernels' (0: torch's); each output element is
        computed by one thread in one order, so any count gives the same bits."""
        s = self.shape
        b, t = ids.shape
        if self.kernels is not None and b == 1 and self.embed.weight.dtype == torch.float32:
            return self._forward_kernels(ids, start, k, v, last_only, threads)
        end = start + t
        heads = s.heads + s.kv_heads
        cos, sin = self.cos[pos].unsqueeze(2), self.sin[pos].unsqueeze(2)  # [B, T, 1, d]
        x = self.embed(ids)  # [B, T, H]
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            qkv = self.gemm(self._norm(x, layer.norm1), layer.qkv).view(b, t, heads + s.kv_heads, s.head_dim)
            qk, vv = qkv[:, :, :heads], qkv[:, :, heads:]
            if s.qk_norm:
                qk = torch.cat([self._norm(qk[:, :, :s.heads], layer.q_norm),
                                self._norm(qk[:, :, s.heads:], layer.k_norm)], dim=2)
            qk = _rope(qk, cos, sin)  # [B, T, hq + h_kv, d]
            k[i][:, :, start:end] = qk[:, :, s.heads:].transpose(1, 2)
            v[i][:, :, start:end] = vv.transpose(1, 2)
            o = F.scaled_dot_product_attention(qk[:, :, :s.heads].transpose(1, 2), k[i][:, :, :end], v[i][:, :, :end],
                                               attn_mask=mask, scale=s.head_dim ** -0.5,
                                               enable_gqa=s.kv_heads != s.heads)  # [B, hq, T, d]
            x = x + self.gemm(o.transpose(1, 2).reshape(b, t, s.heads * s.head_dim), layer.o)
            gate, up = self.gemm(self._norm(x, layer.norm2), layer.gate_up).chunk(2, dim=-1)
            x = x + self.gemm(F.silu(gate) * up, layer.down)
            if i in self.taps:
                taps[i] = x
        stacked = torch.stack([taps[i] for i in self.taps], dim=2) if self.taps else x.new_zeros(b, t, 0, s.hidden)
        logits = self.gemm(self._norm(x[:, -1:] if last_only else x, self.final_norm), self.head_weight)
        return logits, stacked, x


    def prefill_row(self, ids: Tensor, k: list[Tensor], v: list[Tensor], row: int,
                    start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """One sequence's prompt ``ids`` [1, P] into row ``row`` of the slab k/v (slots 0..P-1) →
        logits of its last token [1, 1, V], taps [1, P', n, H], last [1, P', H] of the P' = P -
        ``start`` tokens it computes: slots 0..start-1 already hold the prompt's first ones."""
        count = ids.shape[1] - start
        pos = torch.arange(start, start + count, device=ids.device).unsqueeze(0)
        return self(ids[:, start:], pos, start, causal_mask(start, count, ids.device), [x[row:row + 1] for x in k],
                    [x[row:row + 1] for x in v], last_only=True, threads=self.prefill_threads)

    def _forward_kernels(self, ids: Tensor, start: int, k: list[Tensor], v: list[Tensor],
                         last_only: bool = False, threads: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """``forward`` for one sequence through the kernel (positions = slots)."""
        t = ids.shape[1]
        seq = torch.zeros(t, dtype=torch.long)
        pos = torch.arange(start, start + t)
        logits, taps, last = self.forward_rows(ids[0], seq, pos, k, v, last_only, threads)
        return logits.unsqueeze(0), taps.unsqueeze(0), last.unsqueeze(0)

    def forward_rows(self, ids: Tensor, seq: Tensor, pos: Tensor, k: list[Tensor], v: list[Tensor],
                     last_only: bool = False, threads: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """New tokens of several sequences, flattened: row t is token ``ids[t]`` of sequence
        ``seq[t]`` (its row of the slab k/v, per layer [B, h_kv, S, d]) at position and slot
        ``pos[t]``; it attends to that sequence's slots 0..pos[t] (rows of one sequence see each
        other causally) → logits [T, V] ([1, V] of the last row with ``last_only``), taps
        [T, n, H], last [T, H]. All layers in one kernel call where ``kernels`` is set (float32),
        else torch ops with a per-row attention loop (a reference, slow)."""
        s, t = self.shape, ids.shape[0]
        if not seq.shape == pos.shape == (t,):  # the kernel reads T of each: a shorter one would be read past
            raise ValueError(f"forward_rows: {t} tokens, seq {tuple(seq.shape)}, pos {tuple(pos.shape)}")
        table = self.embed.weight
        if self.kernels is not None and table.dtype == torch.float32:  # every layer in one kernel call
            # the embedding and the final norm inside it too: no torch op between two kernel calls
            x = table.new_empty(t, s.hidden)  # [T, H]: the embeddings, then changed in place layer by layer
            normed = table.new_empty(1 if last_only else t, s.hidden)  # [R, H]
            stacked = self.kernels.layers(x, seq, pos, s, self.layers, k, v, self.cos, self.sin, threads, self.taps,
                                          ids=ids.contiguous(), table=table, norm=self.final_norm, normed=normed)
            return self._head_rows(normed), stacked, x
        x = self.embed(ids).contiguous()  # [T, H], changed in place layer by layer
        taps: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            x = self._layer_rows(x, seq, pos, layer, k[i], v[i])
            if i in self.taps:
                taps[i] = x.clone()
        stacked = torch.stack([taps[i] for i in self.taps], dim=1) if self.taps else x.new_zeros(t, 0, s.hidden)
        return self._head_rows(self._norm(x[-1:] if last_only else x, self.final_norm)), stacked, x

    def _head_rows(self, h: Tensor) -> Tensor:  # [T, H] → [T, V]
        """The head over ``forward_rows``' rows: where the kernels read the head's own blocks, through
        them at every row count, as the layers are. ``gemm`` hands passes of more than a few dozen
        rows to torch's float32 product (a prompt's); this head's only such passes are a batch
        round's verify rows (a prompt's head reads its last row), where that product cost more
        than the blocks (docs/results.md)."""
        if self.head_on_blocks:
            return self.kernels.linear(h, self.head_weight)
        return self.gemm(h, self.head_weight)

    @property
    def head_on_blocks(self) -> bool:
        """Whether ``forward_rows``' head reads the head's blocks through the kernels at any row count."""
        return self.kernels is not None and getattr(self.head_weight, "format", "f32") != "f32"

    def _layer_rows(self, x: Tensor, seq: Tensor, pos: Tensor, layer: _Layer, k: Tensor, v: Tensor) -> Tensor:
        """One layer of ``forward_rows`` in torch ops: x [T, H] → [T, H]."""
        s, t = self.shape, x.shape[0]
        heads = s.heads + s.kv_heads
        qkv = self.gemm(self._norm(x, layer.norm1), layer.qkv).view(t, heads + s.kv_heads, s.head_dim)
        qk, vv = qkv[:, :heads], qkv[:, heads:]
        if s.qk_norm:
            qk = torch.cat([self._norm(qk[:, :s.heads], layer.q_norm), self._norm(qk[:, s.heads:], layer.k_norm)], dim=1)
        qk = _rope(qk, self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1))  # [T, hq + h_kv, d]
        k[seq, :, pos] = qk[:, s.heads:]
        v[seq, :, pos] = vv
        out = []
        for r in range(t):
            n = int(pos[r]) + 1
            out.append(F.scaled_dot_product_attention(qk[r:r + 1, :s.heads].transpose(0, 1)[None], k[seq[r], :, :n][None],
                                                      v[seq[r], :, :n][None], scale=s.head_dim ** -0.5,
                                                      enable_gqa=s.kv_heads != s.heads)[0])  # [hq, 1, d]
        o = torch.cat(out, dim=1).transpose(0, 1).reshape(t, s.heads * s.head_dim)
        x = x + self.gemm(o, layer.o)
        gate, up = self.gemm(self._norm(x, layer.norm2), layer.gate_up).chunk(2, dim=-1)
        return x + self.gemm(F.silu(gate) * up, layer.down)


@dataclass
class _Layer:
    """One decoder layer's weights as the step reads them: the products' weights as the decoder's
    ``gemm`` prepared them, the norms' as copies (like the products', they live as long as this
    record, wherever ``model.to`` moves the model's own, so the kernel keeps their addresses)."""

    norm1: Tensor
    qkv: Any  # [(hq + 2 h_kv) d, H]: q, k, v stacked (a copy)
    o: Any
    norm2: Tensor
    gate_up: Any  # [2 I, H]: gate, up stacked (a copy)
    down: Any
    q_norm: Tensor | None
    k_norm: Tensor | None

    @classmethod
    def of(cls, layer: Any, shape: Shape, prepare: Callable[[Tensor], Any] = lambda w: w) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).contiguous()
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).contiguous()
        def own(t: Tensor) -> Tensor:
            return t.detach().clone().contiguous()
        return cls(own(layer.input_layernorm.weight), prepare(qkv), prepare(attn.o_proj.weight.contiguous()),
                   own(layer.post_attention_layernorm.weight), prepare(gate_up), prepare(mlp.down_proj.weight.contiguous()),
                   own(attn.q_norm.weight) if shape.qk_norm else None, own(attn.k_norm.weight) if shape.qk_norm else None)


class StaticCache:
    """One sequence's (or a fixed set of rows') KV slab and how many slots hold committed tokens;
    cropped like an HF cache (``crop(-n)`` drops the last n)."""

    def __init__(self, k: list[Tensor], v: list[Tensor]):
        self.k, self.v = k, v  # per layer [B, h_kv, S, d]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        """``length`` ≥ 0: keep that many slots; < 0: drop that many (as HF's ``crop``)."""
        self.length = max(0, self.length + length if length < 0 else min(length, self.length))


def causal_mask(start: int, count: int, device: torch.device) -> Tensor | None:
    """[1, 1, count, start + count] bool: new token j (slot start + j) reads slots 0..start + j;
    None for one new token (it reads every slot)."""
    if count == 1:
        return None
    rows = torch.arange(count, device=device) + start  # [count]
    return (torch.arange(start + count, device=device)[None, :] <= rows[:, None])[None, None]
