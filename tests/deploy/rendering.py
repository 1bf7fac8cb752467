"""Renders deploy/helm/pdserve offline with helm-python-sdk (Helm's Go SDK in a shared library,
so no helm binary, cluster or network) and gives the tests typed views of the objects."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import yaml

CHART_DIR = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
RELEASE = "demo"
NAMESPACE = "llm"
PDSERVE_ROLES = ("gateway", "prefill", "decode", "blockstore")
WORKER_ROLES = ("prefill", "decode")
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "Pod")

Manifest = dict[str, Any]

OTLP_ENDPOINT = "http://otel-collector.observability:4317"
# The values the tests render besides the defaults: one per way the chart is meant to be used.
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "external-redis": {
        "redis": {
            "enabled": False,
            "external": {"host": "redis.example.com", "tls": True, "existingSecret": "redis-auth"},
        }
    },
    "external-redis-url": {
        "redis": {"enabled": False, "external": {"existingUrlSecret": "redis-url"}}
    },
    "gpu": {"gpu": {"enabled": True, "count": 2}, "prefill": {"kvCacheMemory": "0.8"}},
    "tracing-and-metrics": {
        "tracing": {
            "enabled": True,
            "endpoint": OTLP_ENDPOINT,
            "resourceAttributes": {"deployment.environment": "test"},
        },
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
    },
    "gateway-failure-handling": {
        "gateway": {
            "routingPolicy": "load",
            "prefillTimeoutSeconds": 2.5,
            "decodeStallTimeoutSeconds": 0,
            "maxMigrations": 1,
            "maxInFlight": 256,
            "maxInFlightPerTenant": 32,
            "maxQueuedPromptTokens": 2_000_000,
            "maxQueuedPromptTokensPerTenant": 100_000,
        }
    },
    "blockstore-disk": {
        "blockstore": {
            "disk": {"enabled": True, "size": "50Gi", "capacity": "40GiB", "storageClassName": "ssd"}
        }
    },
    "api-keys": {"gateway": {"auth": {"enabled": True, "existingSecret": "pdserve-api-keys"}}},
    "public-tls": {"gateway": {"publicTls": {"enabled": True, "existingSecret": "gateway-tls"}}},
    "mtls-shared-secret": {"mtls": {"enabled": True, "existingSecret": "pdserve-mtls"}},
    "mtls-per-role": {
        "mtls": {
            "enabled": True,
            "existingSecret": "pdserve-mtls",
            "secrets": {"decode": "decode-mtls", "blockstore": "blockstore-mtls"},
        }
    },
    # The planner reads every process's /metrics, so it comes with metrics on.
    "planner-kubernetes": {"planner": {"enabled": True}, "metrics": {"enabled": True}},
    "planner-metrics": {
        "planner": {"enabled": True, "mode": "metrics", "maxWorkers": 12},
        "metrics": {"enabled": True, "serviceMonitor": {"enabled": True}},
    },
    "shared-model-fixed-replicas": {
        "model": {"convert": {"enabled": False}, "volume": {"existingClaim": "models"}},
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 3},
        "prefill": {"replicas": 2},
        "decode": {"replicas": 4},
        "blockstore": {"enabled": False},
        "redis": {"auth": {"existingSecret": "my-redis"}, "persistence": {"enabled": True}},
    },
}


@dataclass(frozen=True)
class Rendered:
    objects: tuple[Manifest, ...]
    notes: str

    def of_kind(self, kind: str) -> list[Manifest]:
        return [obj for obj in self.objects if obj["kind"] == kind]

    def one(self, kind: str, name: str) -> Manifest:
        matches = [obj for obj in self.of_kind(kind) if obj["metadata"]["name"] == name]
        assert len(matches) == 1, f"{len(matches)} {kind} named {name}"
        return matches[0]

    def deployment(self, role: str) -> Manifest:
        return self.one("Deployment", f"{RELEASE}-pdserve-{role}")

    def workloads(self) -> list[Manifest]:
        return [obj for obj in self.objects if obj["kind"] in WORKLOAD_KINDS]


def render(values: dict[str, Any] | None = None) -> Rendered:
    """The chart rendered for an install of release "demo" into namespace "llm"."""
    return _render(json.dumps(values or {}, sort_keys=True))


@functools.cache
def _render(values_json: str) -> Rendered:
    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(
            json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True
        )
    objects = tuple(
        obj
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        for obj in yaml.safe_load_all(text)
        if obj
    )
    notes = next((text for path, text in manifests.items() if path.endswith("NOTES.txt")), "")
    return Rendered(objects=objects, notes=notes)


def service_address(role: str, port: int) -> str:
    return f"{RELEASE}-pdserve-{role}.{NAMESPACE}.svc.cluster.local:{port}"


def pod_spec(workload: Manifest) -> Manifest:
    if workload["kind"] == "Pod":
        return workload["spec"]
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Manifest) -> dict[str, str]:
    if workload["kind"] == "Pod":
        return workload["metadata"]["labels"]
    return workload["spec"]["template"]["metadata"]["labels"]


def containers(workload: Manifest, *, init: bool = True) -> Iterator[Manifest]:
    spec = pod_spec(workload)
    yield from spec["containers"]
    if init:
        yield from spec.get("initContainers", [])


def env_of(container: Manifest) -> dict[str, Manifest]:
    return {var["name"]: var for var in container.get("env", [])}


def volumes_of(workload: Manifest) -> dict[str, Manifest]:
    return {volume["name"]: volume for volume in pod_spec(workload).get("volumes", [])}


def mounts_of(container: Manifest) -> dict[str, Manifest]:
    return {mount["name"]: mount for mount in container.get("volumeMounts", [])}


def flag(container: Manifest, name: str) -> str | None:
    """The value of ``--name=value`` in the container's args, or None."""
    prefix = f"--{name}="
    values = [arg[len(prefix) :] for arg in container.get("args", []) if arg.startswith(prefix)]
    assert len(values) <= 1, f"{name} given {len(values)} times"
    return values[0] if values else None


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())
