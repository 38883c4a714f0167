"""The methods compared by the evaluation stage, one small factory each, looked up by name.

Ours (``components.engine``, timed by the engine itself, prefill included):

* ``target_only``   -- plain decoding, one target pass per token: the reference every speedup
  and every lossless check is measured against;
* ``drafter``       -- the speculative engine with the trained drafter (``drafter_dloop``:
  DLoop stages; ``drafter_tree``: token trees, ``TreeEngine``);
* ``prompt_lookup`` -- the speculative engine with the n-gram ``PromptLookupDrafter``.

Peers (transformers' ``generate`` on the same target object, see ``hf.py``):

* ``hf_generate``, ``hf_prompt_lookup``, ``hf_assisted`` (a separate small LM drafts).

vLLM peers (``VLLM_METHODS``, opt-in) run in vLLM's own environment, all in one subprocess after
ours: ``vllm_peers.py`` builds and runs them; only their names and checks live here.

A factory gets an :class:`EvalContext` (the loaded parts) and returns a function
``(prompt_ids, max_new_tokens, seed) -> PromptRun``. What a method needs that is missing (a
drafter, an assistant) is a :class:`ConfigError` naming the key to set.

Knows the engine and the generate wrappers; nothing about prompts' origin, MLflow or plots.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from components.config import ConfigError, EvalConfig
from components.drafters.capabilities import Capability, has
from components.engine import (
    RULES,
    PromptLookupDrafter,
    SpeculativeEngine,
    TreeEngine,
    target_only_generate,
)
from components.engine.engine import GenerationResult
from components.engine.tree import TREE_RULES
from components.evaluation.hf import hf_generate
from components.evaluation.metrics import PromptRun
from components.spec.sampling import SamplingParams

MethodFn = Callable[[list[int], int, int], PromptRun]  # (prompt_ids, max_new_tokens, seed) → run
REFERENCE = "target_only"
HF_REFERENCE = "hf_generate"


@dataclass
class EvalContext:
    """What the methods share: one target, its drafter and assistant (if any), the settings."""

    target: Any  # components.target.Target
    ev: EvalConfig
    drafter: Any = None  # a loaded drafter (engine protocol), for "drafter"
    assistant: Any = None  # an HF causal LM with the target's tokenizer, for "hf_assisted"
    assistant_path: str | None = None  # where that assistant is (vLLM loads it: "vllm_draft_model")
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)  # per method: γ, sizes, ...

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.ev.temperature)


def _from_engine(method: str, res: GenerationResult, drafting: bool) -> PromptRun:
    return PromptRun(method, "", res.tokens, res.total_seconds,
                     accepted=list(res.accepted) if drafting else [],
                     drafted=list(res.drafted) if drafting else [], target_forwards=res.target_forwards)


def target_only(ctx: EvalContext) -> MethodFn:
    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        res = target_only_generate(ctx.target, ids, n, ctx.sampling, seed, rule=ctx.ev.rule)
        return _from_engine("target_only", res, drafting=False)
    return run


def _engine_method(ctx: EvalContext, name: str, drafter: Any, gamma: int | None, **loop: Any) -> MethodFn:
    engine = SpeculativeEngine(ctx.target, drafter, rule=ctx.ev.rule, num_drafts=gamma, **loop)
    ctx.notes[name] = {"num_drafts": engine.gamma, "rule": ctx.ev.rule, **loop}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return _from_engine(name, engine.generate(ids, n, ctx.sampling, seed), drafting=True)
    return run


def _trained(ctx: EvalContext, method: str) -> Any:
    if ctx.drafter is None:
        raise ConfigError(f"eval.drafter_path: method '{method}' needs a trained drafter; set "
                          "eval.drafter_path or run the train stage first (or drop it from eval.methods)")
    if ctx.ev.carryover and not has(ctx.drafter, Capability.CARRYOVER):
        raise ConfigError(f"eval.carryover: the drafter '{ctx.drafter.cfg.name}' was not trained with the "
                          "carryover objective (no carryover embedding); set eval.carryover=false")
    return ctx.drafter


def drafter(ctx: EvalContext) -> MethodFn:
    run = _engine_method(ctx, "drafter", _trained(ctx, "drafter"), ctx.ev.num_drafts, carryover=ctx.ev.carryover)
    ctx.notes["drafter"]["parameters"] = int(ctx.drafter.num_parameters())
    return run


def drafter_dloop(ctx: EvalContext) -> MethodFn:
    """The trained drafter with DLoop multi-stage drafting (several blocks per verification)."""
    if ctx.ev.loop_stages < 2:
        raise ConfigError(f"eval.loop_stages: drafter_dloop needs at least 2 (got {ctx.ev.loop_stages})")
    return _engine_method(ctx, "drafter_dloop", _trained(ctx, "drafter_dloop"), ctx.ev.num_drafts,
                          loop_stages=ctx.ev.loop_stages, loop_gate=ctx.ev.loop_gate, carryover=ctx.ev.carryover)


def drafter_tree(ctx: EvalContext) -> MethodFn:
    """The trained drafter with token trees (batch 1): ``eval.tree_budget`` nodes per round."""
    ev = ctx.ev
    if ev.rule not in TREE_RULES:
        raise ConfigError(f"eval.rule: drafter_tree verifies trees under {list(TREE_RULES)}, not '{ev.rule}'")
    if ev.tree_builder not in ("ddtree", "causal") or ev.tree_budget < 1:
        raise ConfigError(f"eval.tree_builder/tree_budget: '{ev.tree_builder}'/{ev.tree_budget}; the builder is "
                          "ddtree or causal, the budget at least 1 node")
    try:
        engine = TreeEngine(ctx.target, _trained(ctx, "drafter_tree"), ev.rule, ev.num_drafts,
                            budget=ev.tree_budget, builder=ev.tree_builder)
    except ValueError as err:
        raise ConfigError(f"eval.tree_builder: {err}") from err
    ctx.notes["drafter_tree"] = {"num_drafts": engine.gamma, "rule": ev.rule, "budget": ev.tree_budget,
                                 "builder": ev.tree_builder}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return _from_engine("drafter_tree", engine.generate(ids, n, ctx.sampling, seed), drafting=True)
    return run


def prompt_lookup(ctx: EvalContext) -> MethodFn:
    ev = ctx.ev
    lookup = PromptLookupDrafter(ctx.target.vocab_size, ev.lookup_num_drafts, ev.lookup_max_ngram,
                                 device=ctx.target.device)
    run = _engine_method(ctx, "prompt_lookup", lookup, ev.lookup_num_drafts)
    ctx.notes["prompt_lookup"]["max_ngram"] = ev.lookup_max_ngram
    return run


def hf_plain(ctx: EvalContext) -> MethodFn:
    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return hf_generate(ctx.target.model, ids, n, ctx.ev.temperature, seed, method="hf_generate")
    return run


def hf_prompt_lookup(ctx: EvalContext) -> MethodFn:
    ev = ctx.ev
    ctx.notes["hf_prompt_lookup"] = {"num_drafts": ev.lookup_num_drafts, "max_ngram": ev.lookup_max_ngram}

    def run(ids: list[int], n: int, seed: int) -> PromptRun:
        return hf_generate(ctx.target.model, ids, n, ev.temperature, seed, method="hf_prompt_lookup",
                           prompt_lookup_num_tokens=ev.lookup_num_drafts,
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


METHODS: dict[str, Callable[[EvalContext], MethodFn]] = {
    "target_only": target_only, "drafter": drafter, "drafter_dloop": drafter_dloop, "drafter_tree": drafter_tree,
    "prompt_lookup": prompt_lookup,
    "hf_generate": hf_plain, "hf_prompt_lookup": hf_prompt_lookup, "hf_assisted": hf_assisted,
}
HF_METHODS = {"hf_generate", "hf_prompt_lookup", "hf_assisted"}
VLLM_METHODS = {"vllm_generate", "vllm_ngram", "vllm_suffix", "vllm_draft_model", "vllm_drafter"}
VLLM_REFERENCE = "vllm_generate"


def check_methods(ev: EvalConfig) -> list[str]:
    """The configured methods, reference first; unknown names and bad settings are ConfigErrors."""
    unknown = [m for m in ev.methods if m not in METHODS and m not in VLLM_METHODS]
    if unknown:
        raise ConfigError(f"eval.methods: unknown {unknown}; available: {list(METHODS) + sorted(VLLM_METHODS)}")
    if len(set(ev.methods)) != len(ev.methods):
        raise ConfigError(f"eval.methods: {list(ev.methods)} names a method twice")
    if ev.rule not in RULES:
        raise ConfigError(f"eval.rule: '{ev.rule}' is not one of {sorted(RULES)}")
    if ev.rule == "greedy" and ev.temperature > 0:
        raise ConfigError("eval.temperature: > 0 needs a sampling rule (eval.rule=speculative|block|gumbel); "
                          "the greedy rule ignores it")
    for key in ("num_prompts", "max_new_tokens", "lookup_num_drafts", "lookup_max_ngram", "vllm_draft_tokens"):
        if getattr(ev, key) < 1:
            raise ConfigError(f"eval.{key}: must be at least 1 (got {getattr(ev, key)})")
    if VLLM_METHODS & set(ev.methods):
        from components.evaluation.vllm_peers import vllm_python

        vllm_python(ev)  # a ConfigError naming eval.vllm_python and `make vllm-env` when missing
    return [REFERENCE] + [m for m in ev.methods if m != REFERENCE]


def exact_methods(ev: EvalConfig, methods: list[str]) -> set[str]:
    """Methods whose output must equal target_only's token for token under these settings:
    ours under greedy decoding or Gumbel coupling (output = f(target, seed)); the peers only greedy."""
    ours = ev.temperature == 0 or ev.rule in ("greedy", "gumbel")
    return {m for m in methods if (ev.temperature == 0 if m in HF_METHODS | VLLM_METHODS else ours)}


def build_methods(ctx: EvalContext, methods: list[str]) -> dict[str, MethodFn]:
    return {name: METHODS[name](ctx) for name in methods}
