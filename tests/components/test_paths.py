"""Config paths are absolute from the moment a config exists (components/paths.py), in the driver
and in every Ray task or actor it is sent to."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from components.config import DataConfig, SpeclineConfig, TargetConfig
from components.confload import load
from components.paths import MODEL, PATH, SOURCE, URI, absolute, path_fields, unresolved

RELATIVE = ["run_dir=out/runs", "target.name_or_path=./models/t", "target.cache_dir=cache",
            "data.prompt_source=prompts.jsonl", "train.data_dir=shards", "eval.drafter_path=d",
            "eval.prompt_source=hf:./local-ds:test", "eval.vllm_python=venv/bin/python",
            "serve.drafter_path=../drafter", "serve.profile_dir=~/profiles",
            "tracking.tracking_uri=sqlite:///ml.db"]


@pytest.fixture
def fresh_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    where = tmp_path / "clone"
    where.mkdir()
    monkeypatch.chdir(where)
    return where


def test_load_makes_every_config_path_absolute_against_the_start_directory(fresh_dir: Path):
    cfg = load("dspark.yaml", RELATIVE)
    assert unresolved(cfg) == []
    assert cfg.run_dir == str(fresh_dir / "out" / "runs")
    assert cfg.data.output_dir == str(fresh_dir / "out" / "runs" / "data")  # ${run_dir} after the override
    assert cfg.train.output_dir == str(fresh_dir / "out" / "runs" / "train")
    assert cfg.target.name_or_path == str(fresh_dir / "models" / "t")
    assert cfg.target.cache_dir == str(fresh_dir / "cache")
    assert cfg.train.data_dir == str(fresh_dir / "shards")
    assert cfg.eval.prompt_source == f"hf:{fresh_dir / 'local-ds'}:test"
    assert cfg.serve.drafter_path == str(fresh_dir.parent / "drafter")
    assert cfg.serve.profile_dir == str(Path.home() / "profiles")
    assert cfg.tracking.tracking_uri == f"sqlite:///{fresh_dir / 'ml.db'}"


def test_names_stay_names():
    assert load(None, ["target.name_or_path=HuggingFaceTB/SmolLM2-135M"]).target.name_or_path == \
        "HuggingFaceTB/SmolLM2-135M"  # a hub id (no such directory here)
    cfg = load()
    assert (cfg.target.name_or_path, cfg.data.prompt_source, cfg.eval.assistant) == ("embedded", "embedded", "auto")
    assert absolute("hf:openai_humaneval:test", SOURCE) == "hf:openai_humaneval:test"
    assert absolute("https://mlflow.example:5000", URI) == "https://mlflow.example:5000"
    assert absolute("file:./mlruns", URI, Path("/base")) == "file:///base/mlruns"
    assert absolute("sqlite:////abs/m.db", URI) == "sqlite:////abs/m.db"
    assert absolute("tiny", MODEL) == "tiny" and absolute(None, PATH) is None


def test_making_absolute_twice_changes_nothing(fresh_dir: Path):
    cfg = load(None, RELATIVE)
    again = dataclasses.replace(cfg)
    assert again == cfg
    os.chdir(fresh_dir.parent)  # a copy made elsewhere (e.g. in a worker) keeps the driver's paths
    assert dataclasses.replace(cfg, seed=1).run_dir == cfg.run_dir


def test_configs_built_in_code_are_absolute_and_shared_sections_untouched(fresh_dir: Path):
    shared = DataConfig(max_prompts=3)
    first = SpeclineConfig(run_dir="a", data=shared)
    second = SpeclineConfig(run_dir="b", data=shared)
    assert unresolved(first) == [] and unresolved(second) == []
    assert first.data.output_dir == str(fresh_dir / "a" / "data")
    assert second.data.output_dir == str(fresh_dir / "b" / "data")
    assert shared.output_dir == "${run_dir}/data"  # the shared section was copied, not changed
    assert TargetConfig(name_or_path="../m").name_or_path == str(fresh_dir.parent / "m")


def test_every_path_field_is_declared():
    """A field whose name says it holds a path is declared as one (so it is made absolute)."""
    missed = []
    for section in SpeclineConfig().__dict__.values():
        if dataclasses.is_dataclass(section):
            declared = path_fields(section)
            missed += [f"{type(section).__name__}.{f.name}" for f in dataclasses.fields(section)
                       if f.name.endswith(("_dir", "_path", "_source", "_uri", "_python")) and f.name not in declared]
    assert missed == []


def test_a_ray_task_and_actor_see_absolute_paths_only(fresh_dir: Path, ray_session):
    import ray

    cfg = load("dspark.yaml", RELATIVE)

    @ray.remote(num_cpus=0.1)
    def seen_by_task(c: SpeclineConfig) -> tuple[str, list[str]]:
        return os.getcwd(), unresolved(c)

    @ray.remote(num_cpus=0.1)
    class Holder:
        def __init__(self, c: SpeclineConfig):
            self.cfg = c

        def seen(self) -> tuple[str, list[str], str]:
            return os.getcwd(), unresolved(self.cfg), self.cfg.train.output_dir

    cwd, bad = ray.get(seen_by_task.remote(cfg))
    assert bad == []
    actor = Holder.remote(cfg)
    cwd_actor, bad_actor, out = ray.get(actor.seen.remote())
    ray.kill(actor)
    assert bad_actor == [] and out == str(fresh_dir / "out" / "runs" / "train")
    assert str(fresh_dir) not in (cwd, cwd_actor)  # the workers run elsewhere: a relative path would miss
