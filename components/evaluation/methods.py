"""The methods compared by the evaluation stage, one small factory each, in one registry.

Ours (``components.engine``, timed by the engine itself, prefill included). The batch-1 chains
(``target_only``, ``drafter``, ``drafter_dloop``, ``prompt_lookup``, ``suffix``, ``hybrid``) run the target's
fast step where ``target.step`` chose it (``EvalContext.chain_target``); the tree and batch
engines run the transformers forward:

* ``target_only``   -- plain decoding, one target pass per token: the reference every speedup
  and every lossless check is measured against;
* ``drafter``       -- the speculative engine with the trained drafter at a fixed γ
  (``drafter_dloop``: DLoop stages behind a log-probability gate; ``drafter_tree``: token trees,
  ``TreeEngine``; ``drafter_adaptive``: the batch engine as the serve stage runs it, the draft
  cap (0 = a plain round) chosen per round from a round profile and the acceptance seen);
* ``prompt_lookup`` -- the speculative engine with the n-gram ``PromptLookupDrafter``;
* ``suffix``        -- the speculative engine with suffix decoding (``SuffixDrafter``, opt-in): the
  request's own suffix tree beside a global one of the responses before it, so it learns over
  the prompts in turn as a server over its requests (its τ depends on their order).
* ``hybrid``        -- the trained drafter and suffix decoding (``HybridDrafter``, opt-in): per round
  the suffix draft when its score clears ``eval.hybrid_suffix_threshold``, else the drafter's, at
  the ``drafter`` method's settings; learning the responses as ``suffix`` does.
* ``suffix_adaptive``, ``hybrid_adaptive`` -- those two drafters as the serve stage serves them:
  the batch engine under the adaptive cap (``drafter_adaptive``'s), learning as ``suffix`` does.

Peers (transformers' ``generate`` on the same target object, see ``hf.py``):

* ``hf_generate``, ``hf_prompt_lookup``, ``hf_assisted`` (a separate small LM drafts).

vLLM peers (``vllm_peers.VLLM_METHODS``, opt-in) run in vLLM's own environment, all in one
subprocess after ours; their registry entries live beside the code that builds them and are
merged into ``METHODS`` here.

A factory gets an :class:`EvalContext` (the loaded parts) and returns a function
``(prompt_ids, max_new_tokens, seed) -> PromptRun``. What a method needs that is missing (a
drafter, an assistant) is a :class:`ConfigError` naming the key to set. What the stage, the
runner and the report need to know about a method (which parts to load, where it runs, which
baseline it has) is a field of its :class:`Method` entry, never a test on its name.

Knows the engine and the generate wrappers; nothing about prompts' origin, MLflow or plots.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from typing import Any

from components.config import ConfigError, EvalConfig
from components.config_suffix import suffix_problems
from components.drafters.capabilities import Capability, CapabilityError, require
from components.engine import (
    OPEN_GATE,
    RULES,
    TREE_BUILDERS,
    GenerationResult,
    HybridDrafter,
    PromptLookupDrafter,
    Request,
    SpeculativeEngine,
    SuffixDrafter,
    TreeEngine,
    adaptive_engine,
    loop_stages_for,
    resolve_settings,
    suffix_drafter,
    target_only_generate,
)
from components.evaluation.context import EvalContext, Method, MethodFn, Peer
from components.evaluation.hf import hf_generate
from components.evaluation.metrics import PromptRun
from components.evaluation.vllm_peers import VLLM_METHODS, VLLM_REFERENCE, vllm_python
from components.ruleset import rules_where

REFERENCE = "target_only"
PEER_BASELINES: dict[Peer, str] = {"hf": "hf_generate", "vllm": VLLM_REFERENCE}  # peer → its plain decoding


def _from_engine(method: str, res: GenerationResult, drafting: bool) -> PromptRun:
    return PromptRun(method, "", res.tokens, res.total_seconds,
                     accepted=list(res.accepted) if drafting else [],
                     drafted=list(res.drafted) if drafting else [], target_forwards=res.target_forwards,
                     prefill_seconds=res.prefill_seconds)


def target_only(ctx: EvalContext) -> MethodFn:
    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        res = target_only_generate(ctx.chain_target, ids, n, ctx.sampling, seed, rule=ctx.ev.rule)
        return _from_engine("target_only", res, drafting=False)
    return run


def _engine_method(ctx: EvalContext, name: str, drafter: Any, gamma: int | None, **loop: Any) -> MethodFn:
    engine = SpeculativeEngine(ctx.chain_target, drafter, rule=ctx.ev.rule, num_speculative_tokens=gamma, **loop)
    ctx.notes[name] = {"num_speculative_tokens": engine.settings.num_speculative_tokens, "rule": ctx.ev.rule, **loop}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return _from_engine(name, engine.generate(ids, n, ctx.sampling, seed), drafting=True)
    return run


def _require(drafter: Any, key: str, feature: str, capability: Capability, hint: str) -> None:
    """A ConfigError naming ``key``, the drafter and the capability it does not declare."""
    try:
        require(drafter, feature, capability, hint=hint)
    except CapabilityError as err:
        raise ConfigError(f"{key}: {err}") from None


def _trained(ctx: EvalContext, method: str) -> Any:
    drafter = ctx.trained_drafter(method)
    if ctx.ev.carryover:
        _require(drafter, "eval.carryover", "carryover decoding", Capability.CARRYOVER,
                 "Train it with the carryover objective (drafter.carryover=true), or set eval.carryover=false")
    return drafter


def drafter(ctx: EvalContext) -> MethodFn:
    run = _engine_method(ctx, "drafter", _trained(ctx, "drafter"), ctx.ev.num_speculative_tokens, carryover=ctx.ev.carryover)
    ctx.notes["drafter"]["parameters"] = int(ctx.drafter.num_parameters())
    return run


def drafter_dloop(ctx: EvalContext) -> MethodFn:
    """The trained drafter with DLoop multi-stage drafting (several blocks per verification)."""
    if ctx.ev.loop_stages < 2:
        raise ConfigError(f"eval.loop_stages: drafter_dloop needs at least 2 (got {ctx.ev.loop_stages})")
    return _engine_method(ctx, "drafter_dloop", _trained(ctx, "drafter_dloop"), ctx.ev.num_speculative_tokens,
                          loop_stages=ctx.ev.loop_stages, loop_gate=ctx.ev.loop_gate, carryover=ctx.ev.carryover)


def drafter_adaptive(ctx: EvalContext) -> MethodFn:
    """The trained drafter as the serve stage runs it (batch 1): the batch engine with the
    adaptive draft cap, priced from a round profile stored per host (``eval.profile_dir``), over
    up to γ·``eval.loop_stages`` drafts when the drafter drafts on its own states (DLoop stages,
    the cap deciding how many a round drafts); a cap of 0 is a plain round. The policy learns
    over the prompts in turn, as a server's does over its requests."""
    return _adaptive(ctx, "drafter_adaptive", _trained(ctx, "drafter_adaptive"), ctx.ev.num_speculative_tokens)


