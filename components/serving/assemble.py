"""What one serving replica holds: the target, the served drafter (guarded) and the batch
engine, built from the config as the eval stage builds them (``load_target``, ``load_drafter``).
Where ``target.step`` chooses the fast step, the target runs behind it (``fast.step_target``) and
the batch engine keeps its running batch in the rows of one static KV slab (``cache.slots``).

Engine settings from ``serve``: γ (``num_speculative_tokens``), DLoop ``loop_stages``/``loop_gate``
(on by default for drafters that draft on their own states: up to 3 stages a round, the adaptive
cap deciding how many a round drafts), carryover (on when the drafter declares the capability,
unless set), token trees for a lone request (``tree_budget``), the batch size
(``max_ongoing_requests``) and the draft cap: fixed γ, or (``adaptive``, default) the adaptive
cap over the engine's round times profiled once per host and setting and stored under
``profile_dir`` (``adaptive_engine``, the set-up the eval stage's ``drafter_adaptive`` shares).
The drafting settings are resolved once (``resolve_settings``) and kept in ``EngineParts``.
``serve.drafter=suffix`` serves suffix decoding (no checkpoint; its match sizes each draft, the
adaptive cap reading its estimated probabilities as confidences; a row without a match takes a
plain step) and ``hybrid`` suffix decoding beside
the trained drafter; either learns every finished response of the replica (the batch engine
hands them to it, ``Capability.LEARNS_RESPONSES``).

A drafter trained for another target or tokenizer is refused with every mismatch named
(``load_drafter``'s check), as a ``ConfigError``; so is an engine setting the drafter cannot
serve. ``build_parts(..., adapt_now=False)`` stops there (what a configuration can make fail,
checked at once) with a fixed-cap engine; ``adapt(parts, sc)`` then reads or measures the round
profile and rebuilds the engine with the adaptive cap (a replica's warm-up, ``replica.py``).
Knows the config, the target and drafter loaders and the engine's settings and set-up; nothing
about HTTP, requests or Ray.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from components.config import ConfigError, ServeConfig, TargetConfig
from components.data.records import RecordMismatchError
from components.data.shards import read_responses
from components.drafters import DrafterError, load_drafter
from components.drafters.capabilities import Capability, has
from components.engine import (
    BatchEngine,
    EngineSettings,
    HybridDrafter,
    adaptive_engine,
    loop_gate_for,
    loop_stages_for,
    resolve_settings,
    suffix_drafter,
)
from components.engine.cache.prefix import BLOCK
from components.serving.fallback import GuardedDrafter
from components.serving.provenance import DrafterSource
from components.target import load_target
from components.target.fast import step_target, stream_linears


@dataclass
class EngineParts:
    target: Any  # components.target.Target
    drafter: GuardedDrafter | None
    engine: BatchEngine
    settings: dict[str, Any] = field(default_factory=dict)  # what /v1/models reports
    startup_seconds: float = 0.0
    engine_settings: EngineSettings = field(default_factory=EngineSettings)  # what ``adapt`` rebuilds with
    family: str = "none"  # the served drafter's family: dspark, ..., suffix, hybrid+dspark
    adapts: bool = False  # whether ``adapt`` gives it the adaptive cap


def build_parts(target_cfg: TargetConfig, sc: ServeConfig, target_path: str, source: DrafterSource,
                adapt_now: bool = True) -> EngineParts:
    """Loads the target and drafter and builds the engine as ``sc`` configures it; with
    ``adapt_now=False`` the adaptive cap is left for ``adapt`` (the engine drafts fixed γ until then)."""
    t0 = time.perf_counter()
    if sc.torch_threads > 0:
        torch.set_num_threads(sc.torch_threads)
    target = load_target(dataclasses.replace(target_cfg, name_or_path=target_path), progress=False)
    model = _load(source, target)
    drafter, family = _served(source, sc, model, target)
    notes: list[str] = []
    target = step_target(target, target_cfg, taps=drafter.layer_ids if drafter is not None else (), lines=notes.append)
    prefill_threads = sc.torch_threads  # transformers' forward prefills as it decodes
    if target.batch_cache == "slots" and sc.prefill_threads:  # the fast step: prompts on more cores
        target.prefill_threads = prefill_threads = sc.prefill_threads
    if model is not None:  # the drafter's own linears (the target's it shares are left to the step)
        stream_linears(target, target_cfg, modules=[model], keep_target=True)
    stages = _loop_stages(sc, drafter)
    guarded = GuardedDrafter(drafter, target.vocab_size) if drafter is not None else None
    drafting = _settings(sc, guarded, stages, _carryover(sc, model, source))
    engine = BatchEngine(target, guarded, max_batch_size=sc.max_ongoing_requests, settings=drafting,
                         prefix_tokens=sc.prefix_cache_tokens)
    settings = {"drafter": family, "num_speculative_tokens": drafting.num_speculative_tokens, "max_cap": drafting.max_cap,
                "loop_stages": stages,
                "loop_gate": "adaptive cap" if sc.loop_gate is None and sc.adaptive else drafting.loop_gate,
                "carryover": drafting.carryover, "adaptive": False, "round_profile": None,
                "tree_budget": drafting.tree_budget, "tree_builder": sc.tree_builder, "sampled_rule": sc.sampled_rule,
                "max_batch_size": sc.max_ongoing_requests, "max_queued_requests": sc.max_queued_requests,
                "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device),
                "torch_threads": sc.torch_threads, "prefill_threads": prefill_threads,
                "prefix_cache_tokens": engine.prefixes.max_blocks * BLOCK if engine.prefixes is not None else 0,
                "target_step": notes[-1] if notes else "",
                "suffix_rollouts": sc.suffix_rollouts if family.startswith(("suffix", "hybrid")) else None}
    adapts = sc.adaptive and guarded is not None
    parts = EngineParts(target, guarded, engine, settings, 0.0, drafting, family, adapts)
    if adapt_now:
        adapt(parts, sc)
    parts.startup_seconds = time.perf_counter() - t0
    return parts


DEFAULT_LOOP_STAGES = 3  # serve.loop_stages unset, for a drafter that can loop


def adapt(parts: EngineParts, sc: ServeConfig) -> None:
    """The adaptive cap (``serve.adaptive`` with a drafter): the round profile stored for this
    setting, else measured and stored, and ``parts.engine`` rebuilt with it. Nothing otherwise."""
    if not parts.adapts:
        return
    try:
        parts.engine, stored = adaptive_engine(parts.target, parts.drafter, parts.engine_settings, sc.profile_dir,
                                               sc.max_ongoing_requests, prefix_tokens=sc.prefix_cache_tokens)
    except ValueError as err:
        raise ConfigError(f"serve.profile_dir: {err}") from None
    parts.settings |= {"adaptive": True, "round_profile": stored.describe()}


def _settings(sc: ServeConfig, guarded: GuardedDrafter | None, stages: int, carryover: bool) -> EngineSettings:
    """The engine's drafting settings, resolved once for the served drafter."""
    try:
        return resolve_settings(guarded, sc.num_speculative_tokens, stages, loop_gate_for(sc.loop_gate, sc.adaptive),
                                carryover, tree_budget=sc.tree_budget if guarded is not None else 0,
                                tree_builder=sc.tree_builder)
    except (ValueError, DrafterError) as err:  # a capability the drafter lacks, a bad tree builder
        raise ConfigError(f"serve: cannot build the engine: {err}") from None


