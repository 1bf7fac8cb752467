"""The chart's SLA planner (issue 29): the Deployment, its one ServiceAccount with a token and
its narrow Role in kubernetes mode, the HPAs of metrics mode, and nothing of it when off.
Schema validation, lint, probes, resources and the pod security posture of the planner
variants run with every other variant in test_helm_chart.py."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.deploy.rendering import (
    NAMESPACE,
    RELEASE,
    VARIANTS,
    WORKER_ROLES,
    Manifest,
    Rendered,
    containers,
    flag,
    mounts_of,
    pod_labels,
    pod_spec,
    render,
    selects,
    volumes_of,
)

KUBERNETES = VARIANTS["planner-kubernetes"]
METRICS = VARIANTS["planner-metrics"]
PLANNER = f"{RELEASE}-pdserve-planner"
README = Path(__file__).resolve().parents[2] / "deploy" / "README.md"


def deployment_of(rendered: Rendered, component: str) -> Manifest:
    """The Deployment of one component, whatever the chart named it."""
    (deployment,) = [
        d
        for d in rendered.of_kind("Deployment")
        if pod_labels(d)["app.kubernetes.io/component"] == component
    ]
    return deployment


def planner_container(rendered: Rendered) -> Manifest:
    (container,) = pod_spec(deployment_of(rendered, "planner"))["containers"]
    return container


def worker_names(rendered: Rendered) -> dict[str, str]:
    """The names of the worker Deployments as the chart rendered them."""
    return {role: deployment_of(rendered, role)["metadata"]["name"] for role in WORKER_ROLES}


def rbac(rendered: Rendered) -> list[Manifest]:
    kinds = ("Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")
    return [obj for obj in rendered.objects if obj["kind"] in kinds]


def mounts_a_token(rendered: Rendered, workload: Manifest) -> bool:
    """Whether the pod gets an API token: its own setting, else its ServiceAccount's."""
    spec = pod_spec(workload)
    if "automountServiceAccountToken" in spec:
        return bool(spec["automountServiceAccountToken"])
    account = rendered.one("ServiceAccount", spec.get("serviceAccountName", "default"))
    return bool(account.get("automountServiceAccountToken", True))


def test_planner_off_renders_none_of_it() -> None:
    rendered = render()
    names = [obj["metadata"]["name"] for obj in rendered.objects]
    assert [name for name in names if "planner" in name] == []
    assert rbac(rendered) == []
    (hpa,) = rendered.of_kind("HorizontalPodAutoscaler")  # the gateway's own, on CPU
    assert hpa["metadata"]["name"] == f"{RELEASE}-pdserve-gateway"
    assert [rendered.deployment(role)["spec"]["replicas"] for role in WORKER_ROLES] == [1, 1]
    assert "planner" not in rendered.notes


def test_kubernetes_mode_role_is_get_and_patch_of_the_two_workers_scale_only() -> None:
    rendered = render(KUBERNETES)
    names = worker_names(rendered)
    (role,) = rendered.of_kind("Role")
    assert role["metadata"]["name"] == PLANNER
    assert role["rules"] == [
        {
            "apiGroups": ["apps"],
            "resources": ["deployments/scale"],
            "resourceNames": [names["prefill"], names["decode"]],
            "verbs": ["get", "patch"],
        }
    ]
    (binding,) = rendered.of_kind("RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": PLANNER,
    }
    planner_account = pod_spec(rendered.deployment("planner"))["serviceAccountName"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": planner_account, "namespace": NAMESPACE}
    ]
    # Nothing else grants anything: no cluster scope, no second Role.
    assert [obj["kind"] for obj in rbac(rendered)] == ["Role", "RoleBinding"]


@pytest.mark.parametrize("variant", ["planner-kubernetes", "planner-metrics"])
def test_only_the_planner_mounts_a_token_and_only_to_scale(variant: str) -> None:
    rendered = render(VARIANTS[variant])
    scales_itself = variant == "planner-kubernetes"
    tokens = {
        container["name"]: mounts_a_token(rendered, workload)
        for workload in rendered.workloads()
        for container in containers(workload, init=False)
    }
    assert tokens.pop("planner") is scales_itself
    assert set(tokens.values()) == {False}, tokens
    # Its ServiceAccount is its own: a Role bound to it reaches no other pod.
    planner_account = pod_spec(rendered.deployment("planner"))["serviceAccountName"]
    others = {
        pod_spec(w).get("serviceAccountName")
        for w in rendered.workloads()
        if pod_labels(w).get("app.kubernetes.io/component") != "planner"
    }
    assert planner_account == PLANNER and planner_account not in others
    account = rendered.one("ServiceAccount", PLANNER)
    assert account["automountServiceAccountToken"] is scales_itself


