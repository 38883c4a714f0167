"""Stage ``eval``: the trained drafter in the engine, beside baselines and peers, same prompts.

    python -m pipelines.evaluate conf=dspark.yaml eval.drafter_path=runs/train/drafter
    python -m pipelines.evaluate conf=dspark.yaml "eval.methods=[target_only,prompt_lookup,hf_generate]"
    python -m pipelines.evaluate conf=dspark.yaml eval.drafter_path=DIR \
        "eval.methods=[target_only,drafter,prompt_lookup,vllm_generate,vllm_ngram,vllm_draft_model,vllm_drafter]"

On held-out prompts (``components.evaluation.prompts``: ``eval.num_prompts`` of each named set
of ``eval.prompt_sets``: humaneval, chat, summarise, text) it runs every method of
``eval.methods`` (``components.evaluation.methods``; target_only always, as the reference) in
this one process, interleaved, and measures τ, acceptance by draft position, tokens/s and the
speedup over plain decoding of the same target in the same run, over all prompts and per prompt
set (Spec-Bench's layout: a column per set). Greedy outputs must equal target_only's token for
token; a method that differs is reported loudly (stderr, ``lossless`` false, the first mismatch
and whether it is a numerical near-tie) but does not stop the stage.
The train stage's offline τ estimate (``upstream["heldout_tau"]``, α = 1 − TV on held-out
rollouts) is set beside the τ the engine measures with the same drafter.

Logs to MLflow: ``eval/<method>/{tau,tokens_per_s,speedup,...}`` metrics over all prompts and
``eval/<set>/<method>/{...}`` per prompt set, ``eval/results.md`` (tables) and
``eval/results.json``, and plots of acceptance by position and of the speedups.
Everything is also written under ``eval.output_dir``. Timing runs in-process, not on Ray: a
speedup is a ratio of two timings that must share one quiet process. The vLLM peers
(``vllm_*``, opt-in) are the exception: vLLM lives in its own environment, so they run in one
vLLM subprocess after ours (``components.evaluation.vllm_peers``; the report says how they are
timed); ``vllm_drafter``'s acceptance length is set beside our engine's τ for the same drafter.

This file loads what the methods' registry entries ask for (a drafter, an assistant), runs
``compare_methods`` and logs; the tables and ``results.md`` are ``components.evaluation.report``'s.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from components.config import EMBEDDED_TARGET, TINY_TARGET, ConfigError, SpeclineConfig
from components.data.records import RecordMismatchError
from components.data.shards import find_rollouts, read_responses
from components.drafters import DrafterError, load_drafter
from components.drafters.quantize import int8_lm_head
from components.evaluation import (
    EvalContext,
    EvalReport,
    check_methods,
    compare_methods,
    eval_prompts,
    needs_assistant,
    needs_drafter,
    needs_rollouts,
)
from components.evaluation import report as rep
from components.evaluation.assistant import ensure_embedded_assistant, load_assistant
from components.target import load_target
from components.target.fast import step_target, stream_linears
from components.target.hf import resolve_target_path
from components.tracking import Tracker
from pipelines.cli import main


def _drafter(cfg: SpeclineConfig, upstream: dict[str, Any], target: Any, methods: list[str]) -> Any:
    if not needs_drafter(methods):
        return None
    path = cfg.eval.drafter_path or upstream.get("drafter_path")
    if not path:
        return None  # the methods that need one name the key to set
    where = Path(path)
    if not (where / "config.json").is_file():
        raise ConfigError(f"eval.drafter_path: '{path}' is not a drafter checkpoint directory (no config.json)")
    try:
        drafter = load_drafter(where, target).eval()
    except DrafterError as err:
        raise ConfigError(f"eval.drafter_path: {err}") from None
    if cfg.eval.drafter_int8_head:
        try:
            int8_lm_head(drafter)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ConfigError(f"eval.drafter_int8_head: {err}") from None
    return drafter


def _assistant(cfg: SpeclineConfig, target_path: str, target: Any, methods: list[str]) -> tuple[Any, str | None]:
    name = cfg.eval.assistant
    if not needs_assistant(methods) or name in (None, "", "none"):
        return None, None
    if name == "auto":
        if cfg.target.name_or_path not in (EMBEDDED_TARGET, TINY_TARGET):
            raise ConfigError("eval.assistant: 'auto' builds an assistant only for the built-in targets (embedded, tiny); "
                              "set eval.assistant=<HF directory or hub id with the target's tokenizer>")
        cache = Path(cfg.target.cache_dir)
        name = str(ensure_embedded_assistant(Path(target_path), cfg.target.tiny, cfg.eval, cache))
    return load_assistant(name, target), name


def _rollouts(cfg: SpeclineConfig, upstream: dict[str, Any], target: Any,
              methods: list[str]) -> tuple[list[list[int]], str | None]:
    """The responses suffix decoding's global tree starts with (``eval.suffix_rollouts``: auto =
    the data stage's shards of this run, when they are this target's) and where they are from."""
    setting = cfg.eval.suffix_rollouts
    if not needs_rollouts(methods):
        return [], None
    try:
        found = find_rollouts(setting, [upstream.get("data_dir"), cfg.data.output_dir], "eval.suffix_rollouts")
        responses = list(read_responses(found, target.tokenizer_hash)) if found is not None else []
    except FileNotFoundError as err:
        raise ConfigError(str(err)) from None
    except RecordMismatchError as err:
        if setting != "auto":
            raise ConfigError(f"eval.suffix_rollouts: {err}") from None
        print(f"eval: suffix decoding starts with an empty tree: {err}", flush=True)
        return [], None
    if found is not None:
        print(f"eval: suffix decoding's global tree starts with {len(responses)} rollout responses "
              f"({sum(map(len, responses)):,} tokens) from {found}", flush=True)
    return responses, str(found) if found is not None else None


def _log(tracker: Tracker, cfg: SpeclineConfig, report: EvalReport, offline: dict[str, Any], out: Path) -> None:
    tracker.log_metrics(rep.stage_metrics(report, offline))
    text = rep.markdown(report, cfg.eval, cfg.eval.threads or torch.get_num_threads(), offline)
    data = rep.json_keys(rep.report_dict(report) | {"offline_vs_engine": offline})
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(text)
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    tracker.log_text(text, "eval/results.md")
    tracker.log_dict(json.loads(json.dumps(data, default=str)), "eval/results.json")
    plots = [rep.plot_acceptance(report, out / "plots" / "acceptance_by_position.png",
                                 offline.get("offline_alpha")),
             rep.plot_speedups(report, out / "plots" / "speedups.png")]
    if any(plots):
        tracker.log_artifacts(out / "plots", "eval/plots")


def _tag_registered(tracker: Tracker, cfg: SpeclineConfig, upstream: dict[str, Any], report: EvalReport) -> None:
    """The registered drafter version the train stage made carries what this eval measured of it
    (τ and speedup per method over all prompts, and this eval's run), unless another drafter
    (``eval.drafter_path``) was evaluated."""
    version = upstream.get("registered_version")
    if version is None or cfg.eval.drafter_path or not cfg.train.register_as:
        return
    tags = {f"eval.{m}.{k}": round(float(v), 4) for m, sm in report.summaries.items()
            for k, v in (("tau", sm.tau), ("speedup", sm.speedup)) if v is not None}
    tracker.tag_model_version(cfg.train.register_as, int(version), tags | {"eval.run_id": tracker.active_run_id()})


def _shout(report: EvalReport) -> None:
    for name in report.failures:
        s = report.summaries[name]
        ties = sum(bool(m.near_tie) for m in s.mismatches)
        print(f"eval: NOT LOSSLESS: {name} differs from target_only on {len(s.mismatches)} of "
              f"{len(report.prompts)} prompts ({ties} at numerical near-ties); first: {s.mismatches[0]}",
              file=sys.stderr, flush=True)
    for name, why in report.unavailable.items():
        print(f"eval: {name} unavailable: {why}", file=sys.stderr, flush=True)


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns upstream plus ``eval_dir``, ``eval_results``, the drafter it ran (``eval_drafter_path``),
    per-method τ / speedup / lossless over all prompts and τ / speedup per prompt set
    (``eval_sets``: set → method → {tau, speedup})."""
    methods = check_methods(cfg.eval)
    t0 = time.perf_counter()
    target_path = upstream.get("target_path") or resolve_target_path(cfg.target, progress=True)
    target = load_target(dataclasses.replace(cfg.target, name_or_path=target_path), progress=False)
    prompts = eval_prompts(cfg.eval, target.tokenizer, Path(target_path) if Path(target_path).is_dir() else None)
    assistant, assistant_name = _assistant(cfg, target_path, target, methods)
    drafter = _drafter(cfg, upstream, target, methods)
    fast = step_target(target, cfg.target, taps=list(drafter.layer_ids) if drafter is not None else [],
                       lines=lambda line: print(f"eval: {line}", flush=True))
    if fast is not target and drafter is not None:  # the drafter's few-row products too; the target's
        stream_linears(target, cfg.target, modules=[drafter], keep_target=True)  # stay: its peers share it
    rollouts, rollouts_from = _rollouts(cfg, upstream, target, methods)
    ctx = EvalContext(target, cfg.eval, drafter=drafter, assistant=assistant, assistant_path=assistant_name,
                      step=fast, rollouts=rollouts, rollouts_from=rollouts_from)
    tracker.log_params({f"eval.{k}": v for k, v in dataclasses.asdict(cfg.eval).items()}
                       | {"eval.target_path": target_path, "eval.assistant_path": assistant_name})
    report = compare_methods(ctx, methods, prompts)
    _shout(report)
    offline = rep.offline_vs_engine(report, upstream.get("heldout_tau"), upstream.get("heldout_alpha"))
    out = Path(cfg.eval.output_dir)
    _log(tracker, cfg, report, offline, out)
    _tag_registered(tracker, cfg, upstream, report)
    s = report.summaries
    return {**upstream, "eval_dir": str(out), "eval_results": str(out / "results.json"),
            "eval_methods": methods, "eval_prompts": len(prompts),
            "eval_drafter_path": (cfg.eval.drafter_path or upstream.get("drafter_path")) if drafter is not None else None,
            "eval_tau": {m: v.tau for m, v in s.items()},
            "eval_tokens_per_s": {m: v.tokens_per_s for m, v in s.items()},
            "eval_speedup": {m: v.speedup for m, v in s.items()},
            "eval_decode_speedup": {m: v.decode_speedup for m, v in s.items()},  # after the first token
            "eval_ttft_s": {m: v.ttft_s for m, v in s.items()},
            "eval_lossless": {m: v.lossless for m, v in s.items()},
            "eval_sets": {n: {m: {"tau": v.tau, "speedup": v.speedup} for m, v in g.items()}
                          for n, g in report.sets.items()},
            "eval_lossless_failures": report.failures, "eval_unavailable": dict(report.unavailable),
            "eval_offline_tau": offline["offline_tau"],
            "eval_engine_tau": offline["engine_tau"], "eval_seconds": time.perf_counter() - t0}


if __name__ == "__main__":
    sys.exit(main(run, "eval"))
