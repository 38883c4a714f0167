"""τ, acceptance by position, token comparison and speedups on hand-made numbers."""

from __future__ import annotations

import pytest

from components.evaluation.metrics import (
    MethodSummary,
    PromptRun,
    acceptance_by_position,
    add_speedups,
    compare_tokens,
    first_difference,
    summarize,
    tau,
)


def test_tau_counts_the_recovered_or_bonus_token_of_every_round():
    assert tau([0, 2, 4]) == pytest.approx((6 + 3) / 3)
    assert tau([]) == 1.0  # a method that does not draft


def test_acceptance_by_position_is_conditional_on_reaching_k():
    # γ=3 rounds accepting 0, 1, 3, 2 drafts; a last round shortened to γ=1 accepting 1.
    rates, reached = acceptance_by_position([0, 1, 3, 2, 1], [3, 3, 3, 3, 1])
    assert reached == [5, 3, 2]  # k=1 all rounds; k=2 rounds with ≥1 accepted and γ≥2; k=3 ...
    assert rates == pytest.approx([4 / 5, 2 / 3, 1 / 2])
    assert acceptance_by_position([], []) == ([], [])


def test_summarize_sums_tokens_and_time_over_prompts():
    runs = [PromptRun("m", "a", [1] * 8, 2.0, [1, 3], [3, 3], 3), PromptRun("m", "b", [1] * 8, 2.0, [3, 1], [3, 3], 3)]
    s = summarize("m", runs)
    assert (s.new_tokens, s.seconds, s.tokens_per_s, s.rounds, s.target_forwards) == (16, 4.0, 4.0, 4, 6)
    assert s.tau == pytest.approx(3.0) and s.mean_drafted == 3.0


def test_the_prefill_is_split_off_where_every_run_recorded_it():
    """TTFT is the mean time to the first token; decode tokens/s counts the tokens after it over
    the seconds after it; a peer that cannot tell (None on any prompt) gets neither."""
    runs = [PromptRun("m", "a", [1] * 9, 3.0, prefill_seconds=1.0), PromptRun("m", "b", [1] * 5, 2.0, prefill_seconds=0.0)]
    s = summarize("m", runs)
    assert s.ttft_s == pytest.approx(0.5) and s.decode_tokens_per_s == pytest.approx((8 + 4) / 4.0)
    assert s.tokens_per_s == pytest.approx(14 / 5.0)  # the end-to-end figure still counts the prefill
    peer = summarize("p", [runs[0], PromptRun("p", "b", [1] * 5, 2.0)])
    assert peer.ttft_s is None and peer.decode_tokens_per_s is None


def test_decode_speedup_is_the_ratio_of_decode_rates_of_the_same_run():
    base = summarize("target_only", [PromptRun("target_only", "a", [1] * 11, 3.0, prefill_seconds=1.0)])  # 5 tok/s
    fast = summarize("m", [PromptRun("m", "a", [1] * 11, 2.0, prefill_seconds=1.0)])  # 10 tok/s after the first
    peer = summarize("hf", [PromptRun("hf", "a", [1] * 11, 1.0)])
    sums = {"target_only": base, "m": fast, "hf": peer}
    add_speedups(sums, "target_only", "hf", set())
    assert fast.decode_speedup == pytest.approx(2.0) and fast.speedup == pytest.approx(1.5)
    assert base.decode_speedup == pytest.approx(1.0) and peer.decode_speedup is None


def test_first_difference_and_compare_tokens():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2, 3], [1, 2]) == 2
    ref = [PromptRun("r", "p0", [1, 2, 3], 1.0), PromptRun("r", "p1", [4, 5], 1.0)]
    got = [PromptRun("m", "p0", [1, 2, 3], 1.0), PromptRun("m", "p1", [4, 6], 1.0)]
    (m,) = compare_tokens(ref, got)
    assert (m.prompt_id, m.index, m.expected, m.got) == ("p1", 1, 5, 6)


def _summary(name: str, tps: float) -> MethodSummary:
    return MethodSummary(name, 1, 10, 10 / tps, tps, 1.0, 0, 0.0, [], [], 10)


def test_speedups_are_ratios_to_the_reference_of_the_same_run():
    s = {n: _summary(n, t) for n, t in [("target_only", 50.0), ("drafter", 100.0), ("hf_generate", 40.0),
                                       ("hf_assisted", 60.0)]}
    add_speedups(s, "target_only", "hf_generate", {"hf_generate", "hf_assisted"})
    assert s["drafter"].speedup == pytest.approx(2.0) and s["drafter"].speedup_vs_hf_generate is None
    assert s["hf_assisted"].speedup == pytest.approx(1.2)
    assert s["hf_assisted"].speedup_vs_hf_generate == pytest.approx(1.5)


def test_positions_never_reached_are_left_out():
    assert acceptance_by_position([0, 0], [4, 4]) == ([0.0], [2])
