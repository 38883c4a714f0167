"""How good a language model is: held-out perplexity, a unigram baseline, distinct-n of samples.

A randomly initialised or undertrained model repeats itself, which makes every drafter and
n-gram method look unrealistically good; these numbers show the embedded target is a real LM.
Works on any HF causal LM and token tensors; knows nothing about the corpus or the build.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


@torch.no_grad()
def perplexity(model: torch.nn.Module, stream: torch.Tensor, seq_len: int, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) over non-overlapping windows of ``stream`` [T]."""
    n_windows = (stream.numel() - 1) // seq_len
    if n_windows < 1:
        raise ValueError(f"held-out stream of {stream.numel()} tokens is shorter than seq_len={seq_len}")
    inputs = stream[: n_windows * seq_len].view(n_windows, seq_len)
    targets = stream[1 : n_windows * seq_len + 1].view(n_windows, seq_len)
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, n_windows, batch_size):
        x, y = inputs[i : i + batch_size].to(device), targets[i : i + batch_size].to(device)
        logits = model(input_ids=x, use_cache=False).logits.float()  # [b, L, V]
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    return math.exp(total / count)


def unigram_perplexity(train: torch.Tensor, heldout: torch.Tensor, vocab_size: int, seq_len: int) -> float:
    """Perplexity of add-one-smoothed unigram frequencies of ``train`` on the same held-out
    targets that :func:`perplexity` scores."""
    counts = torch.bincount(train, minlength=vocab_size).double() + 1.0
    logp = (counts / counts.sum()).log()
    n_windows = (heldout.numel() - 1) // seq_len
    targets = heldout[1 : n_windows * seq_len + 1]
    return math.exp(-logp[targets].mean().item())


def distinct_n(tokens: list[int], n: int = 4) -> float:
    """Share of distinct n-grams among all n-grams of one sequence (1.0 = never repeats)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


@torch.no_grad()
def sample_continuations(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int,
                         temperature: float, seed: int) -> torch.Tensor:
    """Sampled (temperature > 0) or greedy continuations of ``prompts`` [B, P] → [B, new_tokens]."""
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=prompts.to(device),
        attention_mask=torch.ones_like(prompts, device=device),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=None,
        top_p=None,
        pad_token_id=model.config.pad_token_id,
    )
    return out[:, prompts.shape[1] :].cpu()


def mean_distinct_4(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int,
                    temperature: float, seed: int) -> float:
    """Mean distinct-4-gram ratio of continuations of ``prompts`` [B, P]."""
    conts = sample_continuations(model, prompts, new_tokens, temperature, seed)
    return sum(distinct_n(row.tolist(), 4) for row in conts) / len(conts)
