"""An evaluation's results as tables (markdown, JSON-ready dicts), metrics and plots.

* ``summary_table``   -- one row per method: tokens/s, speedup (÷ target_only and, for
  transformers' / vLLM's methods, ÷ hf_generate / vllm_generate), τ, drafts per round, target
  passes, lossless; methods that could not run (vLLM refusals) as a row with the reason;
* ``acceptance_table`` -- acceptance at draft position k per drafting method;
* ``flat_metrics``    -- ``eval/<method>/<metric>`` numbers for MLflow;
* ``plot_acceptance`` / ``plot_speedups`` -- PNGs (matplotlib, Agg); None without matplotlib.

Knows the report dataclasses and matplotlib; nothing about models or MLflow itself.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from components.evaluation.metrics import MethodSummary
from components.evaluation.runner import EvalReport

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


def summary_table(report: EvalReport, reference: str = "target_only") -> str:
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
