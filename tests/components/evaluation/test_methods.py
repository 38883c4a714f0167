"""The method registry carries what the stage needs to know, and the drafter methods read the
drafter's declared capabilities: declared → the method runs; not declared → a ConfigError that
names the key, the drafter and the capability."""

from __future__ import annotations

import pytest
import torch

from components.config import ConfigError, DrafterConfig, EvalConfig
from components.drafters import build_drafter
from components.drafters.capabilities import Capability
from components.evaluation import (
    METHODS,
    EvalContext,
    check_methods,
    compare_methods,
    needs_assistant,
    needs_drafter,
)
from components.evaluation import methods as methods_module

NEW = 10


def _dspark(tiny_target, **cfg):
    torch.manual_seed(0)
    return build_drafter(DrafterConfig(name="dspark", num_layers=1, block_size=4, markov_rank=8, **cfg),
                         tiny_target).eval()


def _without(drafter, capability: Capability):
    """The same drafter, declaring everything but ``capability``."""
    declared = drafter.capabilities() - {capability}
    drafter.capabilities = lambda: declared
    return drafter


def _ctx(tiny_target, drafter, **ev) -> EvalContext:
    return EvalContext(tiny_target, EvalConfig(max_new_tokens=NEW, warmup=False, **ev), drafter=drafter)


def test_registry_says_what_each_method_needs_and_where_it_runs():
    assert needs_drafter(["target_only", "drafter_tree"]) and needs_drafter(["vllm_drafter"]) and needs_drafter(["hybrid"])
    assert not needs_drafter(["target_only", "prompt_lookup", "suffix", "hf_assisted", "vllm_ngram"])
    assert needs_assistant(["hf_assisted"]) and needs_assistant(["vllm_draft_model"])
    assert not needs_assistant(["drafter", "hf_prompt_lookup", "vllm_generate"])
    assert {n for n, m in METHODS.items() if m.in_vllm} == {n for n, m in METHODS.items() if m.peer == "vllm"}
    assert METHODS["vllm_drafter"].engine_twin == "drafter" and METHODS["drafter"].build is not None


def test_carryover_runs_with_a_drafter_that_declares_it(tiny_target, eval_prompt_list):
    ctx = _ctx(tiny_target, _dspark(tiny_target, carryover=True), methods=["target_only", "drafter"],
               carryover=True)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list[:1])
    assert report.failures == [] and report.summaries["drafter"].lossless is True
    assert report.summaries["drafter"].extra["carryover"] is True


def test_carryover_is_refused_when_not_declared(tiny_target, eval_prompt_list):
    ctx = _ctx(tiny_target, _without(_dspark(tiny_target, carryover=True), Capability.CARRYOVER),
               methods=["drafter"], carryover=True)
    with pytest.raises(ConfigError, match=r"eval\.carryover: .*needs capability carryover; drafter 'dspark'"):
        compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list[:1])


def test_causal_trees_are_refused_when_the_tree_head_is_not_declared(tiny_target, eval_prompt_list):
    ctx = _ctx(tiny_target, _without(_dspark(tiny_target), Capability.CAUSAL_TREE_HEAD),
               methods=["drafter_tree"], tree_builder="causal", tree_budget=4)
    with pytest.raises(ConfigError, match=r"eval\.tree_builder: .*needs capability causal_tree_head; drafter 'dspark'"):
        METHODS["drafter_tree"].build(ctx)
    ctx.ev = EvalConfig(max_new_tokens=NEW, warmup=False, methods=["drafter_tree"], tree_builder="ddtree",
                        tree_budget=4)
    METHODS["drafter_tree"].build(ctx)  # the per-depth trees need no tree head


def test_drafter_adaptive_is_lossless_with_its_profile_stored_for_the_next_run(tiny_target, eval_prompt_list,
                                                                                tmp_path):
    """The serve stage's way of drafting (adaptive cap over γ·loop_stages, DLoop stages for a
    block drafter), at batch 1: the target's own greedy output; the round profile is measured
    once under eval.profile_dir and read back the next time."""
    settings = {"methods": ["target_only", "drafter_adaptive"], "profile_dir": str(tmp_path), "loop_stages": 2}
    for want in ("measured", "stored"):
        ctx = _ctx(tiny_target, _dspark(tiny_target), **settings)
        report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
        summary = report.summaries["drafter_adaptive"]
        assert report.failures == [] and summary.lossless is True
        assert summary.extra["round_profile"] == want and summary.extra["max_cap"] == 8  # γ 4 × 2 stages
    assert len(list(tmp_path.glob("round-profile-*.json"))) == 1


