"""A target model: any Hugging Face causal LM, with hidden-state capture at chosen layers.

Layer convention (docs/architecture.md): ``layer i`` is the output of decoder layer i, 0-based, which is
HF ``hidden_states[i + 1]``. Captures use forward hooks on the decoder layers, so the last
layer is captured *before* the final norm and the target distribution can be recomputed from
it with the frozen head: ``logits = lm_head(final_norm(h_last))``.

This module knows how to load and run a target; it knows nothing about drafters, Ray or
how the built-in targets are made: ``target.name_or_path: embedded`` (the default) is
SmolLM2-135M-Instruct from :mod:`components.target.smollm2` with the prompt bank of
:mod:`components.target.promptbank`; ``smollm2`` is that checkpoint alone; ``tiny`` is the
self-built test fixture of :mod:`components.target.tiny`.

``target.dtype: auto`` is bfloat16 where the device computes it natively (a CUDA GPU with bf16,
a CPU with AVX512-BF16 or AMX), else float32: for serving and benchmarks. Token-for-token tests
stay in float32 (bfloat16 greedy output differs from float32's).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from components.config import EMBEDDED_TARGET, SMOLLM2_TARGET, TINY_TARGET, TargetConfig
from components.target.attention import choose_attention
from components.target.corpus import corpus_cache
from components.target.hfbars import no_hf_bars
from components.target.promptbank import PromptBankError, ensure_prompt_bank
from components.target.smollm2 import ConversionError, converted_from, ensure_smollm2_target
from components.target.tiny import ensure_tiny_target
from components.target.tokenizer import tokenizer_hash

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TargetError(ValueError):
    """A target cannot be loaded or used as asked; the message says what to fix."""


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX512-BF16 or AMX), as torch probes it."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, p, lambda: False)()) for p in probes)


def native_bf16(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_has_native_bf16()


def auto_dtype(device: torch.device, has_bf16: Callable[[torch.device], bool] = native_bf16) -> torch.dtype:
    """bfloat16 where ``device`` computes it natively (hence faster than float32), else float32."""
    return torch.bfloat16 if has_bf16(device) else torch.float32


def resolve_dtype(name: str, device: torch.device | None = None) -> torch.dtype:
    """A ``target.dtype`` name → torch dtype; ``auto`` decides for ``device`` (default cpu)."""
    if name == "auto":
        return auto_dtype(device if device is not None else torch.device("cpu"))
    if name not in DTYPES:
        raise TargetError(f"target.dtype: '{name}' is not one of {sorted([*DTYPES, 'auto'])}")
    return DTYPES[name]


@dataclass
class TargetOutput:
    logits: Tensor  # [B, T, V] next-token logits at every position
    hidden: Tensor | None  # [B, T, n, H] outputs of the requested layers, in request order
    last_hidden: Tensor  # [B, T, H] output of the last decoder layer, before the final norm
    cache: Any  # the model's KV cache when use_cache=True, else None


def _first_attr(obj: Any, names: Sequence[str]) -> Any:
    for name in names:
        if hasattr(obj, name):
            return getattr(obj, name)
    return None


class Target:
    """A frozen HF causal LM plus its tokenizer, as drafters and engines see it."""

    # The batch engine's KV cache for this target: "ragged" (an HF cache, ``engine.cache.ragged``)
    # or "slots" (rows of a static slab, ``engine.cache.slots``: ``fast.StepTarget``).
    batch_cache = "ragged"
    # The block-quantized file the float32 weights were converted from (the embedded SmolLM2's
    # GGUF, named by its converted directory's info file); the fast step may read its blocks
    # (``fast.block_index``).
    block_source: Path | None = None

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name_or_path: str):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name_or_path = name_or_path
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
        self.layers: nn.ModuleList = _first_attr(decoder, ("layers", "h", "blocks"))
        self.final_norm: nn.Module = _first_attr(decoder, ("norm", "final_layernorm", "ln_f"))
        if self.layers is None or self.final_norm is None:
            raise TargetError(f"{name_or_path}: cannot find decoder layers / final norm in {type(model).__name__}")
        self._rotary = getattr(decoder, "rotary_emb", None)  # (x, positions) -> cos, sin [B, T, d]
        self.embed_tokens: nn.Module = model.get_input_embeddings()
        self.lm_head: nn.Module = model.get_output_embeddings()
        self.tokenizer_hash = tokenizer_hash(tokenizer)
        # transformers 5.x names the KV-cache argument ``cache``; 4.x ``past_key_values``
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self._keeps_logits = "logits_to_keep" in params  # the model computes only the last positions' logits

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def forward_kind(self) -> str:
        """What runs this target's passes (part of what a round profile is keyed by): the
        transformers forward, with or without its linears streamed by the kernel."""
        streamed = any(type(m).__name__ == "StreamingLinear" for m in self.model.modules())
        return "transformers, linears streamed" if streamed else "transformers"

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.embed_tokens.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end a generation: the generation config's eos ids, then the tokenizer's."""
        generation = getattr(self.model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        ids = [*(eos if isinstance(eos, (list, tuple)) else [eos]), self.tokenizer.eos_token_id]
        return tuple(dict.fromkeys(int(i) for i in ids if i is not None and int(i) >= 0))

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def check_layer_ids(self, layer_ids: Sequence[int]) -> list[int]:
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise TargetError(
                f"layer ids {bad} out of range for {self.name_or_path} ({self.num_layers} decoder "
                f"layers: valid ids are 0..{self.num_layers - 1}, layer i = HF hidden_states[i+1])"
            )
        return list(layer_ids)

    def embed(self, input_ids: Tensor) -> Tensor:  # [B, T] → [B, T, H]
        return self.embed_tokens(input_ids)

    def compute_logits(self, last_hidden: Tensor) -> Tensor:  # [..., H] pre-norm → [..., V]
        return self.lm_head(self.final_norm(last_hidden))

    @torch.no_grad()
    def project_kv(self, layer: int, hidden: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """The keys/values decoder layer ``layer`` writes to its KV cache for its input hidden
        [B, T, H] (the output of layer − 1: tap ``layer − 1``) at positions [B, T] → k, v
        [B, h_kv, T, d], as its attention reads them (input norm, k/v projections, a per-head
        k-norm where the layer has one, the decoder's rotary embedding). Llama/Qwen-style
        attention only (``self_attn`` with ``k_proj``/``v_proj``/``head_dim``)."""
        block = self.layers[layer]
        attn = block.self_attn
        x = block.input_layernorm(hidden.to(self.dtype))
        b, t, d = x.shape[0], x.shape[1], int(attn.head_dim)
        k = attn.k_proj(x).view(b, t, -1, d)
        k_norm = getattr(attn, "k_norm", None)  # Qwen3 has one, Llama not
        k = (k_norm(k) if k_norm is not None else k).transpose(1, 2)  # [B, h_kv, T, d]
        v = attn.v_proj(x).view(b, t, -1, d).transpose(1, 2)
        cos, sin = self._rotary(x, positions)  # [B, T, d]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = d // 2
        rotated = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
        return k * cos + rotated * sin, v

    @torch.no_grad()
    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                layer_ids: Sequence[int] = (), cache: Any = None,
                use_cache: bool = False, position_ids: Tensor | None = None,
                last_logits: bool = False) -> TargetOutput:
        """One forward over ``input_ids`` [B, T], capturing the outputs of ``layer_ids``.

        ``cache`` continues from an earlier call's ``TargetOutput.cache`` (positions follow it).
        ``last_logits``: logits of the last position only, [B, 1, V] (a prefill's: the LM head
        over every prompt position is a large share of a long prompt's arithmetic).
        """
        wanted = self.check_layer_ids(layer_ids)
        captured: dict[int, Tensor] = {}
        hooks = [
            self.layers[i].register_forward_hook(self._capture(i, captured))
            for i in sorted(set(wanted) | {self.num_layers - 1})
        ]
        try:
            kwargs = {self._cache_kw: cache} if cache is not None else {}
            if last_logits and self._keeps_logits:
                kwargs["logits_to_keep"] = 1
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids, use_cache=use_cache or cache is not None,
                             **kwargs)
        finally:
            for h in hooks:
                h.remove()
        hidden = torch.stack([captured[i] for i in wanted], dim=2) if wanted else None
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return TargetOutput(out.logits[:, -1:] if last_logits else out.logits, hidden, captured[self.num_layers - 1],
                            new_cache if use_cache or cache is not None else None)

    __call__ = forward

    @staticmethod
    def _capture(layer: int, store: dict[int, Tensor]):
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            store[layer] = output[0] if isinstance(output, tuple) else output
        return hook


