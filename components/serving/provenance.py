"""Which drafter the serve stage serves, and where its checkpoint is.

``serve.drafter=model`` is the trained drafter, in order: ``serve.drafter_path`` (a checkpoint
directory); ``serve.drafter_run_id`` (the ``train/drafter`` artifact of that MLflow run,
downloaded once into ``<run_dir>/serve/drafters/<run id>``); the train stage's drafter
(``upstream["drafter_path"]`` and its run id). Nothing set is a ``ConfigError`` that says which
key to set. ``suffix`` is suffix decoding, with no checkpoint; ``hybrid`` suffix decoding beside
the trained drafter found as for ``model``; ``none`` the target alone.

``auto`` (the default) serves what this pipeline's eval stage measured fastest among the forms a
replica can serve, each as a replica serves it (``SERVED_BY_EVAL``: the batch engine under the
adaptive cap, or the fixed-γ methods with ``serve.adaptive=false``), plain decoding counting as
1.0×: no figure found not lossless (a sampled eval checks none: its rules are exact in
distribution), and the trained drafter's only if the eval ran the drafter that
would be served (``measured_pick``). Without such figures, or when ``serve.drafter_path`` or
``serve.drafter_run_id`` names a checkpoint, ``auto`` is ``model``. The eval times batch 1, one
request at a time; a replica under load may rank the forms otherwise (docs/results.md).
The checkpoint itself is loaded (safetensors only, target and tokenizer checked) by
``components.drafters.load_drafter`` inside each replica.

Knows the config, the upstream keys of the train and eval stages and MLflow's artifact download;
nothing about models or HTTP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from components.config import ConfigError, SpeclineConfig, run_dir

DRAFTER_ARTIFACT = "train/drafter"  # where the train stage logs its final drafter


@dataclass(frozen=True)
class DrafterSource:
    """The served drafter: its checkpoint directory (None: no drafter) and where it came from."""

    path: str | None
    origin: str  # "none" | "serve.drafter_path" | "serve.drafter_run_id" | "train stage" | "serve.drafter"
    run_id: str | None = None  # the MLflow run that wrote it, when known
    version: int | None = None  # its registered model version, when known
    method: str = "model"  # "model" (the checkpoint) | "suffix" (no checkpoint) | "hybrid" (both)
    why: str = ""  # for serve.drafter=auto: the eval's figures that picked it

    @property
    def speculates(self) -> bool:
        """Whether a drafter is served at all."""
        return self.path is not None or self.method == "suffix"

    @property
    def label(self) -> str:
        """A short public name: the run id, else the checkpoint directory's name (``suffix``,
        ``hybrid+<name>`` for suffix decoding alone and beside it)."""
        if self.method == "suffix":
            return "suffix"
        if self.path is None:
            return "none"
        name = self.run_id or Path(self.path).name
        return f"hybrid+{name}" if self.method == "hybrid" else name


# A served form → the eval methods that time it as a replica serves it: (adaptive cap, fixed γ)
SERVED_BY_EVAL: dict[str, tuple[str, str]] = {"suffix": ("suffix_adaptive", "suffix"),
                                              "model": ("drafter_adaptive", "drafter"),
                                              "hybrid": ("hybrid_adaptive", "hybrid")}


@dataclass(frozen=True)
class Pick:
    """What ``serve.drafter=auto`` serves, and the figures that decided it."""

    method: str  # "none" | "suffix" | "model" | "hybrid"
    speedups: dict[str, float]  # eval method → speedup over plain decoding, those that were candidates
    skipped: dict[str, str]  # eval method → why it was not a candidate (not lossless, another drafter)

    @property
    def why(self) -> str:
        ranked = sorted(self.speedups.items(), key=lambda kv: -kv[1])
        text = ", ".join(f"{m} {v:.2f}×" for m, v in ranked)
        head = ("no served form beat plain decoding" if self.method == "none"
                else f"the fastest in the eval stage: {ranked[0][0]}")
        skipped = "".join(f"; {m} left out: {why}" for m, why in self.skipped.items())
        return f"{head} ({text or 'nothing measured'} of plain decoding, batch 1{skipped})"


def measured_pick(cfg: SpeclineConfig, upstream: dict[str, Any]) -> Pick | None:
    """The served form the eval stage's figures upstream (``eval_speedup``, ``eval_lossless``)
    rank first, plain decoding counting as 1.0× (ties go to the simpler form: none, suffix,
    model, hybrid); None when the eval timed none of ``SERVED_BY_EVAL``'s methods."""
    speedups, lossless = upstream.get("eval_speedup") or {}, upstream.get("eval_lossless") or {}
    column = 0 if cfg.serve.adaptive else 1
    evaluated = upstream.get("eval_drafter_path", upstream.get("drafter_path"))
    best, best_speedup, seen, skipped = "none", 1.0, {}, {}
    for form, names in SERVED_BY_EVAL.items():
        name = names[column]
        if speedups.get(name) is None:
            continue
        if lossless.get(name) is False:  # None: not checked (sampled rules, exact in distribution)
            skipped[name] = "not lossless"
        elif form != "suffix" and evaluated != upstream.get("drafter_path"):
            skipped[name] = "the eval ran another drafter (eval.drafter_path)"
        else:
            seen[name] = float(speedups[name])
            if seen[name] > best_speedup:
                best, best_speedup = form, seen[name]
    if not seen and not skipped:
        return None
    return Pick(best, seen, skipped)


