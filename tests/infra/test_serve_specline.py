"""specline's own app as a Ray Serve config (``infra/serve-specline.yaml``): valid for Ray
Serve's deploy schema, on specline's serve port and route, and its import path builds the app
from a conf and overrides (here on the tiny fixture target, without deploying it)."""

from __future__ import annotations

import importlib

import pytest
import yaml

from components.config import ConfigError, ServeConfig
from tests.infra.manifests import INFRA


def _config() -> dict:
    return yaml.safe_load((INFRA / "serve-specline.yaml").read_text())


def test_the_serve_config_is_valid_for_ray_serve_on_specline_s_port_and_route():
    from ray.serve.schema import ServeDeploySchema

    config = _config()
    parsed = ServeDeploySchema(**config)
    assert parsed.http_options.port == ServeConfig().port and [a.route_prefix for a in parsed.applications] == ["/"]
    module, name = config["applications"][0]["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), name))


def test_the_import_path_builds_the_app_from_a_conf_and_overrides(tiny_target_build, tmp_path):
    from ray.serve import Application

    args = _config()["applications"][0]["args"]
    module, name = _config()["applications"][0]["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    overrides = [*args["overrides"], f"target.name_or_path={tiny_target_build[0]}", f"run_dir={tmp_path}"]
    app = builder({"conf": args["conf"], "overrides": overrides})
    assert isinstance(app, Application)
    with pytest.raises(ConfigError, match="unknown key"):
        builder({"conf": "dspark.yaml", "overrides": ["serve.drafterr=suffix"]})
    with pytest.raises(ConfigError, match="unknown"):
        builder({"config": "dspark.yaml"})
