"""Every method on the same prompts: greedy outputs equal target_only's, speedups come from the
same run, and a method that changes the output is caught and explained."""

from __future__ import annotations

import logging

import pytest
import torch

from components.config import ConfigError, EvalConfig
from components.drafters import load_drafter
from components.evaluation import METHODS, EvalContext, Method, check_methods, compare_methods
from components.evaluation.assistant import load_assistant
from components.evaluation.metrics import PromptRun

NEW = 12
ALL = ["target_only", "drafter", "drafter_adaptive", "drafter_dloop", "prompt_lookup", "hf_generate", "hf_prompt_lookup", "hf_assisted"]


def _ctx(tiny_target, tiny_target_build, drafter_path, **ev) -> EvalContext:
    profiles = str(tiny_target_build[0].parent / "round-profiles")  # the session's, not the home cache
    cfg = EvalConfig(max_new_tokens=NEW, lookup_num_speculative_tokens=4, warmup=False,
                     **{"profile_dir": profiles, **ev})
    # The assistant only has to share the tokenizer: the fixture target itself, loaded again.
    return EvalContext(tiny_target, cfg, drafter=load_drafter(drafter_path, tiny_target).eval(),
                       assistant=load_assistant(str(tiny_target_build[0]), tiny_target))


def test_all_methods_greedy_lossless_with_speedups(tiny_target, tiny_target_build, drafter_path, eval_prompt_list):
    ctx = _ctx(tiny_target, tiny_target_build, drafter_path)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    assert list(report.summaries) == ALL and report.failures == []
    for name, s in report.summaries.items():
        assert s.new_tokens == NEW * len(eval_prompt_list) and s.tokens_per_s > 0
        assert s.lossless is (None if name == "target_only" else True), name
        assert s.speedup == pytest.approx(s.tokens_per_s / report.summaries["target_only"].tokens_per_s)
    assert report.summaries["target_only"].tau == 1.0 and report.summaries["drafter"].rounds > 0
    assert report.summaries["hf_assisted"].speedup_vs_hf_generate is not None
    assert report.summaries["drafter"].extra["num_speculative_tokens"] == 4  # block_size 4 DSpark
    assert report.summaries["drafter_dloop"].extra["loop_stages"] == 3
    # the assistant is the target itself: every draft it proposes is accepted
    assisted = report.summaries["hf_assisted"]
    assert assisted.acceptance_by_position and min(assisted.acceptance_by_position) == 1.0
    # per prompt set: every method again over that set's prompt alone, speedups within the set
    assert list(report.sets) == ["humaneval", "text"]
    for group in report.sets.values():
        assert list(group) == ALL and all(s.prompts == 1 and s.new_tokens == NEW for s in group.values())
        assert all(s.lossless is (None if n == "target_only" else True) for n, s in group.items())
        assert group["drafter"].speedup == pytest.approx(group["drafter"].tokens_per_s / group["target_only"].tokens_per_s)


def test_a_method_that_changes_the_output_is_not_lossless(tiny_target, tiny_target_build, drafter_path,
                                                          eval_prompt_list, monkeypatch, caplog):
    def broken(ctx):
        def run(ids, n, seed):
            tokens = METHODS["target_only"].build(ctx)(ids, n, seed).tokens
            # the target's least likely token there: a margin far from a near-tie on any machine
            logits = ctx.target.forward(torch.tensor([ids + tokens[:3]], device=ctx.target.device)).logits
            tokens[3] = int(logits[0, -1].argmin())
            return PromptRun("prompt_lookup", "", tokens, 1.0)
        return run

    monkeypatch.setitem(METHODS, "prompt_lookup", Method(build=broken))
    ctx = _ctx(tiny_target, tiny_target_build, drafter_path, methods=["target_only", "prompt_lookup"])
    with caplog.at_level(logging.ERROR):
        report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    s = report.summaries["prompt_lookup"]
    assert report.failures == ["prompt_lookup"] and s.lossless is False
    assert [m.index for m in s.mismatches] == [3] * len(eval_prompt_list)
    assert all(m.margin is not None and m.margin > 0 and m.near_tie is False for m in s.mismatches)
    assert "NOT LOSSLESS: prompt_lookup" in caplog.text


