"""An evaluation's results as tables (markdown, JSON-ready dicts), metrics and plots.

* ``summary_table``   -- one row per method: tokens/s, speedup (÷ target_only and, for
  transformers' / vLLM's methods, ÷ hf_generate / vllm_generate), τ, drafts per round, target
  passes, lossless; methods that could not run (vLLM refusals) as a row with the reason;
* ``acceptance_table`` -- acceptance at draft position k per drafting method;
* ``offline_vs_engine`` -- the train stage's offline τ estimate beside the τ the engine measured;
* ``markdown``        -- the whole ``results.md``: settings, both tables, offline vs engine, how
  the vLLM peers were timed and how their acceptance compares with our engine's, method notes;
* ``flat_metrics``    -- ``eval/<method>/<metric>`` numbers for MLflow (``stage_metrics``: with
  the offline comparison and the vLLM-vs-engine numbers);
* ``plot_acceptance`` / ``plot_speedups`` -- PNGs (matplotlib, Agg); None without matplotlib.

Knows the report dataclasses and matplotlib; nothing about models or MLflow itself.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from components.config import EvalConfig
from components.evaluation.methods import REFERENCE
from components.evaluation.metrics import MethodSummary
from components.evaluation.runner import EvalReport
from components.evaluation.vllm_peers import TIMING, VLLM_METHODS

PLOT_MIN_ROUNDS = 5  # the acceptance plot leaves out positions reached by fewer rounds


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _lossless(s: MethodSummary, reference: str) -> str:
    if s.method == reference:
        return "reference"
    if s.lossless is None:
        return "not checked"
    if s.lossless:
        return "yes"
    ties = sum(bool(m.near_tie) for m in s.mismatches)
    return f"**NO** ({len(s.mismatches)} prompts, {ties} at near-ties)"


def summary_table(report: EvalReport, reference: str = REFERENCE) -> str:
    head = "| method | tok/s | speedup | vs hf_generate | vs vllm_generate | τ | drafts/round | target passes | lossless |"
    rows = [head, "|---|" * 1 + "---|" * 8]
    for s in report.summaries.values():
        rows.append(f"| {s.method} | {s.tokens_per_s:.1f} | {_fmt(s.speedup, '.2f', '×')} | "
                    f"{_fmt(s.speedup_vs_hf_generate, '.2f', '×')} | {_fmt(s.speedup_vs_vllm_generate, '.2f', '×')} | "
                    f"{s.tau:.2f} | {_fmt(s.mean_drafted if s.rounds else None, '.1f')} | "
                    f"{s.target_forwards or '–'} | {_lossless(s, reference)} |")
    for name, why in report.unavailable.items():
        rows.append(f"| {name} | unavailable: {why.replace('|', '/')} |" + " |" * 7)
    return "\n".join(rows)


def acceptance_table(report: EvalReport) -> str:
    drafting = [s for s in report.summaries.values() if s.acceptance_by_position]
    if not drafting:
        return ""
    depth = max(len(s.acceptance_by_position) for s in drafting)
    rows = ["| method | " + " | ".join(f"k={k}" for k in range(1, depth + 1)) + " |",
            "|---|" + "---|" * depth]
    for s in drafting:
        cells = [f"{a:.3f} ({n})" for a, n in zip(s.acceptance_by_position, s.reached_by_position)]
        rows.append(f"| {s.method} | " + " | ".join(cells + ["–"] * (depth - len(cells))) + " |")
    return "\n".join(rows) + "\n\n(acceptance rate at draft k among rounds that reached k; rounds in brackets)"


def offline_vs_engine(report: EvalReport, offline_tau: float | None,
                      offline_alpha: list[float] | None) -> dict[str, Any]:
    """The train stage's offline τ estimate (α = 1 − TV on its held-out rollouts) beside the
    engine's measured τ of the same drafter (``drafter``)."""
    measured = report.summaries.get("drafter")
    out: dict[str, Any] = {"offline_tau": offline_tau, "engine_tau": measured.tau if measured else None,
                           "offline_alpha": offline_alpha,
                           "engine_acceptance": measured.acceptance_by_position if measured else None}
    if offline_tau is not None and measured is not None:
        out["engine_minus_offline_tau"] = measured.tau - offline_tau
    return out


def _offline_markdown(offline: dict[str, Any]) -> list[str]:
    if offline["engine_tau"] is None:
        return []
    est = offline["offline_tau"]
    return ["## Offline estimate vs engine", "",
            (f"train stage's held-out τ estimate (α = 1 − TV on its rollouts): "
             f"{'not given' if est is None else f'{est:.3f}'}; engine-measured τ of the same drafter "
             f"on these prompts: {offline['engine_tau']:.3f}"), ""]


def _vs_engine_line(cmp: dict[str, Any]) -> str:
    return (f"Same drafter, same prompts: our engine τ {cmp['engine_tau']:.3f} ({cmp['engine_rounds']} "
            f"rounds), vLLM mean acceptance length {cmp['vllm_tau']:.3f} ({cmp['vllm_rounds']} steps), "
            f"difference {cmp['vllm_minus_engine_tau']:+.3f}; vLLM clipped at max_new_tokens as our "
            f"engine counts: {cmp['vllm_tau_clipped_to_max_new_tokens']:.3f} "
            f"({cmp['tokens_counted_past_max_new_tokens']} tokens credited past the end); prompts with "
            f"identical per-round acceptance: {cmp['prompts_with_identical_rounds']}")


