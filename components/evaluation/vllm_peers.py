"""vLLM as a peer of the evaluation stage (this side runs in the main environment).

Methods (opt-in, ``eval.methods``), each a vLLM ``speculative_config`` on the same target:

* ``vllm_generate``    -- the target alone (the vLLM baseline: ``speedup_vs_vllm_generate``);
* ``vllm_ngram``       -- vLLM's n-gram prompt lookup (γ = ``eval.lookup_num_speculative_tokens``, n-grams
  1..``eval.lookup_max_ngram``, as our ``prompt_lookup``);
* ``vllm_suffix``      -- suffix decoding (needs the ``arctic-inference`` package in the vLLM
  environment; without it vLLM's own error is reported as the reason it is unavailable);
* ``vllm_draft_model`` -- the small assistant LM that ``hf_assisted`` uses, as vLLM's draft
  model (``eval.vllm_num_speculative_tokens`` drafts per step);
* ``vllm_drafter``     -- our trained drafter, exported with ``components.export.vllm`` (the
  speculators layout, else the native one) into a temporary directory; γ as our ``drafter``
  method's. vLLM's CPU runner refuses DSpark: that (and any other refusal) makes the method
  *unavailable* with vLLM's reason; the other methods still run.

Each method is a :class:`Method` entry of ``VLLM_METHODS`` whose ``speculative_config`` builds
its config (the entries are merged into ``methods.METHODS``). ``plan_vllm`` checks and prepares
everything before any timing (the vLLM Python exists, the drafter exports); ``run_vllm`` then
runs all vLLM methods in ONE subprocess of the vLLM environment (``python -m
components.evaluation.vllm_run``, which documents how vLLM is timed: method after method, one
request at a time, greedy, float32, prompts as token ids) and turns its JSON into the same
:class:`PromptRun` records as ours (tokens, seconds, accepted/drafted per verify step from
vLLM's per-request metrics). ``compare_drafter`` sets vLLM's acceptance length for our exported
drafter beside our engine's τ for the same drafter and prompts, round by round.

Never imports vLLM. Knows the spec/result format of ``vllm_run``, the exporter and EvalConfig;
nothing about our other methods, MLflow or how reports are drawn.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components.config import ConfigError, EvalConfig
from components.drafters.base import DrafterError
from components.evaluation.context import EvalContext, Method
from components.evaluation.metrics import PromptRun, tau
from components.export import ExportError, export_vllm, vllm_speculative_config
from components.export.vllm import LAYOUTS
from components.export.vllm_check import REFUSED_ON_CPU

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
RESULT_PREFIX = "VLLM_EVAL_JSON "  # components.evaluation.vllm_run prints its result after this
TIMEOUT_S = 3600
MODEL_LEN_MARGIN = 64  # max_model_len headroom over prompt + new tokens (room for drafts)
TIMING = ("vLLM runs in its own process, after ours: method after method (each after one untimed "
          "warmup request), one request at a time (batch 1); seconds = wall time of llm.generate per "
          "prompt (vLLM's scheduling, input/output processing and every forward; no detokenization), "
          "greedy, float32, eager, eval.threads OMP/torch threads")

HINTS = {"suffix": " (arctic-inference is not in `make vllm-env`: PyPI has only its sdist, whose build pulls "
                   "torch 2.7 with the CUDA libraries; see README, Evaluation stage)"}

log = logging.getLogger(__name__)
VLLM_REFERENCE = "vllm_generate"


def vllm_python(ev: EvalConfig) -> Path:
    """The vLLM environment's Python: eval.vllm_python, $SPECLINE_VLLM_PYTHON or .venv-vllm."""
    given = ev.vllm_python or os.environ.get("SPECLINE_VLLM_PYTHON")
    path = Path(given).expanduser() if given else DEFAULT_VLLM_PYTHON
    if not path.is_file():
        where = "eval.vllm_python" if ev.vllm_python else ("$SPECLINE_VLLM_PYTHON" if given else "the default")
        wanted = sorted(set(ev.methods) & set(VLLM_METHODS))
        raise ConfigError(f"eval.vllm_python: methods {wanted} run vLLM in its own environment, but there is no "
                          f"Python at {path} ({where}); build it with `make vllm-env`, or set "
                          "eval.vllm_python=<vLLM env>/bin/python (or drop them from eval.methods)")
    return path


@dataclass
class VllmPlan:
    """What ``run_vllm`` runs: the vLLM Python, the methods' configs, exports in ``workdir``."""

    python: Path
    methods: list[dict[str, Any]]  # {"name", "speculative_config"} in eval.methods order
    workdir: Path
    unavailable: dict[str, str] = field(default_factory=dict)  # decided before vLLM even starts

    def close(self) -> None:
        """Removes the temporary directory (exports, spec, result)."""
        shutil.rmtree(self.workdir, ignore_errors=True)