def test_suffix_is_lossless_and_never_drafts_a_prompt_from_its_own_answer(tiny_target, eval_prompt_list):
    """The global tree learns each response, but a prompt run again (as after the warmup) first
    drops its own: its second run drafts exactly as a fresh method's first."""
    ctx = _ctx(tiny_target, None, methods=["target_only", "suffix"], suffix_num_speculative_tokens=4,
               suffix_max_tree_depth=16)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    assert report.failures == [] and report.summaries["suffix"].lossless is True
    assert report.summaries["suffix"].extra["num_speculative_tokens"] == 4
    _reruns_like_fresh(ctx, "suffix", list(eval_prompt_list[0].input_ids))


@pytest.mark.parametrize("threshold, carryover", [(None, False), (0.0, True)])
def test_hybrid_is_lossless_learns_responses_and_counts_its_sides(tiny_target, eval_prompt_list, threshold, carryover):
    """The trained drafter beside suffix decoding: the target's greedy output; the threshold
    defaults to γ; each response joins the global tree, and a prompt run again drafts as a fresh
    method's first run (its own answer dropped first)."""
    ctx = _ctx(tiny_target, _dspark(tiny_target, carryover=carryover), methods=["target_only", "hybrid"],
               suffix_num_speculative_tokens=4, suffix_max_tree_depth=16, hybrid_suffix_threshold=threshold,
               carryover=carryover)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    notes = report.summaries["hybrid"].extra
    assert report.failures == [] and report.summaries["hybrid"].lossless is True
    assert notes["suffix_threshold"] == (4.0 if threshold is None else threshold) and notes["carryover"] is carryover
    assert sum(notes["rounds_by_side"].values()) == sum(len(r.accepted) for r in report.runs["hybrid"])
    _reruns_like_fresh(ctx, "hybrid", list(eval_prompt_list[0].input_ids))


def _reruns_like_fresh(ctx, method: str, prompt: list[int]) -> None:
    """A prompt run again by a learning method drafts as a fresh method's first run does (its
    own earlier answer dropped from the global tree first)."""
    fresh = METHODS[method].build(ctx)(prompt, NEW, 0)
    rerun = METHODS[method].build(ctx)
    rerun(prompt, NEW, 0)
    second = rerun(prompt, NEW, 0)
    assert second.tokens == fresh.tokens and (second.accepted, second.drafted) == (fresh.accepted, fresh.drafted)


@pytest.mark.parametrize("method", ["suffix_adaptive", "hybrid_adaptive"])
def test_suffix_and_hybrid_as_served_are_lossless_and_learn_each_prompt_once(tiny_target, eval_prompt_list, tmp_path,
                                                                             monkeypatch, method):
    """Suffix decoding and the hybrid in the batch engine under the adaptive cap: the target's
    greedy output; the global tree keeps one response per prompt, under the prompt (the engine
    does not learn on its own), so a prompt run again is never drafted from its own answer."""
    built = []
    real = methods_module.suffix_drafter
    monkeypatch.setattr(methods_module, "suffix_drafter", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    drafter = _dspark(tiny_target) if method == "hybrid_adaptive" else None
    ctx = _ctx(tiny_target, drafter, methods=["target_only", method], suffix_num_speculative_tokens=4,
               suffix_max_tree_depth=16, profile_dir=str(tmp_path), loop_stages=2)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    assert report.failures == [] and report.summaries[method].lossless is True
    assert report.summaries[method].extra["round_profile"] == "measured"
    prompts = {tuple(p.input_ids) for p in eval_prompt_list}
    assert set(built[0].responses.kept) == prompts
    run = METHODS[method].build(ctx)
    prompt = list(eval_prompt_list[0].input_ids)
    first, second = run(prompt, NEW, 0), run(prompt, NEW, 0)
    assert first.tokens == second.tokens and list(built[-1].responses.kept) == [tuple(prompt)]


def test_hybrid_needs_the_trained_drafter():
    with pytest.raises(ConfigError, match=r"eval\.drafter_path: method 'hybrid' needs a trained drafter"):
        METHODS["hybrid"].build(EvalContext(None, EvalConfig(methods=["hybrid"])))


@pytest.mark.parametrize("value", [-0.5, float("nan")])
def test_hybrid_threshold_out_of_range_is_a_config_error(value):
    with pytest.raises(ConfigError, match=r"eval\.hybrid_suffix_threshold"):
        check_methods(EvalConfig(methods=["target_only", "hybrid"], hybrid_suffix_threshold=value))
    check_methods(EvalConfig(methods=["target_only", "hybrid"], hybrid_suffix_threshold=float("inf")))


@pytest.mark.parametrize("key, value", [("suffix_max_tree_depth", 16), ("suffix_min_token_prob", 1.5),
                                        ("suffix_max_spec_factor", 0.0), ("suffix_max_cached_responses", -1)])
def test_suffix_settings_out_of_range_are_config_errors(key, value):
    ev = EvalConfig(methods=["target_only", "suffix"], suffix_num_speculative_tokens=16, **{key: value})
    with pytest.raises(ConfigError, match=rf"eval\.{key}"):
        check_methods(ev)
