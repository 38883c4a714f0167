"""The drafter presets beside conf/dspark.yaml: each loads against the schema as the same pipeline
with its own drafter, and one of each kind runs data → train → eval on the tiny fixture (one data
stage shared: the presets' rollouts differ only in the layers a drafter reads, set alike here)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from components.config import CONF_DIR, SpeclineConfig
from components.confload import load
from components.drafters.registry import DRAFTERS
from components.tracking import Tracker
from pipelines import full

PRESETS = ["dflash", "dflash2", "domino", "d_loop", "dedit", "hspec", "eagle3", "peagle", "medusa", "mtp"]
# Run end to end: one of each kind of drafter the pipeline treats differently (a block drafter, one
# that drafts in several passes, an autoregressive one with its own layer ids, heads, MTP); the
# others' training and engine paths run in tests/components/drafters and tests/components/engine.
RUN = ["dflash", "dedit", "eagle3", "medusa", "mtp"]

# test_full's SMALL, with one Ray Train worker and the tiny target's layers 1 and 3 for every drafter
TINY = ["data.max_prompts=10", "data.max_new_tokens=12", "data.batch_size=5", "data.shard_size=5",
        "data.num_actors=1", "data.cpus_per_actor=0.5", "drafter.layer_ids=[1,3]", "drafter.block_size=4",
        "drafter.num_anchors=16", "drafter.draft_vocab_size=128", "train.num_workers=1",
        "train.cpus_per_worker=0.5", "train.batch_size=2", "train.max_steps=2", "train.warmup_steps=1",
        "train.log_every=1", "train.checkpoint_every=2", "train.eval_fraction=0.2", "train.max_failures=0",
        "eval.num_prompts=1", "eval.max_new_tokens=10", "eval.threads=1", "eval.prompt_sets=[humaneval]",
        "eval.methods=[target_only,drafter,hybrid]"]  # hybrid: suffix decoding around each drafter


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_is_the_default_pipeline_with_its_own_drafter(name: str):
    cfg, dspark = load(f"{name}.yaml"), load("dspark.yaml")
    assert (CONF_DIR / f"{name}.yaml").is_file() and name in DRAFTERS
    assert cfg.drafter.name == name
    assert cfg.stages == dspark.stages
    for section in ("target", "data", "eval", "serve", "ray", "tracking"):
        assert getattr(cfg, section) == getattr(dspark, section), section
    if not cfg.drafter.enable_confidence_head:
        assert cfg.train.loss != dspark.train.loss  # DSpark's loss mix needs its confidence head
    assert f"conf={name}.yaml" in (CONF_DIR / f"{name}.yaml").read_text()


def _run(name: str, tmp: Path, target: Any, *extra: str) -> dict[str, Any]:
    cfg: SpeclineConfig = load(f"{name}.yaml", [*TINY, f"run_dir={tmp}", f"eval.profile_dir={tmp / 'profiles'}",
                                                *extra])
    cfg = dataclasses.replace(cfg, target=target)
    tracker = Tracker(cfg)
    with tracker.run("pipeline"):
        return full.run(cfg, tracker, {})


@pytest.fixture(scope="module")
def preset_data(tmp_path_factory, tiny_target_cfg, tiny_target_build, ray_session) -> str:
    out = _run(PRESETS[0], tmp_path_factory.mktemp("preset-data"), tiny_target_cfg, "stages=[data]")
    assert out["num_records"] == 10
    return out["data_dir"]


@pytest.mark.slow
@pytest.mark.parametrize("name", RUN)
def test_each_preset_trains_and_evaluates_on_the_tiny_target(name: str, tmp_path: Path, tiny_target_cfg,
                                                            preset_data: str):
    out = _run(name, tmp_path, tiny_target_cfg, "stages=[train,eval]", f"train.data_dir={preset_data}")
    assert out["train_steps"] == 2 and Path(out["drafter_path"], "config.json").is_file()
    assert set(out["eval_tau"]) == {"target_only", "drafter", "hybrid"}
    assert out["eval_lossless_failures"] == [] and out["eval_tau"]["drafter"] >= 1.0


def test_the_long_preset_is_the_default_run_with_more_rollouts_steps_and_questions():
    long, dspark = load("presets/long.yaml"), load("dspark.yaml")
    assert long.data.max_prompts > 4 * dspark.data.max_prompts and long.train.max_steps > 4 * dspark.train.max_steps
    assert dataclasses.replace(long.data, max_prompts=dspark.data.max_prompts) == dspark.data
    assert dataclasses.replace(long.train, max_steps=dspark.train.max_steps,
                               checkpoint_every=dspark.train.checkpoint_every) == dspark.train
    assert long.target.prompts.questions > 4 * dspark.target.prompts.questions
    assert dataclasses.replace(long.target.prompts, questions=dspark.target.prompts.questions) == dspark.target.prompts
    assert dataclasses.replace(long.target, prompts=dspark.target.prompts) == dspark.target
    assert long.eval.chat_bank_prefix == dspark.target.prompts.questions  # evaluated on the default's questions
    for section in ("drafter", "eval", "serve", "ray", "tracking"):
        assert getattr(long, section) == getattr(dspark, section), section