def resolve_drafter(cfg: SpeclineConfig, upstream: dict[str, Any], tracking_uri: str | None) -> DrafterSource:
    sc = cfg.serve
    method, why = sc.drafter, ""
    if method == "auto":
        pick = None if sc.drafter_path or sc.drafter_run_id else measured_pick(cfg, upstream)
        method, why = (pick.method, pick.why) if pick is not None else ("model", "")
    if method == "none":
        return DrafterSource(None, "serve.drafter=auto" if why else "none", why=why)
    if method == "suffix":
        return DrafterSource(None, "serve.drafter=auto" if why else "serve.drafter", method="suffix", why=why)
    trained = _trained(cfg, upstream, tracking_uri)
    return replace(trained, method="hybrid" if method == "hybrid" else "model", why=why)


def _trained(cfg: SpeclineConfig, upstream: dict[str, Any], tracking_uri: str | None) -> DrafterSource:
    """The trained drafter's checkpoint: drafter_path, drafter_run_id, the train stage's."""
    sc = cfg.serve
    if sc.drafter_path:
        return DrafterSource(_checked(sc.drafter_path, "serve.drafter_path"), "serve.drafter_path")
    if sc.drafter_run_id:
        return DrafterSource(_download(cfg, sc.drafter_run_id, tracking_uri), "serve.drafter_run_id",
                             sc.drafter_run_id)
    if upstream.get("drafter_path"):
        return DrafterSource(_checked(upstream["drafter_path"], "the train stage's drafter_path"), "train stage",
                             upstream.get("train_run_id"), upstream.get("registered_version"))
    raise ConfigError("serve.drafter: no drafter to serve; set serve.drafter_path=<checkpoint dir>, "
                      "serve.drafter_run_id=<MLflow run of a train stage>, run the train stage first, "
                      "serve.drafter=suffix for suffix decoding, or serve.drafter=none to serve the target alone")


def _checked(path: str, key: str) -> str:
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"{key}: '{path}' is not a drafter checkpoint directory (no config.json)")
    return path


def _download(cfg: SpeclineConfig, run_id: str, tracking_uri: str | None) -> str:
    import mlflow
    from mlflow.exceptions import MlflowException

    dest = run_dir(cfg) / "serve" / "drafters" / run_id
    if (dest / DRAFTER_ARTIFACT / "config.json").is_file():  # fetched before
        return str(dest / DRAFTER_ARTIFACT)
    dest.mkdir(parents=True, exist_ok=True)
    try:
        got = mlflow.artifacts.download_artifacts(run_id=run_id, artifact_path=DRAFTER_ARTIFACT,
                                                  dst_path=str(dest), tracking_uri=tracking_uri)
    except (MlflowException, OSError) as err:
        raise ConfigError(f"serve.drafter_run_id: cannot fetch '{DRAFTER_ARTIFACT}' of MLflow run {run_id}: "
                          f"{str(err).splitlines()[0]}") from None
    return _checked(got, "serve.drafter_run_id")
