"""The one-line summary of a finished stage, read from the artifacts it returned.

``headline("data", artifacts)`` → ``"16 records, 1,808 tokens → runs/data"``. Each stage's line
names the figure a person waits for: the target's size and quality, the records written, the
training steps, loss and held-out τ, the drafter's τ and speedup, the serving endpoint. A key a
stage did not return is left out of its line, never an error: the line is for reading, the
artifacts (printed as JSON) are the record.

Knows the keys the stages of ``pipelines/`` return; nothing about how they compute them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from components.config import SpeclineConfig
from components.evaluation.methods import REFERENCE  # plain decoding: speedups are relative to it


def duration(seconds: float) -> str:
    """``12.3 s``, ``2 min 05 s``, ``1 h 02 min``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    return f"{minutes // 60} h {minutes % 60:02d} min"


def count(n: float) -> str:
    """A count with thousands separators; parameters and the like as ``135M`` / ``8.2B``."""
    for size, unit in ((1e9, "B"), (1e6, "M")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{int(n):,}"


def _num(x: Any, fmt: str = ".2f") -> str | None:
    return format(x, fmt) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def target_line(out: dict[str, Any]) -> list[str]:
    parts = [f"{count(out['parameters'])} parameters" if "parameters" in out else None,
             f"{out['num_layers']} layers" if "num_layers" in out else None]
    ppl = _num((out.get("metrics") or {}).get("heldout_perplexity"), ".1f")
    parts.append(f"held-out perplexity {ppl}" if ppl else None)
    if "build_seconds" in out or "conversion_seconds" in out:
        what = "built" if "build_seconds" in out else "converted"
        secs = out.get("build_seconds", out.get("conversion_seconds"))
        parts.append(f"{what} in {duration(secs)}" if out.get("built_now") else "cached")
    questions = ((out.get("prompt_bank") or {}).get("questions") or {})
    if questions:
        parts.append(f"prompt bank {questions.get('train', 0)}+{questions.get('heldout', 0)} questions")
    return [p for p in parts if p]


def data_line(out: dict[str, Any]) -> list[str]:
    if out.get("data_mode") == "stream":
        return [f"a stream over {out.get('num_prompts', '?')} prompts (rolled out while training)"]
    parts = [f"{count(out['num_records'])} records, {count(out['num_tokens'])} tokens"
             if "num_records" in out and "num_tokens" in out else None]
    rate = _num(out["num_tokens"] / out["data_seconds"], ",.0f") if out.get("data_seconds") else None
    parts.append(f"{rate} tok/s" if rate and parts[0] else None)
    parts.append(f"→ {out['data_dir']}" if out.get("data_dir") else None)
    return [p for p in parts if p]


def train_line(out: dict[str, Any]) -> list[str]:
    parts = [f"{out['train_steps']} steps" if "train_steps" in out else None]
    first, last = _num(out.get("train_loss_first"), ".3f"), _num(out.get("train_loss_last"), ".3f")
    parts.append(f"loss {first} → {last}" if first and last else f"loss {last}" if last else None)
    tau, tau0 = _num(out.get("heldout_tau")), _num(out.get("heldout_tau_initial"))
    parts.append(f"held-out τ {tau0} → {tau}" if tau and tau0 else f"held-out τ {tau}" if tau else None)
    parts.append(f"drafter → {out['drafter_path']}" if out.get("drafter_path") else None)
    return [p for p in parts if p]


def eval_line(out: dict[str, Any]) -> list[str]:
    taus, speedups = out.get("eval_tau") or {}, out.get("eval_speedup") or {}
    drafters = [m for m in taus if m.startswith("drafter")] or [m for m in taus if m != REFERENCE]
    parts = []
    for m in drafters:
        tau, speed = _num(taus.get(m)), _num(speedups.get(m))
        parts.append(f"{m} τ {tau or '?'}" + (f" ({speed}× speedup)" if speed else ""))
    failures = out.get("eval_lossless_failures") or []
    parts.append(f"NOT LOSSLESS: {', '.join(failures)}" if failures else "lossless" if taus else None)
    parts.append(f"→ {out['eval_dir']}" if out.get("eval_dir") else None)
    return [p for p in parts if p]


def serve_line(out: dict[str, Any]) -> list[str]:
    if not out.get("serve_endpoint"):
        return []
    served = [f"model {out['serve_model']}" if out.get("serve_model") else None,
              f"drafter {out['serve_drafter']}" if out.get("serve_drafter") else None]
    inner = ", ".join(p for p in served if p)
    why = f"; serve.drafter=auto: {out['serve_drafter_why']}" if out.get("serve_drafter_why") else ""
    return [f"{out['serve_endpoint']}/v1" + (f" ({inner}{why})" if inner else "")]


LINES: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "target": target_line, "data": data_line, "train": train_line, "eval": eval_line, "serve": serve_line}


def headline(stage: str, out: dict[str, Any]) -> str:
    """The figures of ``stage``'s artifacts worth a line ("" for a stage without a headline)."""
    line = LINES.get(stage)
    text = ""
    for part in line(out) if line else []:
        text += (" " if part.startswith("→") else ", ") + part if text else part
    return text


def plan(stage: str, cfg: SpeclineConfig) -> str:
    """What a starting stage is about to do, when it is more than its name (the pipeline's stages)."""
    return " → ".join(cfg.stages) if stage == "pipeline" else ""
