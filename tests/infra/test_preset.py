"""The production preset (``conf/qwen3-8b-dspark.yaml``) loads and resolves against the schema
(components/config.py, through components.confload.load: unknown keys and wrong types fail),
passes the checks each stage makes of its section before it runs, names a target the stages
take as a hub id without reading it here, and agrees with the serving and tracking manifests
(Ray Serve LLM's vLLM method and γ, the MLflow Service). Nothing is run or downloaded."""

from __future__ import annotations

import pytest
import yaml

from components.config import PROJECT_ROOT, ConfigError
from components.confload import load
from tests.infra.manifests import INFRA, one

PRESET = PROJECT_ROOT / "conf" / "qwen3-8b-dspark.yaml"


@pytest.fixture(scope="module")
def cfg():
    return load("qwen3-8b-dspark.yaml")


def test_every_key_of_the_preset_is_one_of_the_schema(tmp_path):
    load(PRESET)  # a key the schema lacks is a ConfigError naming it
    raw = yaml.safe_load(PRESET.read_text())
    raw["train"]["fsdp_nodes"] = 2  # ... as here, so the check above is a real one
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="train.fsdp_nodes"):
        load(bad)


def test_the_preset_resolves_for_gpus(cfg):
    assert cfg.target.name_or_path == "Qwen/Qwen3-8B" and cfg.target.dtype == "bfloat16"
    assert cfg.data.backend == "vllm" and cfg.data.gpus_per_actor == 1
    assert cfg.train.use_gpu and cfg.train.strategy == "fsdp" and cfg.train.num_workers > 1
    assert cfg.serve.gpus_per_replica == 1 and cfg.serve.host == "0.0.0.0"
    assert cfg.ray.address == "auto"
    # every path absolute and on the shared volume, ${run_dir} filled in
    for path in (cfg.run_dir, cfg.data.output_dir, cfg.train.output_dir, cfg.eval.output_dir, cfg.target.cache_dir):
        assert path.startswith("/mnt/specline/") and "${" not in path
    assert cfg.data.output_dir == cfg.run_dir + "/data"


def test_the_stages_own_checks_pass(cfg):
    """What each stage checks of its section before it runs, run here on the preset."""
    import components.drafters  # registers every drafter
    import components.training.objectives  # noqa: F401  (registers every objective)
    from components.data.source import check_data_config
    from components.drafters.registry import DRAFTERS
    from components.evaluation.methods import check_methods
    from components.evaluation.prompts import check_prompt_sets
    from components.losses.registry import LOSSES
    from components.training.objectives.base import OBJECTIVES
    from components.training.sharding import check_strategy

    check_data_config(cfg.data)
    check_strategy(cfg.train.strategy)
    assert check_methods(cfg.eval)[0] == "target_only"
    assert check_prompt_sets(cfg.eval) == ["humaneval", "humaneval_chat"]
    assert cfg.drafter.name in DRAFTERS and cfg.train.loss in LOSSES
    assert set(cfg.train.objectives) <= set(OBJECTIVES)


def test_the_target_is_taken_as_a_hub_id_without_reading_it(cfg):
    from components.target.hf import resolve_target_path

    assert resolve_target_path(cfg.target, progress=False) == "Qwen/Qwen3-8B"


def test_serving_manifests_serve_what_the_preset_trains(cfg):
    from components.export.vllm import VLLM_METHODS

    (llm,) = yaml.safe_load((INFRA / "serve-llm.yaml").read_text())["applications"][0]["args"]["llm_configs"]
    spec = llm["engine_kwargs"]["speculative_config"]
    assert spec["method"] == VLLM_METHODS[cfg.drafter.name]
    # DSpark drafts a whole block (sample_from_anchor by default): γ = block_size
    assert cfg.drafter.sample_from_anchor in (None, True) and spec["num_speculative_tokens"] == cfg.drafter.block_size
    assert llm["model_loading_config"]["model_source"] == cfg.target.name_or_path
    assert llm["model_loading_config"]["model_id"] == cfg.serve.model_name
    assert llm["engine_kwargs"]["dtype"] == cfg.target.dtype
    assert spec["model"].startswith("/mnt/specline/")


def test_tracking_points_at_the_mlflow_service(cfg):
    svc = one("Service", "mlflow")
    host = f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local"
    assert cfg.tracking.tracking_uri == f"http://{host}:{svc['spec']['ports'][0]['port']}"
    args = one("Deployment", "mlflow")["spec"]["template"]["spec"]["containers"][0]["args"]
    allowed = next(a.split("=", 1)[1] for a in args if a.startswith("--allowed-hosts=")).split(",")
    assert f"{host}:{svc['spec']['ports'][0]['port']}" in allowed  # the server answers that Host header
