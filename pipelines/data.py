"""Stage ``data``: prompts → target rollouts → hidden-state records, as shards or a stream.

    python -m pipelines.data conf=dspark.yaml
    python -m pipelines.data conf=dspark.yaml data.prompt_source=/data/sharegpt.jsonl data.storage=int8

Shards mode writes (or completes, after a crash) the shards and manifest under
``data.output_dir`` and logs counts, tokens/s, bytes/token, the manifest and a sample of
rollouts to a (nested) MLflow run, with progress metrics per finished shard. Stream mode
builds nothing here: it checks the prompts and describes the stream; the training stage calls
:func:`components.data.stream.rollout_stream` itself so hidden states never touch disk.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from components.cluster import init_ray
from components.config import SpeclineConfig
from components.data.build import build_shards
from components.data.prompts import collect_prompts
from components.data.records import record_bytes_per_token
from components.data.source import describe_target, record_meta
from components.logs import CONSOLE_LOGGER
from components.tracking import Tracker
from pipelines.cli import main


def _log_prompts(tracker: Tracker, stats: dict[str, Any]) -> None:
    tracker.log_metrics({f"prompts_{k}": v for k, v in stats.items() if isinstance(v, int)})
    if stats["malformed_where"]:
        tracker.log_text("\n".join(stats["malformed_where"]), "malformed_prompts.txt")


def _samples_text(samples: list[dict[str, str]]) -> str:
    return "\n\n".join(f"## {s['sample_id']}\n### prompt\n{s['prompt']}\n### response\n{s['response']}"
                       for s in samples)


def _progress(tracker: Tracker):
    """Per finished shard: metrics to MLflow (step = shards done). The console gets the actors'
    own progress lines, one per generation batch (components/data/actors.py)."""
    def report(p: dict[str, Any]) -> None:
        tracker.log_metrics(p, step=p["shards_done"])
    return report


def run(cfg: SpeclineConfig, tracker: Tracker, upstream: dict[str, Any]) -> dict[str, Any]:
    """Returns upstream plus ``data_mode`` and, in shards mode, ``data_dir``/``manifest``/counts."""
    desc = describe_target(cfg, upstream.get("target_path"))
    meta = record_meta(cfg, desc)
    prompts, stats = collect_prompts(cfg.data, desc.tokenizer, desc.corpus_dir)
    tracker.log_params({f"data.{k}": v for k, v in asdict(cfg.data).items()}
                       | {"data.layer_ids": list(meta.layer_ids), "data.last_layer": meta.last_layer})
    _log_prompts(tracker, asdict(stats))
    result = {**upstream, "data_mode": cfg.data.mode, "data_meta": meta.to_dict(), "num_prompts": len(prompts),
              "prompts_skipped": {"empty": stats.empty, "too_long": stats.too_long, "malformed": stats.malformed}}
    if cfg.data.mode == "stream":
        tracker.log_metrics({"hidden_bytes_per_token": record_bytes_per_token(meta)})
        return {**result, "stream": "components.data.stream.rollout_stream(cfg)"}
    init_ray(cfg.ray)
    out = Path(cfg.data.output_dir)
    manifest = build_shards(cfg, desc, prompts, stats, out, progress=_progress(tracker),
                            lines=logging.getLogger(CONSOLE_LOGGER).info)
    totals, runinfo = manifest["totals"], manifest["run"]
    seconds = runinfo["seconds"]
    tracker.log_metrics({**totals, "seconds": seconds, "shards": len(manifest["shards"]),
                         "shards_reused": runinfo["shards_reused"], "shards_written": runinfo["shards_written"],
                         "tokens_per_s": totals["tokens"] / seconds if seconds else 0.0,
                         "response_tokens_per_s": totals["response_tokens"] / seconds if seconds else 0.0,
                         "capture_share": runinfo["capture_seconds"] /
                         max(1e-9, runinfo["capture_seconds"] + runinfo["generate_seconds"])})
    tracker.log_dict(manifest, "data/manifest.json")
    tracker.log_text(_samples_text(manifest["samples"][:cfg.data.log_samples]), "data/rollouts_sample.md")
    return {**result, "data_dir": str(out), "manifest": str(out / "manifest.json"),
            "num_records": totals["records"], "num_tokens": totals["tokens"],
            "bytes_per_token": totals["bytes_per_token"], "data_seconds": seconds}


if __name__ == "__main__":
    sys.exit(main(run, "data"))
