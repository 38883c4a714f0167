"""The production config for Ray Serve LLM (``infra/serve-llm.yaml``) parses: one OpenAI app of
``build_openai_app``, its LLM config with the exported drafter as vLLM's speculative config;
checked against ``ray.serve.llm.LLMConfig`` where Ray Serve LLM (vLLM) is installed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from components.config import PROJECT_ROOT

CONFIG = PROJECT_ROOT / "infra" / "serve-llm.yaml"
VLLM_METHODS = {"dspark", "dflash", "eagle3", "mtp", "medusa", "eagle", "ngram", "draft_model"}


def _llm_configs() -> list[dict]:
    apps = yaml.safe_load(Path(CONFIG).read_text())["applications"]
    assert len(apps) == 1 and apps[0]["import_path"] == "ray.serve.llm:build_openai_app"
    return apps[0]["args"]["llm_configs"]


def test_serve_llm_config_names_the_drafter():
    (llm,) = _llm_configs()
    spec = llm["engine_kwargs"]["speculative_config"]
    assert spec["method"] in VLLM_METHODS and spec["model"] and spec["num_speculative_tokens"] >= 1
    assert llm["model_loading_config"]["model_id"] and llm["model_loading_config"]["model_source"]
    auto = llm["deployment_config"]["autoscaling_config"]
    assert 1 <= auto["min_replicas"] <= auto["max_replicas"]


def test_serve_llm_config_validates_where_ray_serve_llm_is_installed():
    try:
        from ray.serve.llm import LLMConfig
    except ImportError as err:
        pytest.skip(f"Ray Serve LLM not installed here: {err}")
    (llm,) = _llm_configs()
    assert LLMConfig(**llm).engine_kwargs["speculative_config"]["method"] == llm["engine_kwargs"][
        "speculative_config"]["method"]
