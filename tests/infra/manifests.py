"""Helpers shared by the infra tests: reading the manifests under ``infra/``, validating core
Kubernetes objects with kubernetes-validate (its bundled schemas, offline), and a JSON schema of
the KubeRay fields the manifests use.

The KubeRay schema is a subset of KubeRay's own CRDs (ray.io/v1 RayCluster, RayJob, RayService:
the openAPIV3Schema of ray-operator/config/crd/bases, whose full text is ~60,000 lines), with the
same names and types, and ``additionalProperties: false`` at every level so that a misspelled
or misplaced field fails. The pod templates inside the KubeRay resources are not described here:
they are checked as Kubernetes ``PodTemplate`` objects by kubernetes-validate.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from components.config import PROJECT_ROOT

INFRA = PROJECT_ROOT / "infra"
KUBERAY = INFRA / "kuberay"
KUBERAY_KINDS = ("RayCluster", "RayJob", "RayService")


def docs(path: Path) -> list[dict[str, Any]]:
    """The YAML documents of ``path`` (empty ones dropped)."""
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def kube_objects() -> list[tuple[str, dict[str, Any]]]:
    """(file name, object) of every Kubernetes manifest under infra/ (kuberay/, mlflow/)."""
    return [(f"{p.parent.name}/{p.name}", d) for p in sorted([*KUBERAY.glob("*.yaml"), *(INFRA / "mlflow").glob("*.yaml")])
            for d in docs(p)]


def one(kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of ``kind`` (and ``name``) under infra/."""
    found = [d for _, d in kube_objects() if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(found) == 1, f"{len(found)} objects of kind {kind} named {name}"
    return found[0]


def cluster_spec(obj: dict[str, Any]) -> dict[str, Any]:
    """The RayCluster spec of a RayCluster or a RayService."""
    return obj["spec"]["rayClusterConfig"] if obj["kind"] == "RayService" else obj["spec"]


def groups(spec: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(group name, group spec) of the head ("head") and every worker group of a RayCluster spec."""
    return [("head", spec["headGroupSpec"])] + [(g["groupName"], g) for g in spec.get("workerGroupSpecs", [])]


def pod_templates(obj: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(where, PodTemplateSpec) of every pod template inside a Kubernetes or KubeRay object."""
    if obj["kind"] in ("RayCluster", "RayService"):
        return [(f"{obj['kind']} {name}", g["template"]) for name, g in groups(cluster_spec(obj))]
    if obj["kind"] in ("Deployment", "StatefulSet"):
        return [(obj["kind"], obj["spec"]["template"])]
    return []


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for _, t in pod_templates(obj) for c in t["spec"]["containers"]]


def as_pod_template(template: dict[str, Any], name: str) -> dict[str, Any]:
    """A PodTemplateSpec wrapped as a v1 PodTemplate, which kubernetes-validate knows."""
    return {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name}, "template": template}


def k8s_validate(obj: dict[str, Any]) -> None:
    """kubernetes-validate, strict (unknown fields fail), against its newest bundled Kubernetes."""
    import kubernetes_validate

    kubernetes_validate.validate(copy.deepcopy(obj), kubernetes_validate.latest_version(), strict=True)


# ----------------------------------------------------------------------------- KubeRay schema
def _obj(props: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


_STR, _INT, _BOOL = {"type": "string"}, {"type": "integer", "minimum": 0}, {"type": "boolean"}
_NUM = {"type": "number", "minimum": 0}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}  # rayStartParams: strings only
_TEMPLATE = {"type": "object", "required": ["spec"]}  # checked as a PodTemplate by kubernetes-validate
_METADATA = _obj({"name": _STR, "namespace": _STR, "labels": _STR_MAP, "annotations": _STR_MAP}, ("name",))
_HEAD = _obj({"serviceType": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]}, "rayStartParams": _STR_MAP,
              "enableIngress": _BOOL, "template": _TEMPLATE}, ("template",))
_WORKER = _obj({"groupName": _STR, "replicas": _INT, "minReplicas": _INT, "maxReplicas": _INT,
                "rayStartParams": _STR_MAP, "template": _TEMPLATE, "suspend": _BOOL},
               ("groupName", "template"))
_CLUSTER_SPEC = _obj({"rayVersion": {"type": "string", "pattern": r"^\d+\.\d+\.\d+$"},
                      "enableInTreeAutoscaling": _BOOL, "headGroupSpec": _HEAD,
                      "workerGroupSpecs": {"type": "array", "items": _WORKER}}, ("rayVersion", "headGroupSpec"))
_JOB_SPEC = _obj({"entrypoint": {"type": "string", "minLength": 1}, "clusterSelector": _STR_MAP,
                  "rayClusterSpec": _CLUSTER_SPEC,
                  "submissionMode": {"enum": ["K8sJobMode", "HTTPMode", "InteractiveMode", "SidecarMode"]},
                  "entrypointNumCpus": _NUM, "entrypointNumGpus": _NUM, "activeDeadlineSeconds": _INT,
                  "shutdownAfterJobFinishes": _BOOL, "ttlSecondsAfterFinished": _INT, "backoffLimit": _INT},
                 ("entrypoint",))
_SERVICE_SPEC = _obj({"serveConfigV2": {"type": "string", "minLength": 1}, "rayClusterConfig": _CLUSTER_SPEC,
                      "serviceUnhealthySecondThreshold": _INT, "deploymentUnhealthySecondThreshold": _INT},
                     ("serveConfigV2", "rayClusterConfig"))


def _resource(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return _obj({"apiVersion": {"const": "ray.io/v1"}, "kind": {"const": kind}, "metadata": _METADATA,
                 "spec": spec}, ("apiVersion", "kind", "metadata", "spec"))


KUBERAY_SCHEMAS = {"RayCluster": _resource("RayCluster", _CLUSTER_SPEC), "RayJob": _resource("RayJob", _JOB_SPEC),
                   "RayService": _resource("RayService", _SERVICE_SPEC)}


def kuberay_errors(obj: dict[str, Any]) -> list[str]:
    """What is wrong with a KubeRay resource against KUBERAY_SCHEMAS (empty: valid)."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(KUBERAY_SCHEMAS[obj["kind"]])
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj)]


def gpus(container: dict[str, Any]) -> int:
    return int(container["resources"]["limits"].get("nvidia.com/gpu", 0))


def cpus(container: dict[str, Any]) -> float:
    value = str(container["resources"]["limits"]["cpu"])
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)
