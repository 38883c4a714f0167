"""BPE tokenizer of the embedded default target, trained with ``tokenizers``.

Byte-level BPE (no unknown tokens), a fixed set of special tokens and a chat template, saved
as an ordinary Hugging Face fast tokenizer so transformers and vLLM load it like any other.
The mask token is a real vocabulary row reserved for block drafters (DFlash/DSpark).

``tokenizer_hash`` fingerprints any tokenizer (shards and drafters record it to refuse a
mismatched target). Knows nothing about the model or the corpus's origin: it takes an
iterator of strings.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast


def tokenizer_hash(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable fingerprint of a tokenizer's vocabulary and merges (16 hex chars)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        blob = backend.to_str()
    else:
        blob = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


BOS, EOS, PAD, MASK = "<|bos|>", "<|eos|>", "<|pad|>", "<|mask|>"
SYSTEM, USER, ASSISTANT, END = "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, MASK, SYSTEM, USER, ASSISTANT, END]

# Each turn: <|role|>\n{content}<|end|>\n ; generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens (special tokens included) over ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        mask_token=MASK,
        additional_special_tokens=[SYSTEM, USER, ASSISTANT, END],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 1 << 30
    return fast


STOP_TOKENS = (EOS, END, "<|im_end|>", "<|endoftext|>")  # this tokenizer's, then ChatML's (SmolLM2)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Ids that end a generation: end of document and end of a chat turn, for this module's
    tokenizer and ChatML ones (those the vocabulary has), else the tokenizer's eos."""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in STOP_TOKENS if t in vocab] or [int(tokenizer.eos_token_id)]
