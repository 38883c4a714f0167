"""The peers: transformers' own ``model.generate`` on the same target, batch 1.

* ``hf_generate``      -- greedy (or sampled) decoding, the target alone;
* ``hf_prompt_lookup`` -- ``generate(prompt_lookup_num_tokens=γ, max_matching_ngram_size=n)``;
* ``hf_assisted``      -- ``generate(assistant_model=...)``: a separate small LM drafts.

Every call generates exactly ``max_new_tokens`` tokens: stop tokens are switched off (our engine
has none; an empty list, since ``generate`` replaces a None by the model's default), not
suppressed, so the target's logits are never altered.

Rounds are read off the target's forward passes (a pre-hook on the HF model): in assisted
generation pass r verifies ``[last committed token, drafts]`` (the first pass: prompt + drafts)
starting at position s_r (its first position id = the cached length), so it tells the committed
length c_r = s_r + (fed committed tokens) and the drafts d_r = fed − committed; the tokens it
emitted are c_{r+1} − c_r (the last pass: the final length − c_r). That gives τ and acceptance
by position for transformers' methods without touching its internals; passes that do not fit
this pattern leave them unmeasured (only target passes are then reported). A pass with no
candidates (prompt lookup found no match) is a round with zero drafts.

Knows transformers' generate API; nothing about our engine, drafters or MLflow.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from components.evaluation.metrics import PromptRun


@dataclass
class Pass:
    """One target forward pass as seen by the pre-hook."""

    input_len: int  # tokens fed
    start: int | None  # position of the first fed token (= tokens already cached), if known


def _start_position(kwargs: dict[str, Any]) -> int | None:
    for key in ("position_ids", "cache_position"):  # transformers 5.x / 4.x
        value = kwargs.get(key)
        if value is not None:
            return int(value.flatten()[0])
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if cache is not None and hasattr(cache, "get_seq_length") else None


@dataclass
class PassRecorder:
    """Records the target's forward passes during one generate call."""

    passes: list[Pass] = field(default_factory=list)

    def __call__(self, _module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.passes.append(Pass(int(ids.shape[-1]), _start_position(kwargs)))


def rounds_from_passes(passes: list[Pass], prompt_len: int, final_len: int) -> tuple[list[int], list[int]] | None:
    """(accepted, drafted) per round of an assisted generation, or None when unreadable."""
    if not passes or any(p.start is None for p in passes) or passes[0].start != 0:
        return None
    committed, drafted = [], []
    for r, p in enumerate(passes):
        fed = prompt_len if r == 0 else 1  # the prompt, later the last committed token
        committed.append(p.start + fed)
        drafted.append(p.input_len - fed)
    emitted = [b - a for a, b in itertools.pairwise(committed)] + [final_len - committed[-1]]
    if any(d < 0 for d in drafted) or any(e < 1 for e in emitted):
        return None
    return [min(e - 1, d) for e, d in zip(emitted, drafted)], drafted


def _no_stop_config(model: Any, max_new_tokens: int, temperature: float) -> Any:
    """The model's generation config with stop tokens off and fixed length / sampling."""
    gen = copy.deepcopy(model.generation_config)
    gen.eos_token_id = []  # not None: generate fills None fields from the model's own config
    gen.max_new_tokens, gen.min_new_tokens, gen.max_length = max_new_tokens, None, None
    gen.do_sample = temperature > 0
    gen.temperature = temperature if temperature > 0 else None
    gen.top_k, gen.top_p = None, None
    if gen.pad_token_id is None:
        gen.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    return gen


@torch.no_grad()
def hf_generate(model: Any, prompt_ids: list[int], max_new_tokens: int, temperature: float = 0.0,
                seed: int = 0, method: str = "hf_generate", assistant_model: Any = None,
                **generation: Any) -> PromptRun:
    """One timed ``model.generate`` call. ``generation`` sets generation-config fields (e.g.
    ``prompt_lookup_num_tokens``); with those or an assistant its rounds are read off the passes."""
    device = next(model.parameters()).device
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    gen = _no_stop_config(model, max_new_tokens, temperature)
    for key, value in generation.items():
        setattr(gen, key, value)
    extra = {"assistant_model": assistant_model} if assistant_model is not None else {}
    recorder = PassRecorder()
    handle = model.register_forward_pre_hook(recorder, with_kwargs=True)
    torch.manual_seed(seed)
    try:
        clock = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, **extra)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - clock
    finally:
        handle.remove()
    tokens = out[0, ids.shape[1]:].tolist()
    run = PromptRun(method, "", tokens, seconds, target_forwards=len(recorder.passes))
    if extra or generation:  # a drafting method: read its rounds off the passes
        found = rounds_from_passes(recorder.passes, len(prompt_ids), len(prompt_ids) + len(tokens))
        if found is not None:
            run.accepted, run.drafted = found
    return run