def suffix_adaptive(ctx: EvalContext) -> MethodFn:
    """Suffix decoding as ``serve.drafter=suffix`` serves it: the ``suffix`` method's drafter
    (and its learning) in the batch engine under the adaptive cap (``drafter_adaptive``'s)."""
    drafter, settings = _suffix_drafter(ctx)
    run = _adaptive(ctx, "suffix_adaptive", drafter, None, learner=drafter)
    ctx.notes["suffix_adaptive"] |= settings
    return run


def hybrid_adaptive(ctx: EvalContext) -> MethodFn:
    """The ``hybrid`` method's drafter as ``serve.drafter=hybrid`` serves it: in the batch engine
    under the adaptive cap, with DLoop stages (a suffix round drafts up to the cap along its
    match, a model round up to the cap over the trained drafter's stages)."""
    hybrid_drafter, notes = _hybrid_drafter(ctx, "hybrid_adaptive")
    run = _adaptive(ctx, "hybrid_adaptive", hybrid_drafter, ctx.ev.num_speculative_tokens, learner=hybrid_drafter)
    ctx.notes["hybrid_adaptive"] |= notes
    return run


def _adaptive(ctx: EvalContext, name: str, drafter: Any, gamma: int | None,
              learner: SuffixDrafter | HybridDrafter | None = None) -> MethodFn:
    """``drafter`` in the batch engine under the adaptive cap (batch 1, as served); a ``learner``
    learns each response as ``_learning`` does (the engine itself does not: its responses would
    carry no key, and a prompt run again would be drafted from its own answer)."""
    ev = ctx.ev
    stages = loop_stages_for(drafter, ev.loop_stages)
    settings = resolve_settings(drafter, gamma, stages, OPEN_GATE, ev.carryover)
    engine, stored = adaptive_engine(ctx.chain_target, drafter, settings, ev.profile_dir, 1,
                                     notice=lambda path: _timing_notice(name, path), learn_responses=False)
    ctx.notes[name] = {"num_speculative_tokens": settings.num_speculative_tokens, "max_cap": settings.max_cap,
                       "loop_stages": stages, "rule": ev.rule,
                       "round_profile": "stored" if stored.reused else "measured"}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        if learner is not None:
            learner.forget(tuple(ids))
        out = _from_engine(name, engine.generate([Request(ids, n, ctx.sampling, seed, rule=ev.rule)])[0],
                           drafting=True)
        if learner is not None:
            clock = time.perf_counter()
            learner.observe(out.tokens, key=tuple(ids))
            out.seconds += time.perf_counter() - clock
        return out
    return run