def test_sampled_rules_are_not_checked_token_for_token(tiny_target, tiny_target_build, drafter_path,
                                                       eval_prompt_list):
    ctx = _ctx(tiny_target, tiny_target_build, drafter_path, methods=["drafter", "prompt_lookup"],
               rule="speculative", temperature=0.8)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list[:1])
    assert report.summaries["drafter"].lossless is None and report.summaries["drafter"].new_tokens == NEW


@pytest.mark.parametrize("ev, key", [
    (EvalConfig(methods=["target_only", "nope"]), "eval.methods"),
    (EvalConfig(rule="greedy", temperature=0.5), "eval.temperature"),
    (EvalConfig(rule="beam"), "eval.rule"),
    (EvalConfig(max_new_tokens=0), "eval.max_new_tokens"),
])
def test_bad_settings_name_their_key(ev, key):
    with pytest.raises(ConfigError, match=key):
        check_methods(ev)


def test_missing_drafter_or_assistant_names_the_key(tiny_target, eval_prompt_list):
    for method, key in (("drafter", "eval.drafter_path"), ("drafter_dloop", "eval.drafter_path"),
                        ("hf_assisted", "eval.assistant")):
        ctx = EvalContext(tiny_target, EvalConfig(methods=[method]))
        with pytest.raises(ConfigError, match=key):
            compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)


def test_carryover_needs_a_carryover_trained_drafter(tiny_target, tiny_target_build, drafter_path, eval_prompt_list):
    ctx = _ctx(tiny_target, tiny_target_build, drafter_path, methods=["drafter"], carryover=True)
    with pytest.raises(ConfigError, match="eval.carryover"):
        compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)


@pytest.mark.parametrize("builder", ["ddtree", "causal"])
def test_drafter_tree_method_is_lossless(tiny_target, tiny_target_build, drafter_path, eval_prompt_list, builder):
    ctx = _ctx(tiny_target, tiny_target_build, drafter_path, methods=["target_only", "drafter_tree"],
               tree_budget=6, tree_builder=builder)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    s = report.summaries["drafter_tree"]
    assert report.failures == [] and s.lossless is True and s.rounds > 0
    assert s.extra["budget"] == 6 and s.extra["builder"] == builder
    bad = _ctx(tiny_target, tiny_target_build, drafter_path, methods=["drafter_tree"], rule="block")
    with pytest.raises(ConfigError, match="eval.rule"):
        METHODS["drafter_tree"].build(bad)


def test_a_near_tie_is_judged_in_the_targets_own_rounding():
    """bfloat16 logits of ~20 are multiples of 0.125: two tokens a unit or two apart are a
    numerical tie there (a multi-token pass and a one-token step may order them either way),
    while in float32 the same gap is a real difference."""
    from types import SimpleNamespace

    from components.evaluation.metrics import Mismatch
    from components.evaluation.prompts import Prompt
    from components.evaluation.runner import NEAR_TIE, logit_margin

    def target(dtype):
        logits = torch.zeros(1, 1, 8, dtype=dtype)
        logits[0, 0, 1], logits[0, 0, 2], logits[0, 0, 3] = 20.0, 19.75, 10.0
        return SimpleNamespace(device="cpu", forward=lambda ids: SimpleNamespace(logits=logits))

    prompt = Prompt("p", (1, 2), 0)
    for dtype, tie in ((torch.bfloat16, True), (torch.float32, False)):
        margin, threshold = logit_margin(target(dtype), prompt, [], Mismatch("p", 0, expected=1, got=2))
        assert margin == pytest.approx(0.25) and (abs(margin) < threshold) is tie
        far, threshold = logit_margin(target(dtype), prompt, [], Mismatch("p", 0, expected=1, got=3))
        assert far == pytest.approx(10.0) and far > threshold
    assert logit_margin(target(torch.float32), prompt, [], Mismatch("p", 0, 1, -1)) == (None, NEAR_TIE)
