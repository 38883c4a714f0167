"""What one serving replica holds: the target, the served drafter (guarded) and the batch
engine, built from the config as the eval stage builds them (``load_target``, ``load_drafter``).

Engine settings from ``serve``: γ (``num_speculative_tokens``), DLoop ``loop_stages``/``loop_gate``
(on by default for drafters that draft on their own states: up to 3 stages a round, the adaptive
cap deciding how many a round drafts), carryover (on when the drafter declares the capability,
unless set), token trees for a lone request (``tree_budget``), the batch size
(``max_ongoing_requests``) and the draft cap: fixed γ, or (``adaptive``, default)
``AdaptiveDraftLength`` over the engine's round times profiled once per host and setting and
stored under ``profile_dir`` (``stored_round_times``).

A drafter trained for another target or tokenizer is refused with every mismatch named
(``load_drafter``'s check), as a ``ConfigError``; so is an engine setting the drafter cannot
serve. ``build_parts(..., adapt_now=False)`` stops there (what a configuration can make fail,
checked at once) with a fixed-cap engine; ``adapt(parts, sc)`` then reads or measures the round
profile and rebuilds the engine with the adaptive cap (a replica's warm-up, ``replica.py``).
Knows the config, the target and drafter loaders and the engine's constructor; nothing about
HTTP, requests or Ray.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from components.config import ConfigError, ServeConfig, TargetConfig
from components.drafters import DrafterError, load_drafter
from components.drafters.capabilities import Capability, has
from components.engine import OPEN_GATE, BatchEngine, adaptive_policy, loop_stages_for
from components.serving.fallback import GuardedDrafter
from components.serving.provenance import DrafterSource
from components.target import load_target

PROFILE_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class EngineParts:
    target: Any  # components.target.Target
    drafter: GuardedDrafter | None
    engine: BatchEngine
    settings: dict[str, Any] = field(default_factory=dict)  # what /v1/models reports
    startup_seconds: float = 0.0
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # the drafting settings ``adapt`` rebuilds with


def build_parts(target_cfg: TargetConfig, sc: ServeConfig, target_path: str, source: DrafterSource,
                adapt_now: bool = True) -> EngineParts:
    """Loads the target and drafter and builds the engine as ``sc`` configures it; with
    ``adapt_now=False`` the adaptive cap is left for ``adapt`` (the engine drafts fixed γ until then)."""
    t0 = time.perf_counter()
    if sc.torch_threads > 0:
        torch.set_num_threads(sc.torch_threads)
    target = load_target(dataclasses.replace(target_cfg, name_or_path=target_path), progress=False)
    drafter = _load(source, target)
    carryover, stages = _carryover(sc, drafter), _loop_stages(sc, drafter)
    kwargs: dict[str, Any] = {"num_speculative_tokens": sc.num_speculative_tokens, "loop_stages": stages,
                              "loop_gate": loop_gate(sc), "carryover": carryover}
    guarded = GuardedDrafter(drafter, target.vocab_size) if drafter is not None else None
    engine = _engine(sc, target, guarded, kwargs, None)
    settings = {"num_speculative_tokens": engine.num_speculative_tokens, "max_cap": engine.max_cap, "loop_stages": stages,
                "loop_gate": "adaptive cap" if sc.loop_gate is None and sc.adaptive else kwargs["loop_gate"],
                "carryover": carryover, "adaptive": False,
                "round_profile": None, "tree_budget": sc.tree_budget if guarded is not None else 0,
                "tree_builder": sc.tree_builder, "sampled_rule": sc.sampled_rule,
                "max_batch_size": sc.max_ongoing_requests, "max_queued_requests": sc.max_queued_requests,
                "dtype": str(target.dtype).removeprefix("torch."), "device": str(target.device)}
    parts = EngineParts(target, guarded, engine, settings, 0.0, kwargs)
    if adapt_now:
        adapt(parts, sc)
    parts.startup_seconds = time.perf_counter() - t0
    return parts


DEFAULT_LOOP_STAGES = 3  # serve.loop_stages unset, for a drafter that can loop
FIXED_CAP_LOOP_GATE = -0.5  # serve.loop_gate null without the adaptive cap: the engine's own default


def loop_gate(sc: ServeConfig) -> float:
    """The engine's DLoop gate: ``serve.loop_gate``; when null, open (-inf) under the adaptive
    cap, whose choice of G ≤ γ·stages then decides how many stages a round drafts, and
    ``FIXED_CAP_LOOP_GATE`` with a fixed cap (which would otherwise draft every stage always)."""
    if sc.loop_gate is not None:
        return float(sc.loop_gate)
    return OPEN_GATE if sc.adaptive else FIXED_CAP_LOOP_GATE


def adapt(parts: EngineParts, sc: ServeConfig) -> None:
    """The adaptive cap (``serve.adaptive`` with a drafter): the round profile stored for this
    setting, else measured and stored, and ``parts.engine`` rebuilt with it. Nothing otherwise."""
    policy, profile = _policy(sc, parts.target, parts.drafter, parts.engine_kwargs)
    if policy is None:
        return
    parts.engine = _engine(sc, parts.target, parts.drafter, parts.engine_kwargs, policy)
    parts.settings |= {"adaptive": True, "round_profile": profile}


def _engine(sc: ServeConfig, target: Any, guarded: GuardedDrafter | None, kwargs: dict[str, Any],
            policy: Any) -> BatchEngine:
    try:
        return BatchEngine(target, guarded, max_batch_size=sc.max_ongoing_requests, draft_length=policy,
                           tree_budget=sc.tree_budget if guarded is not None else 0, tree_builder=sc.tree_builder,
                           **kwargs)
    except (ValueError, DrafterError) as err:  # a capability the drafter lacks, a bad tree builder
        raise ConfigError(f"serve: cannot build the engine: {err}") from None


def _load(source: DrafterSource, target: Any) -> Any:
    if source.path is None:
        return None
    try:
        return load_drafter(source.path, target).eval()
    except DrafterError as err:
        raise ConfigError(f"serve: the drafter from {source.origin} cannot serve this target: {err}") from None


def _carryover(sc: ServeConfig, drafter: Any) -> bool:
    if drafter is None:
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


def _policy(sc: ServeConfig, target: Any, drafter: Any, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    """(the adaptive draft-length policy or None for fixed γ, where its round profile came from)."""
    if not sc.adaptive or drafter is None:
        return None, None
    sizes = sorted({b for b in PROFILE_BATCH_SIZES if b < sc.max_ongoing_requests} | {1, sc.max_ongoing_requests})
    try:
        policy, stored = adaptive_policy(target, drafter, sc.profile_dir, sizes, kwargs)
    except ValueError as err:
        raise ConfigError(f"serve.profile_dir: {err}") from None
    return policy, stored.describe()