def _timing_notice(name: str, path: Any) -> None:
    print(f"eval: {name}: timing the engine's rounds at every draft cap (once per host) → {path}",
          file=sys.stderr, flush=True)


def drafter_tree(ctx: EvalContext) -> MethodFn:
    """The trained drafter with token trees (batch 1): ``eval.tree_budget`` nodes per round."""
    ev = ctx.ev
    if ev.rule not in rules_where(trees=True):
        raise ConfigError(f"eval.rule: drafter_tree verifies trees under {rules_where(trees=True)}, not '{ev.rule}'")
    if ev.tree_builder not in TREE_BUILDERS or ev.tree_budget < 1:
        raise ConfigError(f"eval.tree_builder/tree_budget: '{ev.tree_builder}'/{ev.tree_budget}; the builder is "
                          "ddtree or causal, the budget at least 1 node")
    trained = _trained(ctx, "drafter_tree")
    if ev.tree_builder == "causal":
        _require(trained, "eval.tree_builder", "causal token trees", Capability.CAUSAL_TREE_HEAD,
                 "Use eval.tree_builder=ddtree")
    try:
        engine = TreeEngine(ctx.target, trained, ev.rule, ev.num_speculative_tokens, budget=ev.tree_budget,
                            builder=ev.tree_builder)
    except ValueError as err:
        raise ConfigError(f"eval.tree_builder: {err}") from err
    ctx.notes["drafter_tree"] = {"num_speculative_tokens": engine.settings.num_speculative_tokens, "rule": ev.rule,
                                 "budget": ev.tree_budget, "builder": ev.tree_builder}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return _from_engine("drafter_tree", engine.generate(ids, n, ctx.sampling, seed), drafting=True)
    return run


def prompt_lookup(ctx: EvalContext) -> MethodFn:
    ev = ctx.ev
    lookup = PromptLookupDrafter(ctx.target.vocab_size, ev.lookup_num_speculative_tokens, ev.lookup_max_ngram,
                                 device=ctx.target.device)
    run = _engine_method(ctx, "prompt_lookup", lookup, ev.lookup_num_speculative_tokens)
    ctx.notes["prompt_lookup"]["max_ngram"] = ev.lookup_max_ngram
    return run


def _suffix_drafter(ctx: EvalContext) -> tuple[SuffixDrafter, dict[str, Any]]:
    """Suffix decoding as the ``suffix_*`` settings say, and those settings for the notes."""
    ev = ctx.ev
    settings = {"max_tree_depth": ev.suffix_max_tree_depth, "max_spec_factor": ev.suffix_max_spec_factor,
                "min_token_prob": ev.suffix_min_token_prob, "max_cached_responses": ev.suffix_max_cached_responses,
                "rollouts": ctx.rollouts_from, "rollout_responses": len(ctx.rollouts)}
    return suffix_drafter(ev, ctx.target.vocab_size, ctx.target.device, responses=ctx.rollouts), settings


def _learning(ctx: EvalContext, name: str, engine: SpeculativeEngine, drafter: SuffixDrafter | HybridDrafter) -> MethodFn:
    """``engine``'s runs, each response then joining the drafter's global tree (its cost counted in
    the run's seconds, as a server pays it); a prompt run again (the warmup's) first drops its
    earlier response, so that no prompt is drafted from its own answer."""
    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        drafter.forget(tuple(ids))
        out = _from_engine(name, engine.generate(ids, n, ctx.sampling, seed), drafting=True)
        clock = time.perf_counter()
        drafter.observe(out.tokens, key=tuple(ids))
        out.seconds += time.perf_counter() - clock
        return out
    return run


