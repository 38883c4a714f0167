"""Per prompt set results on hand-made runs: speedups within each set, lossless per set, the
Spec-Bench-style matrix, the per-set rows beside the overall ones, MLflow names, plots."""

from __future__ import annotations

import pytest

from components.config import EvalConfig
from components.data.prompts import Prompt
from components.evaluation import report as rep
from components.evaluation.metrics import Mismatch, PromptRun
from components.evaluation.runner import EvalReport, summarize_all, summarize_sets

CODE = ["humaneval:HumanEval/0", "humaneval:HumanEval/1"]
CHAT = ["chat:heldout:0"]


def _runs() -> dict[str, list[PromptRun]]:
    """target_only: 10 tokens/s everywhere; drafter: 4× on code (τ 11/3), no gain on chat (τ 1)."""
    base = [PromptRun("target_only", pid, [1] * 10, 1.0) for pid in CODE + CHAT]
    drafter = [PromptRun("drafter", pid, [1] * 10, 0.25, [3, 3, 2], [3, 3, 3]) for pid in CODE]
    drafter.append(PromptRun("drafter", CHAT[0], [1] * 10, 1.0, [0, 0, 0, 0, 0], [3, 3, 3, 3, 3]))
    order = [0, 2, 1]  # prompts interleaved by set, as eval_prompts returns them
    return {"target_only": [base[i] for i in order], "drafter": [drafter[i] for i in order]}


def _report(mismatch_on: str | None = None) -> EvalReport:
    runs = _runs()
    prompts = [Prompt(r.prompt_id, (1, 2, 3), 0) for r in runs["target_only"]]
    summaries = summarize_all(runs)
    summaries["drafter"].lossless = mismatch_on is None
    summaries["drafter"].mismatches = [Mismatch(mismatch_on, 3, 5, 6)] if mismatch_on else []
    return EvalReport(prompts, runs, summaries, sets=summarize_sets(prompts, runs, summaries))


def test_speedups_and_tau_are_taken_within_each_set():
    report = _report()
    assert list(report.sets) == ["humaneval", "chat"]
    code, chat, overall = report.sets["humaneval"]["drafter"], report.sets["chat"]["drafter"], report.summaries["drafter"]
    assert (code.prompts, code.speedup, code.tau) == (2, pytest.approx(4.0), pytest.approx(11 / 3))
    assert (chat.prompts, chat.speedup, chat.tau) == (1, pytest.approx(1.0), 1.0)
    assert overall.speedup == pytest.approx(30 / 1.5 / 10) and overall.prompts == 3
    assert code.acceptance_by_position == pytest.approx([1.0, 1.0, 2 / 3]) and chat.acceptance_by_position == [0.0]
    assert report.sets["chat"]["target_only"].speedup == 1.0 and report.sets["chat"]["target_only"].lossless is None


def test_lossless_per_set_counts_only_that_sets_mismatches():
    report = _report(mismatch_on=CHAT[0])
    assert report.sets["humaneval"]["drafter"].lossless is True
    assert report.sets["chat"]["drafter"].lossless is False and len(report.sets["chat"]["drafter"].mismatches) == 1


def test_markdown_has_a_row_per_set_and_method_and_an_overall_row():
    report = _report()
    ev = EvalConfig(prompt_sets=["humaneval", "chat", "summarise"], max_new_tokens=10)
    text = rep.markdown(report, ev, 1, rep.offline_vs_engine(report, None, None))
    assert text.startswith("# Evaluation: 3 prompts (embedded: humaneval 2, chat 1; no prompts: summarise)")
    assert "| method | humaneval | chat | overall |" in text
    assert "| drafter | 4.00× (τ 3.67) | 1.00× (τ 1.00) | 2.00× (τ 2.45) |" in text
    assert "| humaneval | drafter | 2 | 40.0 | 4.00× | 3.67 | 1.00 · 1.00 · 0.67 | yes |" in text
    assert "| chat | drafter | 1 | 10.0 | 1.00× | 1.00 | 0.00 | yes |" in text
    assert "| **overall** | drafter | 3 | 20.0 | 2.00× | 2.45 |" in text
    assert "| **overall** | target_only | 3 | 10.0 | 1.00× | 1.00 | – | reference |" in text


def test_mlflow_metrics_per_set_beside_the_overall_names():
    metrics = rep.stage_metrics(_report(), {})
    assert metrics["eval/drafter/speedup"] == pytest.approx(2.0)  # the overall names stay
    assert metrics["eval/humaneval/drafter/speedup"] == pytest.approx(4.0)
    assert metrics["eval/chat/drafter/tau"] == 1.0 and metrics["eval/humaneval/drafter/acceptance/3"] == pytest.approx(2 / 3)
    assert metrics["eval/humaneval/prompts"] == 2 and metrics["eval/chat/prompts"] == 1 and metrics["eval/prompts"] == 3
    data = rep.report_dict(_report())
    assert data["sets"]["humaneval"]["drafter"]["speedup"] == pytest.approx(4.0)
    assert [p["set"] for p in data["prompts"]] == ["humaneval", "chat", "humaneval"]


def test_the_json_report_writes_notes_keyed_by_tuples():
    import json

    report = _report()
    report.summaries["drafter"].extra["by_prompt"] = {(1, 2, 3): 4}  # e.g. a prompt's ids
    assert json.loads(json.dumps(rep.report_dict(report)))["methods"]["drafter"]["extra"]["by_prompt"] == {"(1, 2, 3)": 4}


def test_plots_have_a_panel_and_a_bar_group_per_set(tmp_path):
    pytest.importorskip("matplotlib")
    report = _report(mismatch_on=CHAT[0])
    assert rep.plot_speedups(report, tmp_path / "s.png").stat().st_size > 0
    assert rep.plot_acceptance(report, tmp_path / "a.png", [0.5, 0.2]).stat().st_size > 0


def test_peers_beside_a_step_that_is_not_float32_are_counted_not_called_lossy():
    """Against a bfloat16 step the peers (transformers', vLLM's: float32) differ by design: they are
    not held to the reference, and their row says how many prompts differ."""
    from components.evaluation.methods import exact_methods

    ev, names = EvalConfig(temperature=0.0), ["target_only", "suffix", "hf_generate"]
    assert exact_methods(ev, names) == {"target_only", "suffix", "hf_generate"}
    assert exact_methods(ev, names, "bfloat16") == {"target_only", "suffix"}
    report = _report()
    summary = report.summaries["drafter"]
    summary.lossless, summary.extra["lossless"] = None, "not checked: bfloat16 target; 2 of 3 prompts differ"
    assert rep._lossless(summary, "target_only") == "not checked: bfloat16 target; 2 of 3 prompts differ"