def target_alone(ctx: EvalContext, workdir: Path) -> None:
    """``vllm_generate``: no speculative_config, the target alone."""


def ngram(ctx: EvalContext, workdir: Path) -> dict[str, Any]:
    """``vllm_ngram``: as our ``prompt_lookup`` (γ, n-grams 1..max)."""
    return {"method": "ngram", "num_speculative_tokens": ctx.ev.lookup_num_speculative_tokens,
            "prompt_lookup_max": ctx.ev.lookup_max_ngram, "prompt_lookup_min": 1}


def suffix(ctx: EvalContext, workdir: Path) -> dict[str, Any]:
    """``vllm_suffix``: vLLM's defaults (tree depth 24 = max drafts per step)."""
    return {"method": "suffix"}


def draft_model(ctx: EvalContext, workdir: Path) -> dict[str, Any]:
    """``vllm_draft_model``: the assistant LM that ``hf_assisted`` uses, as vLLM's draft model."""
    if not ctx.assistant_path:
        raise ConfigError("eval.assistant: method 'vllm_draft_model' needs the assistant LM (the one "
                          "hf_assisted uses); set eval.assistant (or drop vllm_draft_model)")
    return {"method": "draft_model", "model": str(ctx.assistant_path),
            "num_speculative_tokens": ctx.ev.vllm_num_speculative_tokens}


def exported_drafter(ctx: EvalContext, workdir: Path) -> dict[str, Any]:
    """``vllm_drafter``: exports the trained drafter for vLLM; ExportError propagates (the method
    is unavailable)."""
    drafter = ctx.trained_drafter("vllm_drafter")
    for layout in LAYOUTS:  # speculators first; Medusa has only the native layout
        try:
            path = export_vllm(drafter, ctx.target, workdir / "drafter-vllm", layout=layout)
            break
        except ExportError:
            if layout == LAYOUTS[-1]:
                raise
    gamma = ctx.ev.num_speculative_tokens or drafter.num_speculative_tokens
    ctx.notes["vllm_drafter"] = {"drafter": drafter.registry_name, "export_layout": layout,
                                 "num_speculative_tokens": gamma,
                                 **({"carryover": "exported without carryover"} if ctx.ev.carryover else {})}
    return vllm_speculative_config(drafter, path, gamma)


VLLM_METHODS: dict[str, Method] = {
    VLLM_REFERENCE: Method(speculative_config=target_alone, peer="vllm"),
    "vllm_ngram": Method(speculative_config=ngram, peer="vllm"),
    "vllm_suffix": Method(speculative_config=suffix, peer="vllm"),
    "vllm_draft_model": Method(speculative_config=draft_model, peer="vllm", needs_assistant=True),
    "vllm_drafter": Method(speculative_config=exported_drafter, peer="vllm", needs_drafter=True,
                           engine_twin="drafter"),
}


def plan_vllm(ctx: EvalContext, methods: dict[str, Method]) -> VllmPlan:
    """Checks the vLLM environment and prepares every method's config (exports included)."""
    python = vllm_python(ctx.ev)
    plan = VllmPlan(python, [], Path(tempfile.mkdtemp(prefix="specline-vllm-eval-")))
    for name, method in methods.items():
        try:
            sc = method.speculative_config(ctx, plan.workdir)
        except DrafterError as err:  # ExportError: no vLLM layout for this drafter
            plan.unavailable[name] = f"export: {err}"
            continue
        plan.methods.append({"name": name, "speculative_config": sc})
        ctx.notes.setdefault(name, {}).update({"speculative_config": sc, "timing": TIMING})
    return plan


def _spec(ctx: EvalContext, plan: VllmPlan, prompts: list[Any]) -> dict[str, Any]:
    longest = max(len(p.input_ids) for p in prompts)
    return {"target": str(ctx.target.name_or_path), "max_new_tokens": ctx.ev.max_new_tokens,
            "max_model_len": longest + ctx.ev.max_new_tokens + MODEL_LEN_MARGIN,
            "temperature": ctx.ev.temperature, "seed": ctx.ev.seed, "threads": ctx.ev.threads or None,
            "warmup_tokens": 8 if ctx.ev.warmup else 0, "methods": plan.methods,
            "prompts": [{"prompt_id": p.prompt_id, "input_ids": list(p.input_ids), "seed": p.seed}
                        for p in prompts]}


def _subprocess(plan: VllmPlan, spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """Runs vllm_run once; a crash or a missing result raises RuntimeError with the stderr tail."""
    spec_path, out_path = plan.workdir / "spec.json", plan.workdir / "result.json"
    spec_path.write_text(json.dumps(spec))
    extra = os.environ.get("PYTHONPATH")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT)] + ([extra] if extra else [])),
               VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    if threads > 0:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [str(plan.python), "-m", "components.evaluation.vllm_run", "--spec", str(spec_path), "--out", str(out_path)]
    log.info("eval: running %d vLLM method(s) in %s", len(plan.methods), plan.python)
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"vLLM subprocess ran past {TIMEOUT_S} s") from None
    if proc.returncode != 0 or not out_path.is_file():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
        raise RuntimeError(f"vLLM subprocess exited {proc.returncode} without a result:\n" + "\n".join(tail))
    return json.loads(out_path.read_text())