def suffix(ctx: EvalContext) -> MethodFn:
    """Suffix decoding, learning each response in turn (``_learning``)."""
    drafter, settings = _suffix_drafter(ctx)
    engine = SpeculativeEngine(ctx.chain_target, drafter, rule=ctx.ev.rule)
    ctx.notes["suffix"] = {"num_speculative_tokens": engine.settings.num_speculative_tokens, "rule": ctx.ev.rule,
                           **settings}
    return _learning(ctx, "suffix", engine, drafter)


def hybrid(ctx: EvalContext) -> MethodFn:
    """The trained drafter at the ``drafter`` method's settings (γ, carryover) beside suffix decoding
    (the ``suffix`` method's), per round the suffix draft when its score is ≥
    ``eval.hybrid_suffix_threshold`` (None: γ, Arctic Inference's rule), else the trained
    drafter's (``HybridDrafter``); learning each response as ``suffix`` does. Here a suffix round
    drafts at most γ (one stage, as the drafter's rounds). The notes count the rounds each side
    drafted, the warmup's included."""
    ev = ctx.ev
    hybrid_drafter, notes = _hybrid_drafter(ctx, "hybrid")
    settings = resolve_settings(hybrid_drafter, ev.num_speculative_tokens, carryover=ev.carryover)
    engine = SpeculativeEngine(ctx.chain_target, hybrid_drafter, rule=ev.rule, settings=settings)
    ctx.notes["hybrid"] = {"num_speculative_tokens": settings.num_speculative_tokens, "rule": ev.rule,
                           "carryover": ev.carryover, **notes}
    return _learning(ctx, "hybrid", engine, hybrid_drafter)


def _hybrid_drafter(ctx: EvalContext, method: str) -> tuple[HybridDrafter, dict[str, Any]]:
    """The trained drafter beside the ``suffix`` method's drafter, the suffix threshold
    ``eval.hybrid_suffix_threshold`` (None: the trained drafter's γ), and notes on both."""
    ev, trained = ctx.ev, _trained(ctx, method)
    gamma = resolve_settings(trained, ev.num_speculative_tokens).num_speculative_tokens
    threshold = float(gamma if ev.hybrid_suffix_threshold is None else ev.hybrid_suffix_threshold)
    suffix_side, suffix_settings = _suffix_drafter(ctx)
    drafter = HybridDrafter(trained, suffix_side, threshold)
    return drafter, {"suffix_threshold": threshold, "suffix_num_speculative_tokens": ev.suffix_num_speculative_tokens,
                     **suffix_settings, "rounds_by_side": drafter.drafted_by}


def hf_plain(ctx: EvalContext) -> MethodFn:
    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return hf_generate(ctx.target.model, ids, n, ctx.ev.temperature, seed, method="hf_generate")
    return run


def hf_prompt_lookup(ctx: EvalContext) -> MethodFn:
    ev = ctx.ev
    ctx.notes["hf_prompt_lookup"] = {"num_speculative_tokens": ev.lookup_num_speculative_tokens, "max_ngram": ev.lookup_max_ngram}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return hf_generate(ctx.target.model, ids, n, ev.temperature, seed, method="hf_prompt_lookup",
                           prompt_lookup_num_tokens=ev.lookup_num_speculative_tokens,
                           max_matching_ngram_size=ev.lookup_max_ngram)
    return run


def hf_assisted(ctx: EvalContext) -> MethodFn:
    if ctx.assistant is None:
        raise ConfigError("eval.assistant: method 'hf_assisted' needs an assistant model with the "
                          "target's tokenizer; set eval.assistant (or drop hf_assisted from eval.methods)")
    ev = ctx.ev
    fields = {"num_assistant_tokens": ev.assistant_num_tokens} if ev.assistant_num_tokens else {}
    ctx.notes["hf_assisted"] = {"assistant_parameters": sum(p.numel() for p in ctx.assistant.parameters()),
                                "num_assistant_tokens": ev.assistant_num_tokens or "transformers default"}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return hf_generate(ctx.target.model, ids, n, ev.temperature, seed, method="hf_assisted",
                           assistant_model=ctx.assistant, **fields)
    return run


