"""The `ray up` cluster (``infra/ray-up/cluster.yaml``): filled out with the provider's defaults
and validated as `ray up` does it (Ray's autoscaler: prepare_config, then validate_config against
ray-schema.json and its own rules), without a cloud account; and sized, like the KubeRay cluster,
for the GPU preset, running the CUDA image with the metrics port Prometheus scrapes."""

from __future__ import annotations

import copy

import pytest
import yaml

from components.confload import load
from tests.infra.manifests import INFRA, one

CLUSTER = INFRA / "ray-up" / "cluster.yaml"


def _validated(config: dict) -> dict:
    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError as err:  # Ray moved its private autoscaler helpers
        pytest.skip(f"Ray's autoscaler config validation is not importable: {err}")
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


def test_ray_validates_the_cluster_config(raw):
    prepared = _validated(raw)
    assert prepared["provider"]["type"] == "aws" and prepared["head_node_type"] == "head"


@pytest.mark.parametrize("mistake", ["a misspelled key", "too few max_workers", "unknown head type"])
def test_ray_refuses_a_broken_config(raw, mistake):
    import jsonschema

    broken = copy.deepcopy(raw)
    if mistake == "a misspelled key":
        broken["available_node_types"]["gpu"]["min_worker"] = broken["available_node_types"]["gpu"].pop("min_workers")
    elif mistake == "too few max_workers":
        broken["max_workers"] = broken["available_node_types"]["gpu"]["min_workers"] - 1
    else:
        broken["head_node_type"] = "cpu-head"
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        _validated(broken)


def test_the_cluster_holds_the_gpu_preset_and_runs_the_cuda_image(raw):
    cfg = load("qwen3-8b-dspark.yaml")
    gpu = raw["available_node_types"]["gpu"]
    per_node, nodes = gpu["resources"]["GPU"], gpu["min_workers"]
    assert raw["available_node_types"]["head"]["resources"] == {"CPU": 0}
    train_driver = one("RayJob", "specline-train")["spec"]["entrypointNumGpus"]  # the same driver needs here
    assert cfg.train.num_workers + train_driver <= per_node * nodes and cfg.train.num_workers > per_node
    assert cfg.data.num_actors * cfg.data.gpus_per_actor <= per_node * nodes
    assert per_node * max(cfg.train.cpus_per_worker, cfg.data.cpus_per_actor) <= gpu["resources"]["CPU"]
    assert raw["docker"]["image"].endswith("/specline:cuda") and (INFRA / "docker" / "Dockerfile.cuda").is_file()
    assert "--gpus all" in raw["docker"]["worker_run_options"]
    assert any(o.endswith(":/mnt/specline") for o in raw["docker"]["run_options"])  # run_dir on the shared FS
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "--metrics-export-port=8080" in raw[key][-1]
    cluster = one("RayCluster")["spec"]
    assert {cluster["headGroupSpec"]["rayStartParams"]["metrics-export-port"]} == {"8080"}
