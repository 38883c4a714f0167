"""A drafter's decoder layers through the fast step's layer kernel (``kernels/layer.c``): one
call per layer for a block of draft rows that read a context's keys/values and each other,
in place of the ~30 torch ops of a layer whose dispatch costs more than its arithmetic at a
block's few rows (docs/results.md, "Draft cost against the target step").

    run = KernelLayers(kernel, drafter_layers, sizes, pack)   # packs each layer's products once
    y = run(x, start, context)   # x [Q, H] rows at positions start..start+Q-1 → [Q, H], or None

The layers are pre-norm Llama/Qwen3-layout modules (``input_layernorm``, ``self_attn.{q,k,v,o}_proj``
and optional ``{q,k}_norm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj``), RoPE in
the rotate-half layout at ``sizes.rope_theta``, the same arithmetic as the drafter's torch layers
in float32 (summed in another order, and through the products' packed copies: drafts may differ
by the rounding; the target verifies them). Knows the kernel's layer call and that layout;
nothing about drafters, proposals or states: the caller hands over the rows, where they start
and the context's keys/values, and runs its own torch layers where this returns None.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from components.target.kernels import KernelUnavailable, PackedWeight, RowsGemm
from components.target.step import Shape, _Layer

KV = tuple[Tensor, Tensor]
ROPE_SLOTS = 1024  # positions the RoPE tables start with; doubled when a block reaches past them


class KernelLayers:
    """``layers`` run through ``kernel.layer`` for batch-1 blocks (module docstring)."""

    def __init__(self, kernel: RowsGemm, layers: Sequence[Any], sizes: Any, pack: Callable[[Tensor], PackedWeight]):
        """``sizes``: hidden_size, num_heads, num_kv_heads, head_dim, rope_theta, rms_norm_eps;
        ``pack``: a weight [N, K] → its packed copy for the kernel (e.g. Q8_0 blocks)."""
        attn = layers[0].self_attn
        self.kernel = kernel
        self.shape = Shape(len(layers), int(sizes.num_heads), int(sizes.num_kv_heads), int(sizes.head_dim),
                           int(sizes.hidden_size), float(sizes.rms_norm_eps), getattr(attn, "q_norm", None) is not None)
        self.theta = float(sizes.rope_theta)
        self.weights = [_Layer.of(layer, self.shape, lambda w: pack(w.detach())) for layer in layers]
        self.cos, self.sin = self._tables(ROPE_SLOTS)

    def _tables(self, slots: int) -> tuple[Tensor, Tensor]:
        """cos/sin [slots, d] of positions 0..slots-1, as the drafter's own RoPE computes them."""
        d = self.shape.head_dim
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.arange(slots, dtype=torch.float32)[:, None] * inv  # [slots, d/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().contiguous(), emb.sin().contiguous()

    def __call__(self, x: Tensor, start: int, context: list[KV]) -> Tensor | None:
        """x [Q, H] float32 rows at positions start..start+Q-1, each reading every row and the
        context's ``start`` slots (per layer k, v [1, h_kv, start, d]; [] when start is 0) →
        the layers' output [Q, H] (a new tensor); None where the kernel cannot take the call."""
        s, q = self.shape, x.shape[0]
        if x.dtype != torch.float32 or torch.is_grad_enabled() or len(context) not in (0, s.layers):
            return None
        if any(k.shape[2] != start or k.shape[0] != 1 for k, _ in context) or (not context and start):
            return None
        end = start + q
        while end > self.cos.shape[0]:
            self.cos, self.sin = self._tables(2 * self.cos.shape[0])
        out = x.contiguous().clone()
        seq = torch.zeros(q, dtype=torch.long)
        pos = torch.arange(start, end)
        upto = torch.full((q,), end - 1, dtype=torch.long)
        try:
            for i, w in enumerate(self.weights):
                k = x.new_empty(1, s.kv_heads, end, s.head_dim)
                v = torch.empty_like(k)
                if start:
                    k[:, :, :start] = context[i][0]
                    v[:, :, :start] = context[i][1]
                self.kernel.layer(out, seq, pos, s, w, k, v, self.cos, self.sin, upto=upto)
        except KernelUnavailable:
            return None
        return out
