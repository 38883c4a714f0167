"""The KubeRay manifests (``infra/kuberay/``) and the MLflow deployment (``infra/mlflow/``):
core Kubernetes objects and every pod template valid for kubernetes-validate (strict, offline);
the KubeRay resources valid against a schema of the fields they use; and the cross-checks: the
images are built by a Dockerfile of infra/docker whose Ray version is the manifests' rayVersion,
every RayJob entrypoint is a specline module with a main run on a conf of conf/ whose overrides
load, the jobs run on the RayCluster of this folder, the RayService serves infra/serve-llm.yaml
(valid for Ray Serve's own deploy schema) on specline's serve port and route, volumes and ports named where they are used exist, and the
GPU preset fits the GPUs and CPUs the pods request."""

from __future__ import annotations

import ast
import copy
import re
import shlex

import pytest
import yaml

from components.config import PROJECT_ROOT, ServeConfig
from components.confload import load, load_cli
from tests.infra.manifests import (
    INFRA,
    KUBERAY_KINDS,
    as_pod_template,
    cluster_spec,
    containers,
    cpus,
    docs,
    gpus,
    groups,
    k8s_validate,
    kube_objects,
    kuberay_errors,
    one,
    pod_templates,
)

PRESET = "qwen3-8b-dspark.yaml"
OBJECTS = kube_objects()
CORE = [(f, o) for f, o in OBJECTS if o["kind"] not in KUBERAY_KINDS]
RAY = [(f, o) for f, o in OBJECTS if o["kind"] in KUBERAY_KINDS]


def _id(item: tuple[str, dict]) -> str:
    return f"{item[0]}:{item[1]['kind']}/{item[1]['metadata']['name']}"


def test_the_manifests_hold_what_the_issue_asks_for():
    kinds = sorted(o["kind"] for _, o in OBJECTS)
    assert {"RayCluster", "RayJob", "RayService", "PersistentVolumeClaim", "Deployment", "Service",
            "StatefulSet", "Namespace"} <= set(kinds)
    assert sorted(o["metadata"]["name"] for _, o in RAY if o["kind"] == "RayJob") == ["specline-data", "specline-train"]


@pytest.mark.parametrize("item", CORE, ids=_id)
def test_core_objects_are_valid_kubernetes(item):
    k8s_validate(item[1])


@pytest.mark.parametrize("item", [(f, o) for f, o in OBJECTS if pod_templates(o)], ids=_id)
def test_every_pod_template_is_valid_kubernetes(item):
    for where, template in pod_templates(item[1]):
        k8s_validate(as_pod_template(template, where.lower().replace(" ", "-")))


@pytest.mark.parametrize("item", RAY, ids=_id)
def test_kuberay_resources_match_the_schema(item):
    assert kuberay_errors(item[1]) == []


def test_the_checks_catch_mistakes():
    """A misspelled KubeRay field, a number where KubeRay wants a string, a bad pod field."""
    import kubernetes_validate

    job = copy.deepcopy(one("RayJob", "specline-train"))
    job["spec"]["entrypointNumGPUs"] = job["spec"].pop("entrypointNumGpus")
    assert any("entrypointNumGPUs" in e for e in kuberay_errors(job))
    cluster = copy.deepcopy(one("RayCluster"))
    cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0
    assert kuberay_errors(cluster)
    template = copy.deepcopy(cluster["spec"]["headGroupSpec"]["template"])
    template["spec"]["containers"][0]["resource"] = template["spec"]["containers"][0].pop("resources")
    with pytest.raises(kubernetes_validate.ValidationError):
        k8s_validate(as_pod_template(template, "bad"))


def _dockerfile_args(name: str) -> dict[str, str]:
    text = (INFRA / "docker" / name).read_text()
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))


