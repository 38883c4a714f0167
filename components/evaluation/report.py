"""An evaluation's results as tables (markdown, JSON-ready dicts), metrics and plots.

* ``summary_table``   -- one row per method: tokens/s, speedup (÷ target_only and, for
  transformers' / vLLM's methods, ÷ hf_generate / vllm_generate), τ, drafts per round, target
  passes, lossless; methods that could not run (vLLM refusals) as a row with the reason;
* ``acceptance_table`` -- acceptance at draft position k per drafting method;
* ``set_matrix``      -- Spec-Bench's layout: a row per method, a column per prompt set and one
  overall, each cell the speedup over target_only on that set's prompts and τ;
* ``set_table``       -- per prompt set, then overall: prompts, tokens/s, speedup, τ, acceptance
  at draft position k, lossless of every method;
* ``offline_vs_engine`` -- the train stage's offline τ estimate beside the τ the engine measured;
* ``markdown``        -- the whole ``results.md``: settings, both tables, offline vs engine, how
  the vLLM peers were timed and how their acceptance compares with our engine's, method notes;
* ``flat_metrics``    -- ``eval/<method>/<metric>`` numbers for MLflow (overall) and
  ``eval/<set>/<method>/<metric>`` (per prompt set); ``stage_metrics``: with prompt counts, the
  offline comparison and the vLLM-vs-engine numbers;
* ``plot_acceptance`` / ``plot_speedups`` -- PNGs (matplotlib, Agg), a panel / a bar group per
  prompt set beside the overall one; None without matplotlib.

Knows the report dataclasses and matplotlib; nothing about models or MLflow itself.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

from components.config import EvalConfig
from components.evaluation.methods import REFERENCE
from components.evaluation.metrics import MethodSummary
from components.evaluation.prompts import prompt_set
from components.evaluation.runner import EvalReport
from components.evaluation.vllm_peers import TIMING, VLLM_METHODS

PLOT_MIN_ROUNDS = 5  # the acceptance plot leaves out positions reached by fewer rounds
OVERALL = "overall"  # the row / column / bar group over every prompt
SHOWN_POSITIONS = 8  # set_table shows acceptance at k = 1..this (results.json has them all)


def _fmt(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{suffix}"


def _lossless(s: MethodSummary, reference: str) -> str:
    if s.method == reference:
        return "reference"
    if s.lossless is None:
        return s.extra.get("lossless", "not checked")
    if s.lossless:
        return "yes"
    ties = sum(bool(m.near_tie) for m in s.mismatches)
    return f"**NO** ({len(s.mismatches)} prompts, {ties} at near-ties)"


def summary_table(report: EvalReport, reference: str = REFERENCE) -> str:
    head = ("| method | tok/s | speedup | TTFT ms | decode tok/s | decode speedup | vs hf_generate | vs vllm_generate "
            "| τ | drafts/round | target passes | lossless |")
    rows = [head, "|---|" * 1 + "---|" * 11]
    for s in report.summaries.values():
        rows.append(f"| {s.method} | {s.tokens_per_s:.1f} | {_fmt(s.speedup, '.2f', '×')} | "
                    f"{_fmt(s.ttft_s * 1e3 if s.ttft_s is not None else None, '.0f')} | "
                    f"{_fmt(s.decode_tokens_per_s, '.1f')} | {_fmt(s.decode_speedup, '.2f', '×')} | "
                    f"{_fmt(s.speedup_vs_hf_generate, '.2f', '×')} | {_fmt(s.speedup_vs_vllm_generate, '.2f', '×')} | "
                    f"{s.tau:.2f} | {_fmt(s.mean_drafted if s.rounds else None, '.1f')} | "
                    f"{s.target_forwards or '–'} | {_lossless(s, reference)} |")
    for name, why in report.unavailable.items():
        rows.append(f"| {name} | unavailable: {why.replace('|', '/')} |" + " |" * 10)
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


def _groups(report: EvalReport) -> dict[str, dict[str, MethodSummary]]:
    """Set → method → summary, then ``OVERALL`` → every method over all prompts."""
    return {**report.sets, OVERALL: report.summaries}


def _cell(s: MethodSummary | None) -> str:
    return "–" if s is None else f"{_fmt(s.speedup, '.2f', '×')} (τ {s.tau:.2f})"


def set_matrix(report: EvalReport) -> str:
    """A row per method, a column per prompt set and overall: speedup over target_only (τ)."""
    groups = _groups(report)
    rows = ["| method | " + " | ".join(groups) + " |", "|---|" + "---|" * len(groups)]
    for m in report.summaries:
        rows.append(f"| {m} | " + " | ".join(_cell(g.get(m)) for g in groups.values()) + " |")
    return "\n".join(rows) + "\n\n(speedup over target_only on the set's prompts, same run; τ in brackets)"


def _acceptance(s: MethodSummary) -> str:
    shown = [f"{a:.2f}" for a in s.acceptance_by_position[:SHOWN_POSITIONS]]
    more = " …" if len(s.acceptance_by_position) > SHOWN_POSITIONS else ""
    return " · ".join(shown) + more if shown else "–"


def set_table(report: EvalReport, reference: str = REFERENCE) -> str:
    """Per prompt set, then overall: each method's prompts, tok/s, speedup, τ, acceptance at k, lossless."""
    rows = ["| set | method | prompts | tok/s | speedup | τ | acceptance at k = 1, 2, … | lossless |",
            "|---|" + "---|" * 7]
    for name, group in _groups(report).items():
        label = f"**{name}**" if name == OVERALL else name
        rows += [f"| {label} | {s.method} | {s.prompts} | {s.tokens_per_s:.1f} | {_fmt(s.speedup, '.2f', '×')} | "
                 f"{s.tau:.2f} | {_acceptance(s)} | {_lossless(s, reference)} |" for s in group.values()]
    return "\n".join(rows)