# ----------------------------------------------------------------------------- loading
BUILT_IN = (EMBEDDED_TARGET, SMOLLM2_TARGET, TINY_TARGET)


def ensure_embedded_target(cfg: TargetConfig, progress: bool = True) -> tuple[Path, dict[str, Any], dict[str, Any], bool]:
    """(dir, conversion info, prompt-bank info, anything built now) of the embedded default."""
    try:
        path, converted, converted_now = ensure_smollm2_target(cfg, progress=progress)
        bank, bank_now = ensure_prompt_bank(path, cfg.prompts, corpus_cache(cfg.cache_dir), progress=progress)
    except (ConversionError, PromptBankError) as err:
        raise TargetError(str(err)) from None
    return path, converted, bank, converted_now or bank_now


def resolve_target_path(cfg: TargetConfig, progress: bool = True) -> str:
    """A built-in target's cached checkpoint (built or converted if missing), a local dir, or a hub id."""
    if cfg.name_or_path == EMBEDDED_TARGET:
        return str(ensure_embedded_target(cfg, progress)[0])
    if cfg.name_or_path == TINY_TARGET:
        path, _, _ = ensure_tiny_target(cfg, progress=progress)  # builds once, then cached
        return str(path)
    if cfg.name_or_path == SMOLLM2_TARGET:
        try:
            path, _, _ = ensure_smollm2_target(cfg, progress=progress)  # converts once, then cached
        except ConversionError as err:
            raise TargetError(str(err)) from None
        return str(path)
    if Path(cfg.name_or_path).is_absolute():  # a local directory (config paths are absolute: components/paths.py)
        path = Path(cfg.name_or_path)
        if not (path / "config.json").is_file():
            raise TargetError(
                f"target.name_or_path: '{cfg.name_or_path}' is not a model directory "
                f"(no config.json there); give an HF checkpoint directory, a hub id or one of {list(BUILT_IN)}"
            )
        return str(path)
    return cfg.name_or_path


def check_tokenizer_matches(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise TargetError(
            f"{where}: tokenizer has {len(tokenizer)} tokens but the model's embedding table has "
            f"{rows} rows: the tokenizer does not belong to this model"
        )


def load_target(cfg: TargetConfig, progress: bool = True) -> Target:
    """Loads the configured target (frozen, eval mode) on its configured device and dtype."""
    path = resolve_target_path(cfg, progress)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    kwargs = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        with no_hf_bars():  # a bar over a checkpoint that loads in a second is noise
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    except (OSError, ValueError) as err:
        raise TargetError(f"target.name_or_path: cannot load '{path}': {str(err).splitlines()[0]}") from None
    check_tokenizer_matches(model, tokenizer, path)
    try:
        choose_attention(model, cfg.attention, device)
    except (ValueError, ImportError) as err:
        raise TargetError(f"target.attention: cannot use '{cfg.attention}' for {path}: "
                          f"{str(err).splitlines()[0]} (use auto, sdpa or eager)") from None
    target = Target(model.to(device), tokenizer, path)
    if Path(path).is_dir():  # a converted checkpoint names the GGUF it came from
        target.block_source = converted_from(Path(path))
    return target