def test_images_are_built_here_at_the_manifests_ray_version():
    for file, obj in OBJECTS:
        for c in containers(obj):
            image = c["image"]
            if "specline" not in image.rsplit("/", 1)[-1]:
                continue  # third-party images (postgres)
            repo, tag = image.rsplit("/", 1)[-1].split(":")
            dockerfile = INFRA / ("mlflow/Dockerfile" if repo == "specline-mlflow" else f"docker/Dockerfile.{tag}")
            assert dockerfile.is_file(), f"{file}: {image} is built by no Dockerfile ({dockerfile.name})"
    ray_versions = {cluster_spec(o)["rayVersion"] for _, o in RAY if o["kind"] != "RayJob"}
    assert ray_versions == {_dockerfile_args("Dockerfile.cuda")["RAY_VERSION"]} == {
        _dockerfile_args("Dockerfile.cpu")["RAY_VERSION"]}


def _entrypoint(job: dict) -> list[str]:
    return shlex.split(job["spec"]["entrypoint"])


@pytest.mark.parametrize("name", ["specline-data", "specline-train"])
def test_job_entrypoints_are_specline_modules_on_a_conf_that_loads(name):
    argv = _entrypoint(one("RayJob", name))
    assert argv[:2] == ["python", "-m"]
    module = PROJECT_ROOT.joinpath(*argv[2].split(".")).with_suffix(".py")
    assert argv[2].startswith("pipelines.") and module.is_file(), argv[2]
    assert "__main__" in {getattr(n.test.comparators[0], "value", None) for n in ast.walk(ast.parse(module.read_text()))
                          if isinstance(n, ast.If) and isinstance(n.test, ast.Compare)}, f"{module} has no main"
    conf = next(a.split("=", 1)[1] for a in argv[3:] if a.startswith("conf="))
    assert (PROJECT_ROOT / "conf" / conf).is_file()
    cfg = load_cli(argv[3:])  # the overrides are keys of the schema, of the right types
    assert cfg.ray.address == "auto" and cfg.run_dir.startswith("/mnt/specline/")


def test_the_train_job_reads_what_the_data_job_writes():
    data_cfg = load_cli(_entrypoint(one("RayJob", "specline-data"))[3:])
    train_cfg = load_cli(_entrypoint(one("RayJob", "specline-train"))[3:])
    assert train_cfg.train.data_dir == data_cfg.data.output_dir