@pytest.mark.parametrize(
    "values",
    [KUBERNETES, {**KUBERNETES, "fullnameOverride": "serving"}, METRICS],
    ids=["release-name", "fullname-override", "metrics-mode"],
)
def test_the_planner_is_given_the_deployments_the_chart_renders(values: dict[str, Any]) -> None:
    rendered = render(values)
    container = planner_container(rendered)
    names = worker_names(rendered)
    assert flag(container, "prefill-deployment") == names["prefill"]
    assert flag(container, "decode-deployment") == names["decode"]
    assert flag(container, "namespace") == NAMESPACE
    for role in rendered.of_kind("Role"):  # the names it scales are the names it may scale
        assert role["rules"][0]["resourceNames"] == [names["prefill"], names["decode"]]


def test_the_planner_runs_its_command_with_the_values() -> None:
    values = {
        **KUBERNETES,
        "planner": {"enabled": True, "ttftMs": 750, "itlMs": 40.5, "intervalS": 15,
                    "dwellS": 90, "minWorkers": 3, "maxWorkers": 24},
    }  # fmt: skip
    container = planner_container(render(values))
    assert container["args"][0] == "planner"
    assert {name: flag(container, name) for name in (
        "connector", "ttft-ms", "itl-ms", "interval-s", "dwell-s", "min-workers",
        "max-workers", "worker-id", "model", "metrics-port",
    )} == {
        "connector": "kubernetes", "ttft-ms": "750", "itl-ms": "40.5", "interval-s": "15",
        "dwell-s": "90", "min-workers": "3", "max-workers": "24", "worker-id": "$(POD_NAME)",
        "model": "SmolLM2-135M-Instruct", "metrics-port": "9090",
    }  # fmt: skip
    assert flag(planner_container(render(METRICS)), "connector") == "metrics"


def test_the_planner_reads_redis_as_every_pdserve_process() -> None:
    rendered = render(KUBERNETES)
    env = {var["name"]: var for var in planner_container(rendered).get("env", [])}
    decode = pod_spec(rendered.deployment("decode"))["containers"][0]
    decode_env = {var["name"]: var for var in decode["env"]}
    for name in ("REDIS_PASSWORD", "PDSERVE_REDIS_URL"):
        assert env[name] == decode_env[name], name


