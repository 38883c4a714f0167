"""Targets: load any HF causal LM and capture its hidden states; build the embedded default."""

from components.target.hf import Target, TargetError, TargetOutput, load_target
from components.target.tokenizer import tokenizer_hash

__all__ = ["Target", "TargetError", "TargetOutput", "load_target", "tokenizer_hash"]