def _reason(result: dict[str, Any]) -> str:
    """Why vLLM did not run a method, in one line (vLLM's own words)."""
    method = (result.get("speculative_config") or {}).get("method", "")
    if result.get("refused_on_cpu"):
        return f"vLLM's CPU model runner refuses {method}: \"{REFUSED_ON_CPU[method]}\" (only its V2 GPU runner has it)"
    return f"vLLM: {result['error']}{HINTS.get(method, '')}"


def _runs(name: str, result: dict[str, Any]) -> list[PromptRun]:
    out = []
    for r in result["runs"]:
        run = PromptRun(name, r["prompt_id"], list(r["tokens"]), float(r["seconds"]),
                        accepted=list(r.get("accepted", [])), drafted=list(r.get("drafted", [])))
        if result.get("speculative_config") is None:
            run.target_forwards = len(run.tokens)  # prefill + one pass per further token
        out.append(run)
    return out


def overshoot(runs: list[PromptRun]) -> int:
    """Tokens vLLM's counters credit past max_new_tokens: its last step verifies a full k drafts
    and the output is cut afterwards (our engine shrinks the last round's γ to what is left)."""
    return sum(max(0, sum(a + 1 for a in r.accepted) - (len(r.tokens) - 1)) for r in runs)


def run_vllm(ctx: EvalContext, plan: VllmPlan, prompts: list[Any]) -> tuple[dict[str, list[PromptRun]], dict[str, str]]:
    """(runs per method, unavailable method → reason). The caller closes the plan."""
    unavailable = dict(plan.unavailable)
    runs: dict[str, list[PromptRun]] = {}
    result: dict[str, Any] = {"methods": {}}
    if plan.methods:
        try:
            result = _subprocess(plan, _spec(ctx, plan, prompts), ctx.ev.threads)
        except RuntimeError as err:  # every vLLM method is unavailable; ours are still reported
            log.error("eval: %s", err)
            unavailable |= {m["name"]: f"vLLM subprocess failed: {str(err).splitlines()[0]}" for m in plan.methods}
    for name, res in result["methods"].items():
        if "error" in res:
            unavailable[name] = _reason(res)
            continue
        runs[name] = _runs(name, res)
        notes = ctx.notes.setdefault(name, {})
        notes.update({"vllm_version": result.get("vllm_version"),
                      "startup_seconds": round(res.get("startup_seconds", 0.0), 1)})
        if res.get("counters"):
            notes["vllm_counters"] = res["counters"]
            notes["tokens_counted_past_max_new_tokens"] = overshoot(runs[name])
    for name, why in unavailable.items():
        log.warning("eval: %s unavailable: %s", name, why)
    return runs, unavailable


def clipped(run: PromptRun, gamma: int) -> list[int]:
    """vLLM's accepted-per-step of one prompt as our engine would have counted it: the engine
    stops drafting at max_new_tokens (γ of its last round = tokens left − 1), vLLM does not."""
    left, out = len(run.tokens) - 1, []
    for a in run.accepted:
        if left <= 0:
            break
        g = max(1, min(gamma, left - 1))
        out.append(min(a, g))
        left -= min(a, g) + 1
    return out


def compare_drafter(engine: list[PromptRun], vllm: list[PromptRun], gamma: int) -> dict[str, Any]:
    """Our engine's τ and vLLM's mean acceptance length for the same drafter and prompts, the
    difference, and where the per-round acceptances first part (prompt order is the same)."""
    eng = [a for r in engine for a in r.accepted]
    raw = [a for r in vllm for a in r.accepted]
    clip = [clipped(r, gamma) for r in vllm]
    same = [e.accepted == c for e, c in zip(engine, clip, strict=True)]
    first = []
    for e, c, r in zip(engine, clip, vllm):
        i = next((k for k, (x, y) in enumerate(zip(e.accepted, c)) if x != y), None)
        if i is not None:
            first.append({"prompt_id": r.prompt_id, "round": i, "engine": e.accepted[i], "vllm": c[i]})
    return {"engine_tau": tau(eng), "vllm_tau": tau(raw), "vllm_minus_engine_tau": tau(raw) - tau(eng),
            "vllm_tau_clipped_to_max_new_tokens": tau([a for c in clip for a in c]),
            "engine_rounds": len(eng), "vllm_rounds": len(raw), "tokens_counted_past_max_new_tokens": overshoot(vllm),
            "prompts_with_identical_rounds": f"{sum(same)}/{len(same)}", "first_differing_rounds": first[:8]}
