"""Pretraining loop of the embedded default target (a small Qwen3-style causal LM).

Plain PyTorch: random windows of a packed token stream, AdamW with warmup and cosine decay,
gradient clipping, a tqdm progress bar. Sized to finish in minutes on a couple of CPU cores.

Knows nothing about where the tokens came from or where the model is saved.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import Qwen3Config, Qwen3ForCausalLM

from components.config import TinyTargetConfig


@dataclass
class PretrainStats:
    steps: int
    tokens: int
    seconds: float
    final_loss: float  # mean train loss over the last 10% of steps


def model_config(cfg: TinyTargetConfig, vocab_size: int, special: dict[str, int]) -> Qwen3Config:
    """An HF Qwen3 config for the tiny target (untied LM head, like the 8B members)."""
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        bos_token_id=special["bos"],
        eos_token_id=special["eos"],
        pad_token_id=special["pad"],
        torch_dtype="float32",
    )


def init_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config)


def sample_windows(stream: torch.Tensor, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """``batch`` random windows of ``length + 1`` tokens from ``stream`` [T] → [batch, length+1]."""
    starts = torch.randint(0, stream.numel() - length - 1, (batch,), generator=gen)
    offsets = torch.arange(length + 1)
    return stream[starts[:, None] + offsets[None, :]]


def lr_at(step: int, cfg: TinyTargetConfig) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.train_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def _optimizer(model: torch.nn.Module, cfg: TinyTargetConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def pretrain(model: Qwen3ForCausalLM, stream: torch.Tensor, cfg: TinyTargetConfig,
             progress: bool = True, what: str = "tiny target") -> PretrainStats:
    """Trains ``model`` in place on windows of ``stream`` [T] (token ids) for cfg.train_steps
    (the progress bar says ``pretraining <what>``)."""
    if stream.numel() <= cfg.seq_len + 1:
        raise ValueError(f"training stream has {stream.numel()} tokens; need more than seq_len={cfg.seq_len}")
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = _optimizer(model, cfg)
    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    bar = tqdm(range(cfg.train_steps), desc=f"pretraining {what}", disable=not progress, unit="step")
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg)
        window = sample_windows(stream, cfg.batch_size, cfg.seq_len, gen)
        logits = model(input_ids=window[:, :-1], use_cache=False).logits  # [B, L, V]
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{lr_at(step, cfg):.1e}")
    model.eval()
    tail = losses[-max(1, len(losses) // 10):]
    return PretrainStats(cfg.train_steps, cfg.train_steps * cfg.batch_size * cfg.seq_len,
                         time.perf_counter() - start, sum(tail) / len(tail))