def test_jobs_run_on_the_raycluster_and_every_pod_mounts_the_shared_volume():
    cluster = one("RayCluster")
    for _, job in RAY:
        if job["kind"] == "RayJob":
            assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
            assert job["metadata"]["namespace"] == cluster["metadata"]["namespace"]
    claims = {o["metadata"]["name"] for _, o in OBJECTS if o["kind"] == "PersistentVolumeClaim"}
    cfg = load(PRESET)
    for _, obj in RAY:
        for where, template in pod_templates(obj):
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            for c in template["spec"]["containers"]:
                for path in (cfg.run_dir, cfg.target.cache_dir):  # on a claimed volume in every pod
                    (mount,) = [m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"] + "/")]
                    claim = volumes[mount["name"]].get("persistentVolumeClaim", {}).get("claimName")
                    assert claim in claims, f"{where}: {path} is not on a claimed volume"


def _ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


def test_ports_agree_with_the_serve_config_and_each_other():
    serve_llm = yaml.safe_load((INFRA / "serve-llm.yaml").read_text())
    default_port, preset_port = ServeConfig().port, load(PRESET).serve.port
    assert serve_llm["http_options"]["port"] == default_port == preset_port
    for _, obj in RAY:
        if obj["kind"] == "RayJob":
            continue
        for name, group in groups(cluster_spec(obj)):
            (c,) = group["template"]["spec"]["containers"]
            ports = _ports(c)
            assert ports["metrics"] == int(group["rayStartParams"]["metrics-export-port"])
            if name == "head":
                assert ports["serve"] == default_port and ports["dashboard"] == 8265 and ports["gcs-server"] == 6379
    # specline's own app is mounted at "/" (pipelines/serve.py), as the RayService's app
    assert 'route_prefix="/"' in (PROJECT_ROOT / "pipelines" / "serve.py").read_text()
    assert {a["route_prefix"] for a in serve_llm["applications"]} == {"/"}
    for _, svc in CORE:
        if svc["kind"] == "Service":  # a targetPort by name names a port of the pods it selects
            pods = [o for _, o in OBJECTS if o["kind"] in ("Deployment", "StatefulSet")
                    and o["spec"]["selector"]["matchLabels"].items() <= svc["spec"]["selector"].items()]
            assert pods, f"Service {svc['metadata']['name']} selects no pods"
            names = {n for o in pods for c in containers(o) for n in _ports(c)}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


def test_the_rayservice_embeds_serve_llm_yaml_as_ray_serve_reads_it():
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load(one("RayService")["spec"]["serveConfigV2"])
    assert config == yaml.safe_load((INFRA / "serve-llm.yaml").read_text())
    parsed = ServeDeploySchema(**config)  # what `serve deploy` and KubeRay's serveConfigV2 go through
    assert parsed.http_options.port == ServeConfig().port and parsed.applications[0].route_prefix == "/"
    with pytest.raises(ValueError):
        ServeDeploySchema(**{**config, "http_options": {"port": "eight thousand"}})


def test_the_gpu_preset_fits_the_cluster():
    cfg = load(PRESET)
    spec = one("RayCluster")["spec"]
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0" and gpus(head) == 0
    workers = [(g, g["template"]["spec"]["containers"][0]) for g in spec["workerGroupSpecs"]]
    total_gpus = sum(g["replicas"] * gpus(c) for g, c in workers)
    per_pod_gpus = max(gpus(c) for _, c in workers)
    per_pod_cpus = max(cpus(c) for _, c in workers)
    driver = {one("RayJob", n)["spec"]["entrypoint"].split()[2]: one("RayJob", n)["spec"].get("entrypointNumGpus", 0)
              for n in ("specline-data", "specline-train")}
    d, t = cfg.data, cfg.train
    assert d.num_actors * d.gpus_per_actor + driver["pipelines.data"] <= total_gpus
    assert t.use_gpu and t.num_workers + driver["pipelines.train"] <= total_gpus
    assert t.strategy == "fsdp" and t.num_workers > per_pod_gpus  # FSDP over several GPU nodes
    # a pod's GPUs can all be busy at once: the CPUs its actors/workers ask for fit beside them
    assert per_pod_gpus * max(d.cpus_per_actor, t.cpus_per_worker) <= per_pod_cpus
    assert d.gpus_per_actor <= per_pod_gpus and 1 <= per_pod_gpus
    # serving: the RayService's GPU pods hold the autoscaler's replicas (serve-llm.yaml) and the preset's
    (llm,) = yaml.safe_load(one("RayService")["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"]
    svc_workers = cluster_spec(one("RayService"))["workerGroupSpecs"]
    serve_gpus = sum(g["maxReplicas"] * gpus(g["template"]["spec"]["containers"][0]) for g in svc_workers)
    assert llm["deployment_config"]["autoscaling_config"]["max_replicas"] <= serve_gpus
    assert cfg.serve.max_replicas * cfg.serve.gpus_per_replica <= serve_gpus
    assert cfg.serve.max_replicas == llm["deployment_config"]["autoscaling_config"]["max_replicas"]


def test_secrets_are_referenced_never_shipped():
    assert not [o for _, o in OBJECTS if o["kind"] == "Secret"]
    text = "\n".join(p.read_text() for p in INFRA.rglob("*.yaml"))
    assert not re.search(r"(?i)(password|secret_access_key|token)\s*:\s*[\"']?[A-Za-z0-9/+]{12,}", text)


def test_every_infra_yaml_parses():
    for path in INFRA.rglob("*.y*ml"):
        assert docs(path), path