def _load(source: DrafterSource, target: Any) -> Any:
    if source.path is None:
        return None
    try:
        return load_drafter(source.path, target).eval()
    except DrafterError as err:
        raise ConfigError(f"serve: the drafter from {source.origin} cannot serve this target: {err}") from None


def _served(source: DrafterSource, sc: ServeConfig, model: Any, target: Any) -> tuple[Any, str]:
    """The engine's drafter and its family name: the trained ``model``, suffix decoding, or the
    hybrid of both (per round the suffix draft when it scores ≥ ``hybrid_suffix_threshold``,
    null: the model's γ), as ``source.method`` says."""
    if source.method == "suffix":
        return _suffix(sc, target), "suffix"
    if model is None:
        return None, "none"
    if source.method == "hybrid":
        threshold = sc.hybrid_suffix_threshold
        threshold = float(model.num_speculative_tokens if threshold is None else threshold)
        return HybridDrafter(model, _suffix(sc, target), threshold), f"hybrid+{model.cfg.name}"
    return model, model.cfg.name


def _suffix(sc: ServeConfig, target: Any) -> Any:
    """Suffix decoding as the ``serve.suffix_*`` keys say, its global tree holding the responses
    of ``serve.suffix_rollouts`` first (a data directory; the serve stage resolves ``auto`` to one
    before replicas start, so here ``auto`` finds none)."""
    responses: list[list[int]] = []
    if sc.suffix_rollouts not in (None, "none", "auto"):
        try:
            responses = list(read_responses(sc.suffix_rollouts, target.tokenizer_hash))
        except (FileNotFoundError, RecordMismatchError) as err:
            raise ConfigError(f"serve.suffix_rollouts: {err} (or set serve.suffix_rollouts=none)") from None
    return suffix_drafter(sc, target.vocab_size, target.device, responses=responses)


def _carryover(sc: ServeConfig, drafter: Any, source: DrafterSource) -> bool:
    """Carryover for the trained drafter (``drafter``; None for suffix decoding alone)."""
    if drafter is None:
        if sc.carryover and source.method == "suffix":
            raise ConfigError("serve.carryover: suffix decoding has no carryover; set serve.carryover=false "
                              "or leave it unset")
        return False
    able = has(drafter, Capability.CARRYOVER)
    if sc.carryover and not able:
        raise ConfigError(f"serve.carryover: the drafter '{drafter.cfg.name}' was not trained with the carryover "
                          "objective (no carryover embedding); set serve.carryover=false or leave it unset")
    return able if sc.carryover is None else bool(sc.carryover)


def _loop_stages(sc: ServeConfig, drafter: Any) -> int:
    """``serve.loop_stages``, or when unset DLoop's ``DEFAULT_LOOP_STAGES`` for a drafter that
    drafts on its own states (block drafters) and 1 for one that cannot."""
    return int(sc.loop_stages) if sc.loop_stages is not None else loop_stages_for(drafter, DEFAULT_LOOP_STAGES)