def _vllm_markdown(report: EvalReport) -> list[str]:
    """How the vLLM peers were timed, and vLLM's acceptance length vs our engine's τ."""
    ran = [m for m in report.summaries if m in VLLM_METHODS]
    if not ran and not report.unavailable:
        return []
    lines = ["## vLLM peers", "", f"Timing: {TIMING}.", ""]
    lines += [f"- {m}: unavailable: {why}" for m, why in report.unavailable.items()]
    for cmp in _vs_engine(report).values():
        lines += ["", _vs_engine_line(cmp)]
    return lines + [""]


def markdown(report: EvalReport, ev: EvalConfig, threads: int, offline: dict[str, Any]) -> str:
    """``results.md``: one heading with the settings, the tables, the comparisons, the notes."""
    lines = [(f"# Evaluation: {len(report.prompts)} prompts ({ev.prompt_source}) × {ev.max_new_tokens} new "
              f"tokens, rule {ev.rule}, temperature {ev.temperature}, {threads} thread(s)"),
             "", summary_table(report), "", acceptance_table(report), ""]
    lines += _offline_markdown(offline) + _vllm_markdown(report)
    lines += ["## Method settings", "", "```", json.dumps(report.notes, indent=1, default=str), "```"]
    return "\n".join(lines)


def _vs_engine(report: EvalReport) -> dict[str, dict[str, Any]]:
    """method → its comparison with its engine twin (``runner.compare_with_engine``), where made."""
    return {m: n["vs_engine"] for m, n in report.notes.items() if n.get("vs_engine")}


def flat_metrics(report: EvalReport) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, s in report.summaries.items():
        p = f"eval/{name}"
        out |= {f"{p}/tau": s.tau, f"{p}/tokens_per_s": s.tokens_per_s, f"{p}/seconds": s.seconds,
                f"{p}/target_forwards": s.target_forwards}
        if s.speedup is not None:
            out[f"{p}/speedup"] = s.speedup
        if s.speedup_vs_hf_generate is not None:
            out[f"{p}/speedup_vs_hf_generate"] = s.speedup_vs_hf_generate
        if s.speedup_vs_vllm_generate is not None:
            out[f"{p}/speedup_vs_vllm_generate"] = s.speedup_vs_vllm_generate
        if s.lossless is not None:
            out[f"{p}/lossless"] = float(s.lossless)
        out |= {f"{p}/acceptance/{k + 1}": a for k, a in enumerate(s.acceptance_by_position)}
    return out


def stage_metrics(report: EvalReport, offline: dict[str, Any]) -> dict[str, float]:
    """``flat_metrics`` plus prompt and failure counts, the offline comparison and the numbers of
    every vLLM-vs-engine comparison."""
    metrics = flat_metrics(report) | {"eval/prompts": len(report.prompts),
                                      "eval/lossless_failures": len(report.failures)}
    for key in ("offline_tau", "engine_tau", "engine_minus_offline_tau"):
        if isinstance(offline.get(key), (int, float)):
            metrics[f"eval/{key}"] = offline[key]
    for name, cmp in _vs_engine(report).items():
        metrics |= {f"eval/{name}/vs_engine/{k}": v for k, v in cmp.items() if isinstance(v, (int, float))}
    return metrics


def report_dict(report: EvalReport) -> dict[str, Any]:
    """JSON-ready: prompts, per-method summaries, per-prompt runs (tokens left out)."""
    runs = {m: [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} | {"new_tokens": len(r.tokens)}
                for r in rs] for m, rs in report.runs.items()}
    return {"prompts": [{"prompt_id": p.prompt_id, "tokens": len(p.input_ids)} for p in report.prompts],
            "methods": {m: dataclasses.asdict(s) for m, s in report.summaries.items()}, "runs": runs,
            "unavailable": dict(report.unavailable)}


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_acceptance(report: EvalReport, path: Path, offline_alpha: list[float] | None = None) -> Path | None:
    """Acceptance by draft position, one line per drafting method (τ in the legend; positions
    reached by fewer than ``PLOT_MIN_ROUNDS`` rounds left out), plus the train stage's offline
    α by position (dashed) when given."""
    plt = _pyplot()
    drafting = [s for s in report.summaries.values() if s.acceptance_by_position]
    if plt is None or not drafting:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    for s in drafting:
        shown = [a for a, n in zip(s.acceptance_by_position, s.reached_by_position) if n >= PLOT_MIN_ROUNDS]
        ax.plot(range(1, len(shown) + 1), shown, marker="o", label=f"{s.method} (τ={s.tau:.2f})")
    if offline_alpha:
        ax.plot(range(1, len(offline_alpha) + 1), offline_alpha, linestyle="--", color="gray",
                label="drafter, offline α (train stage)")
    ax.set(xlabel="draft position k", ylabel="P(accept k | reached k)", ylim=(0, 1.02),
           title="measured acceptance by position")
    ax.legend(fontsize=8)
    return _save(fig, plt, path)


def plot_speedups(report: EvalReport, path: Path) -> Path | None:
    """Bars of speedup over target_only (same run); a dashed line at 1×."""
    plt = _pyplot()
    rows = [s for s in report.summaries.values() if s.speedup is not None]
    if plt is None or not rows:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.4))
    colors = ["tab:red" if s.lossless is False else "tab:blue" for s in rows]
    bars = ax.bar([s.method for s in rows], [s.speedup for s in rows], color=colors)
    ax.bar_label(bars, labels=[f"{s.speedup:.2f}×" for s in rows], fontsize=8)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set(ylabel="tokens/s ÷ target_only", title="speedup over plain decoding (same run)")
    ax.tick_params(axis="x", labelrotation=25, labelsize=8)
    return _save(fig, plt, path)