def _sets_markdown(report: EvalReport) -> list[str]:
    if not report.sets:
        return []
    return ["## Per prompt set", "", set_matrix(report), "", set_table(report), "",
            "(acceptance at draft k among rounds that reached k; speedups within each set's prompts)", ""]


def _heading(report: EvalReport, ev: EvalConfig, threads: int) -> str:
    """The settings line: prompts per set (and configured sets that had none), tokens, rule."""
    counts = [f"{name} {next(iter(g.values())).prompts}" for name, g in report.sets.items() if g]
    absent = [x for x in ev.prompt_sets if x not in report.sets] if ev.prompt_source == "embedded" else []
    where = ev.prompt_source + (f": {', '.join(counts)}" if counts else "")
    where += f"; no prompts: {', '.join(absent)}" if absent else ""
    return (f"# Evaluation: {len(report.prompts)} prompts ({where}) × {ev.max_new_tokens} new tokens, "
            f"rule {ev.rule}, temperature {ev.temperature}, {threads} thread(s)")


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
    """``results.md``: one heading with the settings, the overall tables, the per-set tables, the
    comparisons, the notes."""
    lines = [_heading(report, ev, threads), "", "## All prompts", "", summary_table(report), "",
             acceptance_table(report), ""]
    lines += _sets_markdown(report) + _offline_markdown(offline) + _vllm_markdown(report)
    lines += ["## Method settings", "", "```", json.dumps(report.notes, indent=1, default=str), "```"]
    return "\n".join(lines)


def _vs_engine(report: EvalReport) -> dict[str, dict[str, Any]]:
    """method → its comparison with its engine twin (``runner.compare_with_engine``), where made."""
    return {m: n["vs_engine"] for m, n in report.notes.items() if n.get("vs_engine")}


def _metric_name(part: str) -> str:
    """A set name as an MLflow metric name part (a file name may hold characters MLflow refuses)."""
    return re.sub(r"[^\w\-. ]", "_", part)


def method_metrics(prefix: str, s: MethodSummary) -> dict[str, float]:
    """``<prefix>/{tau,tokens_per_s,seconds,target_forwards,speedup*,decode_*,ttft_s,lossless,acceptance/k}``."""
    out = {f"{prefix}/tau": s.tau, f"{prefix}/tokens_per_s": s.tokens_per_s, f"{prefix}/seconds": s.seconds,
           f"{prefix}/target_forwards": float(s.target_forwards)}
    for key in ("speedup", "decode_speedup", "ttft_s", "decode_tokens_per_s", "speedup_vs_hf_generate",
                "speedup_vs_vllm_generate"):
        if getattr(s, key) is not None:
            out[f"{prefix}/{key}"] = getattr(s, key)
    if s.lossless is not None:
        out[f"{prefix}/lossless"] = float(s.lossless)
    return out | {f"{prefix}/acceptance/{k + 1}": a for k, a in enumerate(s.acceptance_by_position)}


def flat_metrics(report: EvalReport) -> dict[str, float]:
    """``eval/<method>/<metric>`` over all prompts, ``eval/<set>/<method>/<metric>`` per set."""
    out: dict[str, float] = {}
    for name, s in report.summaries.items():
        out |= method_metrics(f"eval/{name}", s)
    for set_name, group in report.sets.items():
        for name, s in group.items():
            out |= method_metrics(f"eval/{_metric_name(set_name)}/{name}", s)
    return out


def stage_metrics(report: EvalReport, offline: dict[str, Any]) -> dict[str, float]:
    """``flat_metrics`` plus prompt and failure counts, the offline comparison and the numbers of
    every vLLM-vs-engine comparison."""
    metrics = flat_metrics(report) | {"eval/prompts": len(report.prompts),
                                      "eval/lossless_failures": len(report.failures)}
    metrics |= {f"eval/{_metric_name(n)}/prompts": next(iter(g.values())).prompts for n, g in report.sets.items() if g}
    for key in ("offline_tau", "engine_tau", "engine_minus_offline_tau"):
        if isinstance(offline.get(key), (int, float)):
            metrics[f"eval/{key}"] = offline[key]
    for name, cmp in _vs_engine(report).items():
        metrics |= {f"eval/{name}/vs_engine/{k}": v for k, v in cmp.items() if isinstance(v, (int, float))}
    return metrics