def test_the_planner_pod_is_probed_on_its_metrics_port_and_holds_no_model() -> None:
    rendered = render(KUBERNETES)
    deployment = rendered.deployment("planner")
    container = planner_container(rendered)
    assert container["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe
    assert pod_spec(deployment)["securityContext"]["runAsUser"] == 10001
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/cache", "/tmp"}
    assert all("emptyDir" in v for v in volumes_of(deployment).values())
    assert "initContainers" not in pod_spec(deployment)  # no model to convert
    # One planner at a time, also across a rollout.
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    service = rendered.one("Service", PLANNER)
    assert selects(service["spec"]["selector"], pod_labels(deployment))
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["metrics"]


@pytest.mark.parametrize("variant", ["planner-kubernetes", "planner-metrics"])
def test_with_the_planner_the_chart_sets_no_worker_count(variant: str) -> None:
    rendered = render({**VARIANTS[variant], "prefill": {"replicas": 3}, "decode": {"replicas": 5}})
    for role in WORKER_ROLES:  # else every helm upgrade would undo the planner's counts
        assert "replicas" not in rendered.deployment(role)["spec"], role


def test_metrics_mode_scales_each_worker_with_an_hpa_on_the_planners_count() -> None:
    rendered = render(METRICS)
    assert rbac(rendered) == []
    names = worker_names(rendered)
    hpas = {hpa["metadata"]["name"]: hpa for hpa in rendered.of_kind("HorizontalPodAutoscaler")}
    for role in WORKER_ROLES:
        spec = hpas[names[role]]["spec"]
        assert spec["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": names[role],
        }
        # desired replicas = ceil(metric / averageValue) = the planner's count
        assert spec["metrics"] == [
            {
                "type": "External",
                "external": {
                    "metric": {
                        "name": "pdserve_planner_desired_workers",
                        "selector": {"matchLabels": {"role": role, "service": PLANNER}},
                    },
                    "target": {"type": "AverageValue", "averageValue": "1"},
                },
            }
        ]
        assert (spec["minReplicas"], spec["maxReplicas"]) == (1, 12)
        assert spec["behavior"] == {
            "scaleUp": {"stabilizationWindowSeconds": 0},
            "scaleDown": {"stabilizationWindowSeconds": 0},
        }
    assert set(hpas) == {f"{RELEASE}-pdserve-gateway", *names.values()}
    # Prometheus scrapes the planner: the series the HPAs' selector names.
    (monitor,) = rendered.of_kind("ServiceMonitor")
    (components,) = monitor["spec"]["selector"]["matchExpressions"]
    assert "planner" in components["values"]
    service_labels = rendered.one("Service", PLANNER)["metadata"]["labels"]
    assert selects(monitor["spec"]["selector"]["matchLabels"], service_labels)
    zero = render({**METRICS, "planner": {**METRICS["planner"], "hpa": {"prefillMinReplicas": 0}}})
    assert zero.one("HorizontalPodAutoscaler", names["prefill"])["spec"]["minReplicas"] == 0
    assert zero.one("HorizontalPodAutoscaler", names["decode"])["spec"]["minReplicas"] == 1


def test_kubernetes_mode_renders_no_worker_hpa() -> None:
    hpas = render(KUBERNETES).of_kind("HorizontalPodAutoscaler")
    assert [hpa["metadata"]["name"] for hpa in hpas] == [f"{RELEASE}-pdserve-gateway"]


def adapter_rule(text: str) -> list[dict[str, Any]]:
    """The prometheus-adapter rule quoted in ``text`` (the lines from '- seriesQuery')."""
    match = re.search(r"^( *)- seriesQuery:.*\n(?:\1  .*\n)+", text, re.MULTILINE)
    assert match, "no prometheus-adapter rule"
    rule: list[dict[str, Any]] = yaml.safe_load(match.group(0))
    return rule


def test_metrics_mode_notes_and_readme_give_the_same_adapter_rule() -> None:
    notes = render(METRICS).notes
    (rule,) = adapter_rule(notes)
    assert rule["name"] == {
        "matches": "^pdserve:planner_desired_workers$",
        "as": "pdserve_planner_desired_workers",
    }
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}
    assert adapter_rule(README.read_text()) == [rule]
    assert "seriesQuery" not in render(KUBERNETES).notes


def test_under_mtls_the_planner_holds_its_certificate() -> None:
    values = {**KUBERNETES, "mtls": {"enabled": True, "existingSecret": "pdserve-mtls",
                                     "secrets": {"planner": "planner-mtls"}}}  # fmt: skip
    rendered = render(values)
    container = planner_container(rendered)
    assert [a for a in container["args"] if a.startswith("--tls-")] == [
        "--tls-cert=/etc/pdserve/mtls/tls.crt",
        "--tls-key=/etc/pdserve/mtls/tls.key",
        "--tls-ca=/etc/pdserve/mtls/ca.crt",
    ]
    assert mounts_of(container)["mtls"]["readOnly"] is True
    secret = volumes_of(rendered.deployment("planner"))["mtls"]["secret"]
    assert secret["secretName"] == "planner-mtls"  # mtls.secrets.planner over existingSecret
    # Its probe stays an HTTP GET: the metrics port serves no TLS.
    assert container["readinessProbe"]["httpGet"]["port"] == "metrics"


def test_the_planner_needs_the_processes_metrics() -> None:
    with pytest.raises(helm.HelmError, match=r"planner\.enabled needs metrics\.enabled"):
        render({"planner": {"enabled": True}})


def test_the_chart_refuses_fewer_max_workers_than_min() -> None:
    with pytest.raises(helm.HelmError, match=r"planner\.minWorkers \(4\) must not exceed"):
        render({**KUBERNETES, "planner": {"enabled": True, "minWorkers": 4, "maxWorkers": 3}})


@pytest.mark.parametrize(
    "planner",
    [
        {"enabled": True, "mode": "keda"},
        {"enabled": True, "ttftMs": 0},
        {"enabled": True, "itlMs": "100ms"},
        {"enabled": True, "minWorkers": 0},
        {"enabled": True, "hpa": {"prefillMinReplicas": -1}},
        {"enabled": True, "replicas": 2},
    ],
)
def test_schema_rejects_malformed_planner_values(planner: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"metrics": {"enabled": True}, "planner": planner})
