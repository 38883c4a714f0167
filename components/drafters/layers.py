"""Qwen3-style building blocks shared by the drafters: RMSNorm, RoPE, attention, MLP, layer.

Parameter names follow the Hugging Face / vLLM Qwen3 and Llama layouts (``self_attn.q_proj``,
``q_norm``, ``mlp.gate_proj``, ``input_layernorm`` ...), so exporters rename little.

Attention separates projection from attending: a drafter can project keys/values from any
source (fused target features for DFlash/DSpark context, its own block tokens) and attend a
query to the concatenation. Masks are boolean, True = may attend. Nothing here knows about
targets, drafter families, checkpoints or sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

KV = tuple[Tensor, Tensor]  # (k [B, h_kv, S, d], v [B, h_kv, S, d])


@dataclass(frozen=True)
class LayerSizes:
    """Sizes of one decoder layer (copied from the target unless overridden)."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., size] -> [..., size]
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin ``[B, 1, T, d]`` for absolute ``positions`` [B, T] (HF rotate-half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float().unsqueeze(-1) * inv  # [B, T, d/2]
    emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [B, 1, T, d]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [B, h, T, d]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Multi-head (GQA) attention with optional Qwen3 per-head q/k RMSNorm and RoPE."""

    def __init__(self, sizes: LayerSizes, in_features: int | None = None, qk_norm: bool = True):
        super().__init__()
        d, h, hk = sizes.head_dim, sizes.num_heads, sizes.num_kv_heads
        inp = in_features or sizes.hidden_size
        self.sizes = sizes
        self.q_proj = nn.Linear(inp, h * d, bias=False)
        self.k_proj = nn.Linear(inp, hk * d, bias=False)
        self.v_proj = nn.Linear(inp, hk * d, bias=False)
        self.o_proj = nn.Linear(h * d, sizes.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, sizes.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(d, sizes.rms_norm_eps) if qk_norm else None

    def _heads(self, x: Tensor, n: int) -> Tensor:  # [B, T, n*d] -> [B, n, T, d]
        b, t, _ = x.shape
        return x.view(b, t, n, self.sizes.head_dim).transpose(1, 2)

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:  # [B, n, T, d], [B, T]
        cos, sin = rope_cos_sin(positions, self.sizes.head_dim, self.sizes.rope_theta, x.dtype)
        return apply_rope(x, cos, sin)

    def project_q(self, x: Tensor, positions: Tensor) -> Tensor:  # [B, T, in], [B, T] -> [B, h, T, d]
        q = self._heads(self.q_proj(x), self.sizes.num_heads)
        q = self.q_norm(q) if self.q_norm is not None else q
        return self._rope(q, positions)

    def project_kv(self, x: Tensor, positions: Tensor) -> KV:  # [B, T, in], [B, T] -> k, v [B, h_kv, T, d]
        k = self._heads(self.k_proj(x), self.sizes.num_kv_heads)
        k = self.k_norm(k) if self.k_norm is not None else k
        v = self._heads(self.v_proj(x), self.sizes.num_kv_heads)
        return self._rope(k, positions), v

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q [B, h, Tq, d], k/v [B, h_kv, S, d], mask [B|1, 1, Tq, S] bool → [B, Tq, H]."""
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, enable_gqa=k.shape[1] != q.shape[1]
        )
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention may read extra (context) keys/values."""

    def __init__(self, sizes: LayerSizes):
        super().__init__()
        self.input_layernorm = RMSNorm(sizes.hidden_size, sizes.rms_norm_eps)
        self.self_attn = Attention(sizes)
        self.post_attention_layernorm = RMSNorm(sizes.hidden_size, sizes.rms_norm_eps)
        self.mlp = MLP(sizes.hidden_size, sizes.intermediate_size)

    def forward(
        self,
        x: Tensor,  # [B, T, H] the layer's own tokens (a block, or a causal sequence)
        positions: Tensor,  # [B, T] absolute positions of x
        extra_kv: KV | None = None,  # k, v [B, h_kv, S, d] keys/values placed before x's own
        mask: Tensor | None = None,  # [B|1, 1, T, S + T] bool, True = attend
    ) -> tuple[Tensor, KV]:
        """Returns the layer output [B, T, H] and x's own (k, v) [B, h_kv, T, d]."""
        attn, kv = self.attention(self.input_layernorm(x), positions, extra_kv, mask)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, kv

    def attention(self, h: Tensor, positions: Tensor, extra_kv: KV | None, mask: Tensor | None) -> tuple[Tensor, KV]:
        """The attention sublayer on normed rows h [B, T, H] (extra keys/values first) → its
        output [B, T, H] and h's own (k, v) [B, h_kv, T, d]."""
        q = self.self_attn.project_q(h, positions)
        k, v = self.self_attn.project_kv(h, positions)
        if extra_kv is not None:
            keys, values = torch.cat([extra_kv[0], k], dim=2), torch.cat([extra_kv[1], v], dim=2)
        else:
            keys, values = k, v
        return self.self_attn.attend(q, keys, values, mask), (k, v)


def pad_kv_rows(rows: list[KV | None], device: torch.device,
                masks: list[Tensor | None] | None = None) -> tuple[KV | None, Tensor]:
    """Batch-1 K/V of many rows ([1, h_kv, L_i, d] each; None: none yet), right-padded to the
    longest → ((k, v) [R, h_kv, W, d], or None when no row has any; which slots are real [R, W]).
    ``masks[i]``: which of row i's L_i slots it may read ([L_i] bool; None: all)."""
    lens = [kv[0].shape[2] if kv is not None else 0 for kv in rows]
    width = max(lens)
    seen = torch.arange(width, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
    for i, mask in enumerate(masks or []):
        if mask is not None:
            seen[i, :lens[i]] = mask
    if width == 0:
        return None, seen
    k0 = next(kv[0] for kv in rows if kv is not None)
    keys = k0.new_zeros(len(rows), k0.shape[1], width, k0.shape[3])
    values = keys.clone()
    for i, kv in enumerate(rows):
        if kv is not None:
            keys[i, :, :lens[i]], values[i, :, :lens[i]] = kv[0][0], kv[1][0]
    return (keys, values), seen


def causal_mask(t: int, device: torch.device) -> Tensor:  # -> [1, 1, t, t] bool
    return torch.ones(t, t, dtype=torch.bool, device=device).tril().view(1, 1, t, t)


def init_weights(module: nn.Module, std: float = 0.02) -> None:
    """N(0, std) for linear/embedding weights, zero biases; norms keep their ones."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=std)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
