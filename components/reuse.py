"""Stage reuse: a stage whose output exists for the same inputs is not run again.

A stage's *inputs* are the config sections its output depends on and the content of the
upstream outputs it reads (:func:`stage_inputs`); their hash is its *key*. Beside its output
(``<output dir>/.specline-stage.json``; the target stage's output lives in its cache, so its
record is ``<run_dir>/target/.specline-stage.json``) a stage leaves a record:

* when it starts: ``complete: false`` with its key and the entries its output directory held
  before any run of it (``preexisting``: never touched);
* when it has finished: ``complete: true`` with the artifacts it returned (only the keys it added
  or changed) and its MLflow run id, written atomically (temporary file, fsync, rename), so a
  crash or Ctrl-C never leaves a record that claims completion.

:func:`decide` compares the current key with the record: same key and complete (and every
absolute path among the recorded artifacts still there) → reused; same key but unfinished → run
again over what is there (the stages resume: the data stage keeps finished shards, Ray Train its
checkpoints); another key, or ``force`` naming the stage → the entries an earlier run of the
stage created are removed (never the preexisting ones, the run directory's logs and tracking
store, another stage's output or a cache), then it runs. A stage downstream of one that ran
again sees another upstream hash and runs again too (the data manifest records its own run
time, so a rerun data stage always changes it; a retrained drafter that came out bit for bit the
same leaves its evaluation reused).

What the key covers, stage by stage (whole config sections unless said otherwise):

* target: the target section, and the size and mtime of the files of a local target directory;
* data: target; data (without ``log_samples``); the drafter fields that pick the captured layers
  (``name``, ``layer_ids``, ``num_taps``); the top-level ``seed``; size and mtime of a prompt file;
* train: target; drafter; train (without ``log_every``; ``data_dir`` as read); ``seed``; the
  sha256 of the data stage's ``manifest.json`` that it reads (which lists every shard's sha256),
  or, for a stream, the data section as the data stage's;
* eval: target; eval (``drafter_path`` as read); the sha256 of every file of the drafter
  checkpoint it evaluates; the train stage's held-out τ/α it reports beside its own; size and mtime
  of a prompt file.

What it does not know: changes to specline's code within a version (the key holds the package
version; after changing code, ``force=[...]`` the stages it touches); a prompt file or a local
target rewritten with its size and mtime kept; shards or checkpoints edited on disk after the
manifest or record was written (only the manifest file and the drafter files are hashed, when a
downstream stage reads them); settings that do not change a stage's output are left out on
purpose (``log_level``, ``tracking``, ``ray``, ``serve``, ``stages``, ``force``, ``log_every``,
``log_samples``). The serve stage is a live service: never reused, never recorded.

Knows the config schema, the artifact keys the stages return and files; nothing about how a
stage computes them, Ray or MLflow.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from components.config import ConfigError, SpeclineConfig

RECORD = ".specline-stage.json"
REUSABLE = ("target", "data", "train", "eval")  # in pipeline order; serve always runs
ORDER = (*REUSABLE, "serve")
FORCE_ALL = "all"
NOT_IN_HASH = {"data": ("log_samples",), "train": ("log_every",)}  # fields that change no output
LABELS = {"data_manifest_sha256": "the data stage's output (manifest.json)",
          "drafter_sha256": "the drafter checkpoint", "specline": "specline's version"}


@dataclass
class Decision:
    """What to do with one stage: reuse its recorded output, or run it (after clearing a stale one)."""

    stage: str
    key: str
    inputs: dict[str, Any]
    record_path: Path
    record: dict[str, Any] | None  # what is on disk, complete or not
    reuse: bool
    stale: bool  # run after removing what an earlier run of the stage created
    why: str  # for the console: why it is reused or run again ("" on a first run)


# ----------------------------------------------------------------------------- inputs
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specline")
    except PackageNotFoundError:
        return "unknown"


def _section(cfg: Any, drop: tuple[str, ...] = ()) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in drop}


def files_signature(path: str | None) -> list[Any] | None:
    """Size and mtime of a local file, or of every file under a local directory; None otherwise."""
    if not path:
        return None
    p = Path(path)
    if p.is_file():
        st = p.stat()
        return [p.name, st.st_size, st.st_mtime_ns]
    if p.is_dir():
        return [[str(f.relative_to(p)), f.stat().st_size, f.stat().st_mtime_ns]
                for f in sorted(p.rglob("*")) if f.is_file()]
    return None


def content_sha256(path: str | Path | None) -> str | None:
    """sha256 over a file, or over every file of a directory (relative names and bytes); None if absent."""
    if not path:
        return None
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(p) if f != p else f.name).encode() + b"\0")
        with f.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def stage_inputs(stage: str, cfg: SpeclineConfig, upstream: dict[str, Any]) -> dict[str, Any]:
    """What ``stage``'s output depends on, as plain data (see the module docstring)."""
    out: dict[str, Any] = {"stage": stage, "specline": _version(), "target": _section(cfg.target),
                           "target_files": files_signature(cfg.target.name_or_path)}
    if stage == "data":
        d = cfg.drafter
        out |= {"seed": cfg.seed, "data": _section(cfg.data, NOT_IN_HASH["data"]),
                "drafter_taps": {"name": d.name, "layer_ids": d.layer_ids, "num_taps": d.num_taps},
                "prompt_files": files_signature(cfg.data.prompt_source)}
    elif stage == "train":
        data_dir = cfg.train.data_dir or upstream.get("data_dir")
        out |= {"seed": cfg.seed, "drafter": _section(cfg.drafter),
                "train": _section(cfg.train, NOT_IN_HASH["train"]) | {"data_dir": data_dir}}
        if data_dir:
            out["data_manifest_sha256"] = content_sha256(Path(data_dir) / "manifest.json")
        elif cfg.data.mode == "stream":
            out |= {"data": _section(cfg.data, NOT_IN_HASH["data"]),
                    "prompt_files": files_signature(cfg.data.prompt_source)}
    elif stage == "eval":
        drafter = cfg.eval.drafter_path or upstream.get("drafter_path")
        out |= {"eval": _section(cfg.eval) | {"drafter_path": drafter}, "drafter_sha256": content_sha256(drafter),
                "offline": {k: upstream.get(k) for k in ("heldout_tau", "heldout_alpha")},
                "prompt_files": files_signature(cfg.eval.prompt_source)}
    return out