def json_keys(obj: Any) -> Any:
    """``obj`` with every mapping key JSON can write (a tuple key, e.g. a prompt's ids in a
    method's notes, becomes its ``str``), recursively."""
    if isinstance(obj, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else str(k): json_keys(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_keys(v) for v in obj]
    return obj


def report_dict(report: EvalReport) -> dict[str, Any]:
    """JSON-ready: prompts (with their set), per-method summaries overall and per set, per-prompt
    runs (tokens left out)."""
    runs = {m: [{k: v for k, v in dataclasses.asdict(r).items() if k != "tokens"} | {"new_tokens": len(r.tokens)}
                for r in rs] for m, rs in report.runs.items()}
    return json_keys({"prompts": [{"prompt_id": p.prompt_id, "set": prompt_set(p.prompt_id), "tokens": len(p.input_ids)}
                                  for p in report.prompts],
                      "methods": {m: dataclasses.asdict(s) for m, s in report.summaries.items()},
                      "sets": {n: {m: dataclasses.asdict(s) for m, s in g.items()} for n, g in report.sets.items()},
                      "runs": runs, "unavailable": dict(report.unavailable)})


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


def _plotted_groups(report: EvalReport) -> dict[str, dict[str, MethodSummary]]:
    """``OVERALL`` first, then each set (none when there is only one: it would repeat overall)."""
    sets = report.sets if len(report.sets) > 1 else {}
    return {OVERALL: report.summaries, **sets}


def _acceptance_panel(ax: Any, title: str, group: dict[str, MethodSummary], offline_alpha: list[float] | None) -> None:
    depth = len(offline_alpha or [])
    for s in group.values():
        if s.acceptance_by_position:
            shown = [a for a, n in zip(s.acceptance_by_position, s.reached_by_position) if n >= PLOT_MIN_ROUNDS]
            ax.plot(range(1, len(shown) + 1), shown, marker="o", label=f"{s.method} (τ={s.tau:.2f})")
            depth = max(depth, len(shown))
    if offline_alpha:
        ax.plot(range(1, len(offline_alpha) + 1), offline_alpha, linestyle="--", color="gray",
                label="drafter, offline α (train stage)")
    ax.set_xticks(range(1, depth + 1))
    ax.set(xlabel="draft position k", ylabel="P(accept k | reached k)", ylim=(0, 1.02), title=title)
    ax.legend(fontsize=7)


def plot_acceptance(report: EvalReport, path: Path, offline_alpha: list[float] | None = None) -> Path | None:
    """Acceptance by draft position, one line per drafting method (τ in the legend; positions
    reached by fewer than ``PLOT_MIN_ROUNDS`` rounds left out), one panel over all prompts and
    one per prompt set; the train stage's offline α by position (dashed) when given."""
    plt = _pyplot()
    if plt is None or not any(s.acceptance_by_position for s in report.summaries.values()):
        return None
    groups = _plotted_groups(report)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 3.6), squeeze=False)
    for ax, (name, group) in zip(axes[0], groups.items()):
        title = "measured acceptance by position" + ("" if len(groups) == 1 else f": {name}")
        _acceptance_panel(ax, title, group, offline_alpha if name == OVERALL else None)
    return _save(fig, plt, path)


def plot_speedups(report: EvalReport, path: Path) -> Path | None:
    """Bars of speedup over target_only (same run), a group per method with one bar over all
    prompts and one per prompt set; hatched: not lossless; a dashed line at 1×."""
    plt = _pyplot()
    groups = _plotted_groups(report)
    methods = [m for m, s in report.summaries.items() if s.speedup is not None]
    if plt is None or not methods:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(methods) * len(groups) ** 0.5), 3.6))
    width = 0.8 / len(groups)
    for j, (name, group) in enumerate(groups.items()):
        rows = [group.get(m) for m in methods]
        xs = [i + (j - (len(groups) - 1) / 2) * width for i in range(len(methods))]
        bars = ax.bar(xs, [(s.speedup or 0.0) if s else 0.0 for s in rows], width, label=name)
        for bar, s in zip(bars, rows):
            if s is not None and s.lossless is False:
                bar.set_hatch("//")
                bar.set_edgecolor("tab:red")
        if len(groups) == 1:
            ax.bar_label(bars, labels=[f"{s.speedup:.2f}×" if s and s.speedup else "" for s in rows], fontsize=8)
    ax.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(methods)), methods)
    ax.set(ylabel="tokens/s ÷ target_only", title="speedup over plain decoding (same run)")
    ax.tick_params(axis="x", labelrotation=25, labelsize=8)
    if len(groups) > 1:
        ax.legend(fontsize=7, title="prompts", title_fontsize=7)
    return _save(fig, plt, path)
