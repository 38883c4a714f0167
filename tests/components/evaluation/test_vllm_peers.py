"""vLLM as an evaluation peer: its methods run in one vLLM subprocess, are lossless against our
target_only, report sane acceptance counters, and our exported drafter's acceptance length is set
beside our engine's τ. A missing vLLM environment is one clear ConfigError (no vLLM needed).

The vLLM tests need .venv-vllm (``make vllm-env``; ``SPECLINE_VLLM_PYTHON`` points at it): one
subprocess for plain + n-gram + an EAGLE-3 export, one that only sees vLLM's CPU runner refuse a
DSpark export.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from components.config import ConfigError, DrafterConfig, EvalConfig
from components.evaluation import METHODS, EvalContext, check_methods, compare_methods
from components.evaluation.metrics import PromptRun
from components.evaluation.vllm_peers import (
    VLLM_METHODS,
    clipped,
    compare_drafter,
    overshoot,
    plan_vllm,
)

ROOT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = Path(os.environ.get("SPECLINE_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
has_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(),
                              reason=f"no vLLM environment at {VLLM_PYTHON} (build it with `make vllm-env`)")
NEW = 16


def test_missing_vllm_environment_names_the_key_and_the_make_target(tmp_path):
    ev = EvalConfig(methods=["target_only", "vllm_generate"], vllm_python=str(tmp_path / "no" / "python"))
    with pytest.raises(ConfigError, match=r"eval\.vllm_python.*make vllm-env"):
        check_methods(ev)
    check_methods(EvalConfig(methods=["target_only"], vllm_python=str(tmp_path / "no" / "python")))  # not needed


def test_clipping_and_comparison_count_rounds_as_our_engine_does():
    # 8 new tokens = 1 from the prefill + 7 from rounds; vLLM's last step verified 3 drafts and
    # accepted all though only 3 tokens were left: its counters credit one token past the end
    vllm = PromptRun("vllm_drafter", "p", list(range(8)), 1.0, accepted=[2, 0, 3], drafted=[3, 3, 3])
    assert overshoot([vllm]) == (3 + 1 + 4) - 7
    assert clipped(vllm, 3) == [2, 0, 2]  # our engine's last round drafts γ = left − 1 = 2
    engine = PromptRun("drafter", "p", list(range(8)), 1.0, accepted=[2, 0, 2], drafted=[3, 3, 2])
    cmp = compare_drafter([engine], [vllm], 3)
    assert cmp["prompts_with_identical_rounds"] == "1/1" and cmp["first_differing_rounds"] == []
    assert cmp["vllm_tau"] == pytest.approx(1 + 5 / 3) and cmp["engine_tau"] == pytest.approx(1 + 4 / 3)
    assert cmp["vllm_tau_clipped_to_max_new_tokens"] == pytest.approx(cmp["engine_tau"])


def _drafter(name: str, tiny_target, seed: int, **cfg):
    from components.drafters import build_drafter

    torch.manual_seed(seed)
    d = build_drafter(DrafterConfig(name=name, **cfg), tiny_target)
    with torch.no_grad():  # random but not degenerate (norms start as ones)
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return d.eval()


def _ev(**kw) -> EvalConfig:
    return EvalConfig(max_new_tokens=NEW, lookup_num_speculative_tokens=4, warmup=False, vllm_python=str(VLLM_PYTHON), **kw)


def test_plan_builds_each_methods_config_from_its_registry_entry(tiny_target):
    """No vLLM needed: the plan only checks that a Python is there and prepares the configs."""
    ev = EvalConfig(methods=list(VLLM_METHODS), lookup_num_speculative_tokens=4, vllm_num_speculative_tokens=2, vllm_python=sys.executable)
    ctx = EvalContext(tiny_target, ev, drafter=_drafter("dflash", tiny_target, 0, num_layers=1),
                      assistant_path="/some/assistant")
    plan = plan_vllm(ctx, {n: METHODS[n] for n in VLLM_METHODS})
    try:
        configs = {m["name"]: m["speculative_config"] for m in plan.methods}
        assert list(configs) == list(VLLM_METHODS) and plan.unavailable == {}
        assert configs["vllm_generate"] is None and configs["vllm_suffix"] == {"method": "suffix"}
        assert configs["vllm_ngram"] == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 1}
        assert configs["vllm_draft_model"] == {"method": "draft_model", "model": "/some/assistant",
                                               "num_speculative_tokens": 2}
        assert configs["vllm_drafter"]["method"] == "dflash"
        assert (Path(configs["vllm_drafter"]["model"]) / "config.json").is_file()
        assert ctx.notes["vllm_drafter"]["export_layout"] == "speculators"
    finally:
        plan.close()
    assert not plan.workdir.exists()


def test_a_drafter_without_a_vllm_layout_is_unavailable_not_fatal(tiny_target):
    ev = EvalConfig(methods=["vllm_drafter"], vllm_python=sys.executable)
    ctx = EvalContext(tiny_target, ev, drafter=_drafter("mtp", tiny_target, 0))
    plan = plan_vllm(ctx, {"vllm_drafter": METHODS["vllm_drafter"]})
    plan.close()
    assert plan.methods == [] and "no vLLM layout for drafter 'mtp'" in plan.unavailable["vllm_drafter"]
    with pytest.raises(ConfigError, match="eval.drafter_path"):
        plan_vllm(EvalContext(tiny_target, ev), {"vllm_drafter": METHODS["vllm_drafter"]})


@pytest.mark.vllm
@pytest.mark.slow
@has_vllm
def test_vllm_plain_ngram_and_exported_drafter(tiny_target, eval_prompt_list):
    methods = ["target_only", "drafter", "vllm_generate", "vllm_ngram", "vllm_drafter"]
    ctx = EvalContext(tiny_target, _ev(methods=methods), drafter=_drafter("eagle3", tiny_target, 0))
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    assert report.unavailable == {} and report.failures == [], (report.unavailable, report.failures)
    assert list(report.summaries) == methods
    for name in methods[2:]:
        s = report.summaries[name]
        assert s.lossless is True and s.new_tokens == NEW * len(eval_prompt_list) and s.tokens_per_s > 0, name
        assert s.speedup_vs_vllm_generate is not None and s.extra["timing"], name
    assert report.summaries["vllm_generate"].rounds == 0 and report.summaries["vllm_generate"].target_forwards == 2 * NEW
    for name in ("vllm_ngram", "vllm_drafter"):
        runs, counters = report.runs[name], report.notes[name]["vllm_counters"]
        assert counters["num_drafts"] == sum(r.rounds for r in runs), name  # per request = aggregate
        assert counters["num_accepted_tokens"] == sum(sum(r.accepted) for r in runs), name
        assert counters["num_draft_tokens"] == sum(sum(r.drafted) for r in runs), name
        assert all(0 <= a <= d <= 4 for r in runs for a, d in zip(r.accepted, r.drafted)), name
        if counters["num_drafts"]:
            assert counters["mean_acceptance_length"] == pytest.approx(report.summaries[name].tau)
    # a model drafter proposes every step; whether n-grams match depends on the fixture's text
    assert report.notes["vllm_drafter"]["vllm_counters"]["num_drafts"] > 0
    cmp = report.notes["vllm_drafter"]["vs_engine"]
    assert cmp["engine_tau"] == pytest.approx(report.summaries["drafter"].tau)
    assert cmp["vllm_tau"] == pytest.approx(report.summaries["vllm_drafter"].tau)
    assert report.notes["vllm_drafter"]["num_speculative_tokens"] == report.notes["drafter"]["num_speculative_tokens"] == 3


@pytest.mark.vllm
@pytest.mark.slow
@has_vllm
def test_dspark_export_is_unavailable_with_vllms_reason(tiny_target, eval_prompt_list):
    drafter = _drafter("dspark", tiny_target, 1, num_layers=1, block_size=4, markov_rank=8)
    ctx = EvalContext(tiny_target, _ev(methods=["target_only", "vllm_drafter"]), drafter=drafter)
    report = compare_methods(ctx, check_methods(ctx.ev), eval_prompt_list)
    assert list(report.summaries) == ["target_only"]
    assert "Model Runner V1 does not support: dspark speculative decoding" in report.unavailable["vllm_drafter"]