METHODS: dict[str, Method] = {
    "target_only": Method(build=target_only),
    "drafter": Method(build=drafter, needs_drafter=True),
    "drafter_dloop": Method(build=drafter_dloop, needs_drafter=True),
    "drafter_adaptive": Method(build=drafter_adaptive, needs_drafter=True),
    "drafter_tree": Method(build=drafter_tree, needs_drafter=True),
    "prompt_lookup": Method(build=prompt_lookup),
    "suffix": Method(build=suffix, needs_rollouts=True),
    "hybrid": Method(build=hybrid, needs_drafter=True, needs_rollouts=True),
    "suffix_adaptive": Method(build=suffix_adaptive, needs_rollouts=True),
    "hybrid_adaptive": Method(build=hybrid_adaptive, needs_drafter=True, needs_rollouts=True),
    "hf_generate": Method(build=hf_plain, peer="hf"),
    "hf_prompt_lookup": Method(build=hf_prompt_lookup, peer="hf"),
    "hf_assisted": Method(build=hf_assisted, peer="hf", needs_assistant=True),
    **VLLM_METHODS,
}


def of_peer(peer: Peer, names: Iterable[str]) -> set[str]:
    """The methods among ``names`` that are ``peer``'s (ours, transformers', vLLM's)."""
    return {n for n in names if METHODS[n].peer == peer}


def needs_drafter(names: Iterable[str]) -> bool:
    return any(METHODS[n].needs_drafter for n in names)


def needs_assistant(names: Iterable[str]) -> bool:
    return any(METHODS[n].needs_assistant for n in names)


def needs_rollouts(names: Iterable[str]) -> bool:
    return any(METHODS[n].needs_rollouts for n in names)


def check_methods(ev: EvalConfig) -> list[str]:
    """The configured methods, reference first; unknown names and bad settings are ConfigErrors."""
    unknown = [m for m in ev.methods if m not in METHODS]
    if unknown:
        raise ConfigError(f"eval.methods: unknown {unknown}; available: {list(METHODS)}")
    if len(set(ev.methods)) != len(ev.methods):
        raise ConfigError(f"eval.methods: {list(ev.methods)} names a method twice")
    if ev.rule not in RULES:
        raise ConfigError(f"eval.rule: '{ev.rule}' is not one of {sorted(RULES)}")
    if ev.temperature > 0 and ev.rule not in rules_where(samples=True):
        raise ConfigError(f"eval.temperature: > 0 needs a sampling rule (eval.rule={'|'.join(rules_where(samples=True))}); "
                          f"the {ev.rule} rule ignores it")
    for key in ("num_prompts", "max_new_tokens", "lookup_num_speculative_tokens", "lookup_max_ngram", "vllm_num_speculative_tokens"):
        if getattr(ev, key) < 1:
            raise ConfigError(f"eval.{key}: must be at least 1 (got {getattr(ev, key)})")
    _check_suffix(ev)
    if any(METHODS[m].in_vllm for m in ev.methods):
        vllm_python(ev)  # a ConfigError naming eval.vllm_python and `make vllm-env` when missing
    return [REFERENCE] + [m for m in ev.methods if m != REFERENCE]


def _check_suffix(ev: EvalConfig) -> None:
    """The suffix and hybrid methods' settings in range (a ConfigError naming the keys)."""
    problems = suffix_problems(ev)
    if problems:
        raise ConfigError("eval." + "; eval.".join(problems))


def exact_methods(ev: EvalConfig, methods: list[str], precision: str = "float32") -> set[str]:
    """Methods whose output must equal target_only's token for token under these settings:
    ours under greedy decoding or Gumbel coupling (output = f(target, seed)); the peers only greedy,
    and only where our target's step computes in float32 (``precision``: ``target.step_precision``;
    the peers run the model in their own arithmetic, so against a bfloat16 step they differ by
    design, not by a fault: ``runner.check_lossless`` counts those prompts instead)."""
    ours = ev.temperature == 0 or ev.rule in rules_where(coupled=True)
    peers = ev.temperature == 0 and precision == "float32"
    return {m for m in methods if (ours if METHODS[m].peer == "ours" else peers)}


def build_methods(ctx: EvalContext, methods: list[str]) -> dict[str, MethodFn]:
    """The in-process methods among ``methods``, built (vLLM's are planned by ``vllm_peers``)."""
    return {name: METHODS[name].build(ctx) for name in methods if METHODS[name].build is not None}