def key_of(inputs: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()


def changes(old: dict[str, Any], new: dict[str, Any], limit: int = 3) -> str:
    """``train.max_steps 2 → 3, ...``: the inputs that differ, for a person."""
    a, b = _flat(old), _flat(new)
    keys = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    parts = [LABELS[k] if k in LABELS else f"{k} {_short(a.get(k))} → {_short(b.get(k))}" for k in keys[:limit]]
    return ", ".join(parts) + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = json.dumps(v, sort_keys=True, default=str)
    return out


def _short(text: str | None, width: int = 40) -> str:
    text = "unset" if text is None else text[1:-1] if text.startswith('"') else text  # strings unquoted
    return text if len(text) <= width else text[:width - 1] + "…"


# ----------------------------------------------------------------------------- records
def output_dir(stage: str, cfg: SpeclineConfig) -> Path | None:
    """Where ``stage`` writes (its record goes there); None for a stage that is never reused."""
    if stage == "target":
        return Path(cfg.run_dir) / "target"
    if stage == "data":
        return Path(cfg.data.output_dir) if cfg.data.mode == "shards" else None  # a stream writes nothing
    return {"train": Path(cfg.train.output_dir), "eval": Path(cfg.eval.output_dir)}.get(stage)


def read_record(path: Path) -> dict[str, Any] | None:
    """The record at ``path``; None when there is none or it cannot be read (it then claims nothing)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and "key" in record else None


def write_record(path: Path, record: dict[str, Any]) -> None:
    """``record`` at ``path``, atomically: a temporary file beside it, synced, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with tmp.open("w") as fh:
            fh.write(json.dumps(record, indent=1, sort_keys=True, default=str))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def check_force(cfg: SpeclineConfig, stages: list[str] | None = None) -> set[str]:
    """The stages ``force`` names (``all``: every one of ``stages``); unknown names are a ConfigError."""
    bad = [s for s in cfg.force if s not in (*REUSABLE, FORCE_ALL)]
    if bad:
        hint = " (serve is never reused: it always starts)" if "serve" in bad else ""
        raise ConfigError(f"force: unknown {bad}{hint}; force names stages among {list(REUSABLE)} or '{FORCE_ALL}'")
    if stages is not None:
        idle = [s for s in cfg.force if s != FORCE_ALL and s not in stages]
        if idle:
            raise ConfigError(f"force: {idle} not among stages={stages}; add them to stages or drop them from force")
    return set(REUSABLE) if FORCE_ALL in cfg.force else set(cfg.force)


def _missing_paths(artifacts: dict[str, Any]) -> list[str]:
    return [v for v in artifacts.values() if isinstance(v, str) and v.startswith("/") and not Path(v).exists()]


def decide(stage: str, cfg: SpeclineConfig, upstream: dict[str, Any], forceable: bool = True) -> Decision | None:
    """Reuse or run ``stage`` with these upstream artifacts; None for a stage that is never reused."""
    where = output_dir(stage, cfg) if stage in REUSABLE else None
    if where is None:
        return None
    forced = stage in check_force(cfg) and forceable
    inputs = stage_inputs(stage, cfg, upstream)
    key = key_of(inputs)
    path = where / RECORD
    record = read_record(path)
    decision = Decision(stage, key, inputs, path, record, reuse=False, stale=False, why="")
    if record is None:
        return decision
    if forced:
        return dataclasses.replace(decision, stale=True, why=f"force=[{stage}]: its earlier output is replaced")
    if record["key"] != key:
        what = changes(record.get("inputs") or {}, inputs)
        return dataclasses.replace(decision, stale=True, why=f"inputs changed: {what}" if what else "inputs changed")
    if not record.get("complete"):
        return dataclasses.replace(decision, why="an earlier run with the same inputs stopped: resuming")
    gone = _missing_paths(record.get("artifacts") or {})
    if gone:
        return dataclasses.replace(decision, stale=True, why=f"its recorded output {gone[0]} is gone")
    return dataclasses.replace(decision, reuse=True, why="same config and inputs")


def reused(decision: Decision, upstream: dict[str, Any]) -> dict[str, Any]:
    """The recorded artifacts over ``upstream`` (``<stage>_run_id``: the run that made them)."""
    record = decision.record or {}
    out = {**upstream, **record.get("artifacts", {})}
    if "built_now" in out:
        out["built_now"] = False  # nothing was built in this run
    if record.get("run_id"):
        out[f"{decision.stage}_run_id"] = record["run_id"]
    return out


def _protected(cfg: SpeclineConfig) -> list[Path]:
    """Paths a stale output's clean-up never removes, nor any directory that holds one of them."""
    root = Path(cfg.run_dir)
    paths = [root, root / "logs", root / "mlflow.db", root / "mlartifacts", Path(cfg.target.cache_dir),
             Path(cfg.data.output_dir), Path(cfg.train.output_dir), Path(cfg.eval.output_dir),
             Path(cfg.eval.profile_dir), Path(cfg.serve.profile_dir)]
    return paths + [Path(p) for p in (cfg.train.data_dir, cfg.eval.drafter_path, cfg.serve.drafter_path) if p]


def begin(decision: Decision, cfg: SpeclineConfig) -> list[str]:
    """Before the stage runs: a stale output's entries removed, the unfinished record written.
    Returns the names removed."""
    where = decision.record_path.parent
    preexisting = (decision.record or {}).get("preexisting")
    if preexisting is None:  # first run here: whatever the directory holds is not ours
        preexisting = sorted(p.name for p in where.iterdir() if p.name != RECORD) if where.is_dir() else []
    removed: list[str] = []
    if decision.stale and where.is_dir():
        protected = _protected(cfg)
        for entry in sorted(where.iterdir()):
            if entry.name in preexisting or entry.name == RECORD or any(p.is_relative_to(entry) for p in protected):
                continue
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
            removed.append(entry.name)
    write_record(decision.record_path, {"stage": decision.stage, "key": decision.key, "inputs": decision.inputs,
                                        "complete": False, "preexisting": preexisting, "started": _now()})
    return removed


def complete(decision: Decision, upstream: dict[str, Any], out: dict[str, Any], run_id: str | None,
             seconds: float) -> dict[str, Any]:
    """After the stage returned ``out``: the complete record (its own artifacts), written atomically."""
    own = {k: v for k, v in out.items() if k not in upstream or upstream[k] != v}
    previous = read_record(decision.record_path) or {}
    record = {"stage": decision.stage, "key": decision.key, "inputs": decision.inputs, "complete": True,
              "preexisting": previous.get("preexisting", []), "started": previous.get("started"),
              "completed": _now(), "seconds": round(seconds, 3), "run_id": run_id,
              "artifacts": json.loads(json.dumps(own, default=str))}
    write_record(decision.record_path, record)
    return record


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


# ----------------------------------------------------------------------------- running a part
def needs(stage: str, cfg: SpeclineConfig) -> list[tuple[str, str, str]]:
    """(upstream stage, artifact key, config key that replaces it) that ``stage`` cannot run without."""
    if stage == "train" and cfg.data.mode == "shards" and not cfg.train.data_dir:
        return [("data", "data_dir", "train.data_dir")]
    if stage == "eval" and not cfg.eval.drafter_path:
        from components.evaluation.methods import METHODS, needs_drafter

        if needs_drafter(m for m in cfg.eval.methods if m in METHODS):
            return [("train", "drafter_path", "eval.drafter_path")]
    if stage == "serve" and cfg.serve.drafter in ("auto", "hybrid") and not (cfg.serve.drafter_path or cfg.serve.drafter_run_id):
        return [("train", "drafter_path", "serve.drafter_path")]
    return []


def recorded_upstream(stage: str, cfg: SpeclineConfig, artifacts: dict[str, Any], looked: dict[str, str]
                      ) -> tuple[dict[str, Any], list[Decision]]:
    """Before ``stage`` runs: the recorded outputs of the earlier stages that ``cfg.stages`` skips,
    taken where their key matches the current config. ``looked`` (stage → why not taken) carries
    over from stage to stage. A stage that cannot run without one is a ConfigError naming what to run."""
    taken: list[Decision] = []
    earlier = ORDER[:ORDER.index(stage)] if stage in ORDER else ()
    for prior in earlier:
        if prior in cfg.stages or prior in looked:
            continue
        decision = decide(prior, cfg, artifacts, forceable=False)
        if decision is not None and decision.reuse:
            artifacts = {**reused(decision, {}), **artifacts}  # what the caller passed comes first
            taken.append(decision)
            looked[prior] = ""
        else:
            where = output_dir(prior, cfg)
            looked[prior] = (decision.why if decision is not None and decision.why else
                             f"{where} has no record of a finished run" if where else "it writes nothing to reuse")
    for up, key, setting in needs(stage, cfg):
        if key not in artifacts:
            chain = [up]
            while any(looked.get(u) for u, _, s in needs(chain[0], cfg)):
                chain.insert(0, needs(chain[0], cfg)[0][0])
            todo = [*chain, *[s for s in cfg.stages if ORDER.index(s) >= ORDER.index(stage)]] if stage in ORDER else chain
            raise ConfigError(f"stages={list(cfg.stages)}: {stage} needs the {up} stage's {key}, and there is no "
                              f"finished {up} output for this config ({looked.get(up) or 'not run'}); run "
                              f"\"stages=[{','.join(todo)}]\" or set {setting}")
    return artifacts, taken
