"""The Helm chart (deploy/helm/pdserve): lint, Kubernetes schema validation of every rendered
object, and the deployment invariants of issue 8, for the default values and its variants."""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from tests.deploy.rendering import (
    CHART_DIR,
    NAMESPACE,
    OTLP_ENDPOINT,
    PDSERVE_ROLES,
    RELEASE,
    VARIANTS,
    WORKER_ROLES,
    Manifest,
    Rendered,
    containers,
    env_of,
    flag,
    mounts_of,
    pod_labels,
    pod_spec,
    render,
    selects,
    service_address,
    volumes_of,
)

# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion: native gRPC probes are GA
# in 1.27) and a current one; kubernetes-validate ships the schemas, so this runs offline.
KUBE_VERSIONS = ("1.27.0", "1.34.0")
# Kinds from CRDs, which kubernetes-validate has no schema for; checked by hand below.
CRD_KINDS = {"ServiceMonitor"}
# The block store has no --drain-grace-s flag; it drains for its config's default.
BLOCKSTORE_DRAIN_S = 10.0

variant_names = pytest.mark.parametrize("variant", sorted(VARIANTS))
PROBE_KINDS = {"grpc", "tcpSocket", "httpGet", "exec"}
# The gateway's failure-handling and admission flags (gateway.* values).
FAILURE_FLAGS = (
    "routing-policy",
    "prefill-timeout-s",
    "decode-stall-timeout-s",
    "max-migrations",
    "max-in-flight",
    "max-in-flight-per-tenant",
    "max-queued-prompt-tokens",
    "max-queued-prompt-tokens-per-tenant",
)


def roles_present(variant: str) -> tuple[str, ...]:
    blockstore = VARIANTS[variant].get("blockstore", {}).get("enabled", True)
    return tuple(role for role in PDSERVE_ROLES if blockstore or role != "blockstore")


def pdserve_container(deployment: Manifest) -> Manifest:
    return pod_spec(deployment)["containers"][0]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_helm_lint_is_clean(variant: str) -> None:
    report = helm.lint(
        CHART_DIR, VARIANTS[variant], strict=True, namespace=NAMESPACE, kube_version="v1.27.0"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert (report["errors"], problems) == ([], [])


def test_decode_workers_take_the_speculative_config_as_json() -> None:
    from common.engine.speculative.config import SpeculativeConfig

    default = render()
    for role in WORKER_ROLES:
        assert flag(pdserve_container(default.deployment(role)), "speculative-config") is None
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    rendered = render({"decode": {"speculativeConfig": spec}})
    text = flag(pdserve_container(rendered.deployment("decode")), "speculative-config")
    assert text is not None
    assert SpeculativeConfig.from_json(text) == SpeculativeConfig(**spec)  # type: ignore[arg-type]
    assert flag(pdserve_container(rendered.deployment("prefill")), "speculative-config") is None


@variant_names
@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_every_object_matches_the_kubernetes_schema(variant: str, kube_version: str) -> None:
    rendered = render(VARIANTS[variant])
    for obj in rendered.objects:
        if obj["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(part) for part in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")


MTLS_DIR = "/etc/pdserve/mtls"


def probe_name(role: str) -> str:
    """The name an mTLS probe checks the role's certificate for: a worker's wildcard SAN
    covers any name under its headless Service; the block store holds its Service name."""
    service = service_address(role, 0).rsplit(":", 1)[0]
    return service if role == "blockstore" else f"probe.{service}"


def serves_tls(variant: str, role: str) -> bool:
    """Whether the role's gRPC port serves TLS in the variant (mTLS; the gateway's publicTls)."""
    values = VARIANTS[variant]
    if role == "gateway":
        return bool(values.get("gateway", {}).get("publicTls", {}).get("enabled"))
    return bool(values.get("mtls", {}).get("enabled"))


@variant_names
def test_every_deployment_probes_its_grpc_port(variant: str) -> None:
    for role in roles_present(variant):
        container = pdserve_container(render(VARIANTS[variant]).deployment(role))
        grpc_ports = [p["containerPort"] for p in container["ports"] if p["name"] == "grpc"]
        assert len(grpc_ports) == 1, role
        # kubelet's gRPC probe speaks neither TLS nor mTLS: under mTLS the container runs
        # `pdserve health` with its certificate; the public TLS port gets a TCP connect.
        port = grpc_ports[0]
        expected: tuple[str, Manifest] = ("grpc", {"port": port, "service": ""})
        if serves_tls(variant, role) and role == "gateway":
            expected = ("tcpSocket", {"port": port})
        elif serves_tls(variant, role):
            expected = ("exec", {"command": [
                "pdserve", "health", f"--target=127.0.0.1:{port}",
                f"--server-name={probe_name(role)}", f"--tls-cert={MTLS_DIR}/tls.crt",
                f"--tls-key={MTLS_DIR}/tls.key", f"--tls-ca={MTLS_DIR}/ca.crt",
            ]})  # fmt: skip
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            checks = [(key, value) for key, value in container[probe].items() if key in PROBE_KINDS]
            if role == "gateway" and probe == "readinessProbe":
                # Readiness asks the OpenAI-compatible API's /health (503 while draining).
                scheme = "HTTPS" if serves_tls(variant, role) else "HTTP"
                assert checks == [("httpGet", {"path": "/health", "port": "http",
                                               "scheme": scheme})], (role, probe)  # fmt: skip
                continue
            assert checks == [expected], (role, probe)
            if expected[0] == "exec":  # Python starts in the probe's time
                assert container[probe]["timeoutSeconds"] >= 5, (role, probe)
        assert flag(container, "port") == str(grpc_ports[0])


@variant_names
def test_every_container_has_requests_and_limits(variant: str) -> None:
    for workload in render(VARIANTS[variant]).workloads():
        for container in containers(workload):
            resources = container["resources"]
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(resources[kind]), (container["name"], kind)


@variant_names
def test_each_role_has_exactly_one_pdb_selecting_its_pods(variant: str) -> None:
    rendered = render(VARIANTS[variant])
    pdbs = rendered.of_kind("PodDisruptionBudget")
    for role in roles_present(variant):
        labels = pod_labels(rendered.deployment(role))
        matching = [p for p in pdbs if selects(p["spec"]["selector"]["matchLabels"], labels)]
        assert len(matching) == 1, role
    assert len(pdbs) == len(roles_present(variant))


@variant_names
def test_grace_period_exceeds_drain_and_pre_stop(variant: str) -> None:
    for role in roles_present(variant):
        deployment = render(VARIANTS[variant]).deployment(role)
        container = pdserve_container(deployment)
        drain_s = float(flag(container, "drain-grace-s") or BLOCKSTORE_DRAIN_S)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {})
        pre_stop_s = float(pre_stop["command"][1]) if pre_stop else 0.0
        grace_s = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace_s > drain_s + pre_stop_s, role


@pytest.mark.parametrize("role", ["gateway", "prefill", "decode"])
def test_chart_refuses_a_grace_period_that_cuts_the_drain(role: str) -> None:
    values = {role: {"drainGraceSeconds": 20, "terminationGracePeriodSeconds": 20}}
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        render(values)


@variant_names
def test_every_image_has_a_pinned_tag(variant: str) -> None:
    for workload in render(VARIANTS[variant]).workloads():
        for container in containers(workload):
            repository, _, tag = container["image"].rpartition(":")
            assert repository and "/" not in tag, container["image"]
            assert tag and tag != "latest", container["image"]


@pytest.mark.parametrize(
    "values", [{"image": {"tag": "latest"}}, {"redis": {"image": {"tag": "latest"}}}]
)
def test_latest_tag_is_refused(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        render(values)


def is_secret_ref(var: Manifest) -> bool:
    return "secretKeyRef" in var.get("valueFrom", {})


@variant_names
def test_no_credential_is_written_into_a_manifest(variant: str) -> None:
    for workload in render(VARIANTS[variant]).workloads():
        for container in containers(workload):
            names = [var["name"] for var in container.get("env", [])]
            env = env_of(container)
            for name, var in env.items():
                if re.search(r"PASSWORD|SECRET|TOKEN|AUTH|API_KEY", name):
                    assert is_secret_ref(var), (container["name"], name)
            url = env.get("PDSERVE_REDIS_URL")
            if url is not None and not is_secret_ref(url):
                userinfo = re.match(r"rediss?://(?:([^@/]*)@)?[^@]+$", url["value"])
                assert userinfo, url["value"]
                if userinfo.group(1):
                    # Only a reference to the secret-backed variable, defined before it.
                    assert userinfo.group(1).endswith(":$(REDIS_PASSWORD)"), url["value"]
                    assert names.index("REDIS_PASSWORD") < names.index("PDSERVE_REDIS_URL")
            for text in [*container.get("args", []), *container.get("command", [])]:
                assert not re.search(r"requirepass\s+[^\s\"]", text), text


def string_settings(tree: Any, path: str = "") -> list[tuple[str, str]]:
    """(dotted key, value) for every string-valued setting."""
    if isinstance(tree, dict):
        return [kv for key, value in tree.items() for kv in string_settings(value, f"{path}.{key}")]
    if isinstance(tree, list):
        return [kv for i, value in enumerate(tree) for kv in string_settings(value, f"{path}[{i}]")]
    return [(path, tree)] if isinstance(tree, str) else []


def test_values_have_no_place_for_an_inline_password() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    credential = re.compile(r"password|passwd|token|credential|apikey", re.IGNORECASE)
    # "...PasswordKey" names a key inside a Secret, which is where the password lives.
    inline = [
        path
        for path, _ in string_settings(values)
        if credential.search(path.rsplit(".", 1)[-1]) and not path.endswith("Key")
    ]
    assert inline == []
    assert {path for path, _ in string_settings(values) if "PasswordKey" in path} == {
        ".redis.auth.existingSecretPasswordKey",
        ".redis.external.existingSecretPasswordKey",
    }


def test_generated_redis_password_is_random_and_only_without_existing_secret() -> None:
    def secrets(values: dict[str, Any]) -> list[Manifest]:
        with helm.Chart.load(CHART_DIR) as chart:
            manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
        docs = [
            doc
            for path, text in manifests.items()
            if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text)
            if doc
        ]
        return [doc for doc in docs if doc["kind"] == "Secret"]

    first, second = secrets({}), secrets({})
    assert [s["metadata"]["name"] for s in first] == [f"{RELEASE}-pdserve-redis"]
    assert len(first[0]["data"]["redis-password"]) >= 40  # base64 of 32 characters
    assert first[0]["data"] != second[0]["data"]
    assert secrets({"redis": {"auth": {"existingSecret": "mine"}}}) == []
    assert secrets(VARIANTS["external-redis"]) == []


def test_gateway_is_told_the_worker_service_addresses() -> None:
    rendered = render()
    env = env_of(pdserve_container(rendered.deployment("gateway")))
    for role in (*WORKER_ROLES, "blockstore"):
        service = rendered.one("Service", f"{RELEASE}-pdserve-{role}")
        port = service["spec"]["ports"][0]["port"]
        key = "PDSERVE_BLOCKSTORE" if role == "blockstore" else f"PDSERVE_{role.upper()}_SERVICE"
        assert env[key]["value"] == service_address(role, port)
        if role in WORKER_ROLES:
            assert service["spec"]["clusterIP"] == "None"  # headless: one record per pod
            assert port == int(flag(pdserve_container(rendered.deployment(role)), "port") or 0)


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_workers_advertise_their_pod_address_and_use_the_block_store(role: str) -> None:
    container = pdserve_container(render().deployment(role))
    port = flag(container, "port")
    assert flag(container, "advertise") == f"$(POD_IP):{port}"
    assert env_of(container)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert flag(container, "blockstore") == service_address("blockstore", 50060)
    assert flag(container, "device") == "cpu"
    assert container["args"][0] == role


@pytest.mark.parametrize(
    ("resources", "threads", "want"),
    [
        ({"limits": {"cpu": "4"}}, 0, "4"),  # the chart's default: whole cores of the limit
        ({"limits": {"cpu": 3}}, 0, "3"),
        ({"limits": {"cpu": "2500m"}}, 0, "2"),
        ({"limits": {"cpu": "1.5"}}, 0, "1"),
        ({"limits": {"cpu": "500m"}}, 0, "1"),  # never 0 threads
        ({"limits": {"cpu": "4"}}, 6, "6"),  # as given
        ({"limits": {"cpu": None, "memory": "6Gi"}}, 0, None),  # no CPU limit: torch's default
    ],
)
def test_worker_threads_follow_the_cpu_limit_unless_given(
    resources: dict[str, Any], threads: int, want: str | None
) -> None:
    rendered = render({role: {"resources": resources, "threads": threads} for role in WORKER_ROLES})
    for role in WORKER_ROLES:
        assert flag(pdserve_container(rendered.deployment(role)), "threads") == want, role


def test_workers_share_the_chart_weight_format() -> None:
    default = render()
    for role in WORKER_ROLES:  # unset: the workers' auto, the bundled GGUF as stored
        assert flag(pdserve_container(default.deployment(role)), "quantization") is None
    rendered = render({"quantization": "int4"})
    for role in WORKER_ROLES:
        assert flag(pdserve_container(rendered.deployment(role)), "quantization") == "int4"
    assert flag(pdserve_container(rendered.deployment("gateway")), "quantization") is None


@variant_names
def test_every_service_selects_pods_and_names_their_ports(variant: str) -> None:
    rendered = render(VARIANTS[variant])
    for service in rendered.of_kind("Service"):
        selector = service["spec"]["selector"]
        pods = [w for w in rendered.workloads() if selects(selector, pod_labels(w))]
        assert pods, service["metadata"]["name"]
        ports = {p["name"] for w in pods for c in containers(w, init=False) for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports


def test_gateway_hpa_owns_the_replica_count() -> None:
    rendered = render()
    gateway = rendered.deployment("gateway")
    hpa = rendered.one("HorizontalPodAutoscaler", gateway["metadata"]["name"])
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    assert "replicas" not in gateway["spec"]
    fixed = render(VARIANTS["shared-model-fixed-replicas"])
    assert fixed.of_kind("HorizontalPodAutoscaler") == []
    replicas = [fixed.deployment(role)["spec"]["replicas"] for role in ("gateway", *WORKER_ROLES)]
    assert replicas == [3, 2, 4]


def test_two_gateways_by_default_on_different_nodes_under_a_pdb() -> None:
    # One gateway's loss leaves another for its streams to resume on.
    rendered = render()
    gateway = rendered.deployment("gateway")
    hpa = rendered.one("HorizontalPodAutoscaler", gateway["metadata"]["name"])
    assert hpa["spec"]["minReplicas"] >= 2
    pdb = rendered.one("PodDisruptionBudget", gateway["metadata"]["name"])
    assert pdb["spec"]["maxUnavailable"] == 1
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(gateway))
    anti = pod_spec(gateway)["affinity"]["podAntiAffinity"]
    (preferred,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    term = preferred["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert selects(term["labelSelector"]["matchLabels"], pod_labels(gateway))
    assert not selects(term["labelSelector"]["matchLabels"],
                       pod_labels(rendered.deployment("decode")))  # fmt: skip
    hard = pod_spec(render({"gateway": {"podAntiAffinity": "hard"}}).deployment("gateway"))
    assert "requiredDuringSchedulingIgnoredDuringExecution" in hard["affinity"]["podAntiAffinity"]
    assert "affinity" not in pod_spec(render({"gateway": {"podAntiAffinity": "none"}}).deployment("gateway"))
    # An affinity of the user's own replaces it; the workers get none unasked.
    own = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "pool", "operator": "In", "values": ["edge"]}]}]}}}  # fmt: skip
    assert pod_spec(render({"gateway": {"affinity": own}}).deployment("gateway"))["affinity"] == own
    assert "affinity" not in pod_spec(rendered.deployment("decode"))


def test_gpu_workers_request_gpus_and_run_the_cuda_image() -> None:
    rendered = render(VARIANTS["gpu"])
    for role in WORKER_ROLES:
        deployment = rendered.deployment(role)
        container = pdserve_container(deployment)
        for kind in ("requests", "limits"):
            assert container["resources"][kind]["nvidia.com/gpu"] == 2
        assert flag(container, "device") == "cuda"
        assert container["image"] == "pdserve:0.1.0-cuda"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod_spec(
            deployment
        )["tolerations"]
    for role in ("gateway", "blockstore"):
        container = pdserve_container(rendered.deployment(role))
        assert "nvidia.com/gpu" not in container["resources"]["limits"]
        assert container["image"] == "pdserve:0.1.0"


def test_tracing_passes_otel_settings_per_role() -> None:
    rendered = render(VARIANTS["tracing-and-metrics"])
    for role in PDSERVE_ROLES:
        env = env_of(pdserve_container(rendered.deployment(role)))
        assert env["OTEL_SERVICE_NAME"]["value"] == f"pdserve-{role}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == OTLP_ENDPOINT
        attributes = env["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(",")
        assert "k8s.pod.name=$(POD_NAME)" in attributes
        assert "deployment.environment=test" in attributes
    for role in PDSERVE_ROLES:
        env = env_of(pdserve_container(render().deployment(role)))
        assert not [name for name in env if name.startswith("OTEL_")]
    with pytest.raises(helm.HelmError, match=r"tracing\.endpoint"):
        render({"tracing": {"enabled": True}})


def test_metrics_port_and_service_monitor_are_opt_in() -> None:
    rendered = render(VARIANTS["tracing-and-metrics"])
    (monitor,) = rendered.of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    for role in PDSERVE_ROLES:
        container = pdserve_container(rendered.deployment(role))
        assert flag(container, "metrics-port") == "9090"
        service = rendered.one("Service", f"{RELEASE}-pdserve-{role}")
        assert selects(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
        assert "metrics" in {p["name"] for p in service["spec"]["ports"]}
    default = render()
    assert default.of_kind("ServiceMonitor") == []
    assert flag(pdserve_container(default.deployment("gateway")), "metrics-port") is None


def test_external_redis_replaces_the_statefulset() -> None:
    rendered = render(VARIANTS["external-redis"])
    assert rendered.of_kind("StatefulSet") == []
    env = env_of(pdserve_container(rendered.deployment("decode")))
    url = env["PDSERVE_REDIS_URL"]["value"]
    assert url == "rediss://:$(REDIS_PASSWORD)@redis.example.com:6379/0"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "redis-auth"
    by_url = env_of(pdserve_container(render(VARIANTS["external-redis-url"]).deployment("gateway")))
    assert by_url["PDSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-url",
        "key": "redis-url",
    }
    with pytest.raises(helm.HelmError, match="redis"):
        render({"redis": {"enabled": False}})


def test_bundled_redis_is_a_password_protected_statefulset() -> None:
    rendered = render()
    (redis,) = rendered.of_kind("StatefulSet")
    container = pod_spec(redis)["containers"][0]
    assert "requirepass" in container["args"][0]
    secret = env_of(container)["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert secret == {"name": f"{RELEASE}-pdserve-redis", "key": "redis-password"}
    url = env_of(pdserve_container(rendered.deployment("gateway")))["PDSERVE_REDIS_URL"]["value"]
    assert url == f"redis://:$(REDIS_PASSWORD)@{service_address('redis', 6379)}/0"
    persistent = render(VARIANTS["shared-model-fixed-replicas"]).of_kind("StatefulSet")[0]
    assert persistent["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"


@variant_names
def test_pods_run_as_non_root_with_a_read_only_root(variant: str) -> None:
    planner = VARIANTS[variant].get("planner", {})
    for workload in render(VARIANTS[variant]).workloads():
        spec = pod_spec(workload)
        assert spec["securityContext"]["runAsNonRoot"] is True
        # Only the planner calls the Kubernetes API, and only when it scales the workers.
        scales_workers = planner.get("enabled") and planner.get("mode") in (None, "kubernetes")
        is_planner = pod_labels(workload).get("app.kubernetes.io/component") == "planner"
        assert spec["automountServiceAccountToken"] is bool(is_planner and scales_workers)
        for container in containers(workload):
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] is True, container["name"]
            assert context["allowPrivilegeEscalation"] is False, container["name"]
            assert context["capabilities"]["drop"] == ["ALL"], container["name"]
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            assert "/tmp" in mounts, container["name"]


def test_model_is_converted_into_the_volume_by_an_init_container() -> None:
    for role in ("gateway", *WORKER_ROLES):
        deployment = render().deployment(role)
        (init,) = pod_spec(deployment)["initContainers"]
        assert init["args"] == ["convert", "--output=/models/SmolLM2-135M-Instruct"]
        assert flag(pdserve_container(deployment), "model") == "/models/SmolLM2-135M-Instruct"
        mounts = {m["name"]: m for m in pdserve_container(deployment)["volumeMounts"]}
        assert mounts["model"]["readOnly"] is True
    shared = render(VARIANTS["shared-model-fixed-replicas"]).deployment("decode")
    assert "initContainers" not in pod_spec(shared)
    volume = next(v for v in pod_spec(shared)["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "models"}


@pytest.mark.parametrize(
    "values",
    [
        {"gatway": {}},
        {"prefill": {"replicas": -1}},
        {"gpu": {"enabled": "yes"}},
        {"decode": {"attentionBackend": "flash"}},
        {"quantization": "q4_k"},
        {"decode": {"speculativeConfig": {"method": "eagle", "num_speculative_tokens": 2}}},
        {"decode": {"speculativeConfig": {"method": "ngram"}}},
        {"decode": {"speculativeConfig": {"method": "ngram", "num_speculative_tokens": 4,
                                          "prompt_lookup_mx": 3}}},
        {"gateway": {"routingPolicy": "random"}},
        {"gateway": {"maxMigrations": -1}},
        {"gateway": {"decodeStallTimeoutSeconds": "30s"}},
    ],
)
def test_schema_rejects_unknown_and_malformed_values(values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        render(values)


def test_notes_tell_how_to_send_a_first_request() -> None:
    notes = render().notes
    assert f"port-forward service/{RELEASE}-pdserve-gateway 50051:50051" in notes
    assert "pdserve generate --target localhost:50051" in notes
    assert "pdserve.gateway.v1.GatewayService/Generate" in notes


def test_helm_test_pod_sends_a_prompt_through_the_gateway() -> None:
    (pod,) = render().of_kind("Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    container = pod_spec(pod)["containers"][0]
    assert container["args"][0] == "generate"
    assert flag(container, "target") == service_address("gateway", 50051)


def test_gateway_failure_handling_and_admission_flags() -> None:
    def gateway_flags(values: dict[str, Any]) -> dict[str, str | None]:
        container = pdserve_container(render(values).deployment("gateway"))
        return {name: flag(container, name) for name in FAILURE_FLAGS}

    assert gateway_flags({}) == {
        "routing-policy": "prefix-aware",
        "prefill-timeout-s": "60",
        "decode-stall-timeout-s": "30",
        "max-migrations": "3",
        "max-in-flight": "1024",
        "max-in-flight-per-tenant": "0",
        "max-queued-prompt-tokens": "262144",
        "max-queued-prompt-tokens-per-tenant": "0",
    }
    assert gateway_flags(VARIANTS["gateway-failure-handling"]) == {
        "routing-policy": "load",
        "prefill-timeout-s": "2.5",
        "decode-stall-timeout-s": "0",
        "max-migrations": "1",
        "max-in-flight": "256",
        "max-in-flight-per-tenant": "32",
        "max-queued-prompt-tokens": "2000000",  # not 2e+06
        "max-queued-prompt-tokens-per-tenant": "100000",
    }
    for role in WORKER_ROLES:
        container = pdserve_container(render(VARIANTS["gateway-failure-handling"]).deployment(role))
        assert [name for name in FAILURE_FLAGS if flag(container, name) is not None] == []


def test_api_keys_file_is_mounted_from_a_secret_into_the_gateway_only() -> None:
    rendered = render(VARIANTS["api-keys"])
    gateway = rendered.deployment("gateway")
    container = pdserve_container(gateway)
    assert flag(container, "api-keys-file") == "/etc/pdserve/api-keys/api-keys"
    assert mounts_of(container)["api-keys"] == {
        "name": "api-keys",
        "mountPath": "/etc/pdserve/api-keys",
        "readOnly": True,
    }
    assert volumes_of(gateway)["api-keys"]["secret"] == {
        "secretName": "pdserve-api-keys",
        "defaultMode": 0o440,
        "items": [{"key": "api-keys", "path": "api-keys"}],
    }
    for role in ("prefill", "decode", "blockstore"):
        deployment = rendered.deployment(role)
        assert "api-keys" not in volumes_of(deployment), role
        assert flag(pdserve_container(deployment), "api-keys-file") is None, role
    default = render().deployment("gateway")
    assert "api-keys" not in volumes_of(default)
    assert flag(pdserve_container(default), "api-keys-file") is None


def test_helm_test_pod_sends_an_api_key_from_a_secret() -> None:
    def test_pod_env(values: dict[str, Any]) -> dict[str, Manifest]:
        (pod,) = render(values).of_kind("Pod")
        return env_of(pod_spec(pod)["containers"][0])

    # By default the key sits beside the keys file, in the gateway's Secret.
    assert test_pod_env(VARIANTS["api-keys"])["PDSERVE_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "pdserve-api-keys", "key": "test-api-key"}
    }
    own = {
        **VARIANTS["api-keys"],
        "tests": {"apiKey": {"existingSecret": "smoke-test", "existingSecretKey": "key"}},
    }
    assert test_pod_env(own)["PDSERVE_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "smoke-test", "key": "key"}
    }
    assert test_pod_env({}) == {}


def test_auth_without_a_secret_is_refused() -> None:
    with pytest.raises(helm.HelmError, match=r"gateway\.auth\.enabled needs gateway\.auth\."):
        render({"gateway": {"auth": {"enabled": True}}})


MTLS_ARGS = [
    "--tls-cert=/etc/pdserve/mtls/tls.crt",
    "--tls-key=/etc/pdserve/mtls/tls.key",
    "--tls-ca=/etc/pdserve/mtls/ca.crt",
]


def mtls_secret_of(deployment: Manifest) -> str:
    """The mTLS Secret the deployment's pdserve container reads, after checking the wiring."""
    container = pdserve_container(deployment)
    assert [a for a in container["args"] if a.startswith("--tls-")] == MTLS_ARGS
    assert mounts_of(container)["mtls"] == {
        "name": "mtls",
        "mountPath": "/etc/pdserve/mtls",
        "readOnly": True,
    }
    secret = volumes_of(deployment)["mtls"]["secret"]
    assert secret["defaultMode"] == 0o440
    assert secret["items"] == [{"key": k, "path": k} for k in ("tls.crt", "tls.key", "ca.crt")]
    name: str = secret["secretName"]
    return name


@pytest.mark.parametrize(
    ("variant", "secrets"),
    [
        ("mtls-shared-secret", dict.fromkeys(PDSERVE_ROLES, "pdserve-mtls")),
        (
            "mtls-per-role",
            {
                "gateway": "pdserve-mtls",
                "prefill": "pdserve-mtls",
                "decode": "decode-mtls",
                "blockstore": "blockstore-mtls",
            },
        ),
    ],
)
def test_mtls_mounts_each_roles_secret_and_passes_the_tls_flags(
    variant: str, secrets: dict[str, str]
) -> None:
    rendered = render(VARIANTS[variant])
    assert {role: mtls_secret_of(rendered.deployment(role)) for role in PDSERVE_ROLES} == secrets
    # The model converter and the helm test pod (which calls the public port) hold no cert.
    for workload in rendered.workloads():
        for container in containers(workload):
            if container["name"] not in PDSERVE_ROLES:
                assert "mtls" not in mounts_of(container), container["name"]
                assert flag(container, "tls-cert") is None, container["name"]


def test_without_mtls_no_tls_flag_or_volume() -> None:
    rendered = render()
    for role in PDSERVE_ROLES:
        deployment = rendered.deployment(role)
        assert "mtls" not in volumes_of(deployment), role
        assert [a for a in pdserve_container(deployment)["args"] if "tls" in a] == [], role


def test_mtls_needs_a_secret_for_every_role_it_renders() -> None:
    three = {"gateway": "g", "prefill": "p", "decode": "d"}
    with pytest.raises(helm.HelmError, match=r"mtls\.existingSecret or mtls\.secrets\.blockstore"):
        render({"mtls": {"enabled": True, "secrets": three}})
    without_store = render(
        {"mtls": {"enabled": True, "secrets": three}, "blockstore": {"enabled": False}}
    )
    assert [mtls_secret_of(without_store.deployment(r)) for r in ("gateway", *WORKER_ROLES)] == [
        "g",
        "p",
        "d",
    ]


@pytest.mark.parametrize("role", WORKER_ROLES)
def test_mtls_workers_advertise_a_dns_name_their_certificate_can_hold(role: str) -> None:
    rendered = render(VARIANTS["mtls-shared-secret"])
    deployment = rendered.deployment(role)
    service = rendered.one("Service", f"{RELEASE}-pdserve-{role}")
    port = service["spec"]["ports"][0]["port"]
    # <pod>.<headless Service>: the pod's hostname under its subdomain, matched by a wildcard
    # SAN; pod IPs are unknown when the Secret is issued.
    assert flag(pdserve_container(deployment), "advertise") == (
        f"$(POD_NAME).{service_address(role, port)}"
    )
    assert pod_spec(deployment)["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is True
    plain = render()
    assert "subdomain" not in pod_spec(plain.deployment(role))
    assert (
        "publishNotReadyAddresses" not in plain.one("Service", f"{RELEASE}-pdserve-{role}")["spec"]
    )


@variant_names
def test_services_claim_h2c_only_for_cleartext_ports(variant: str) -> None:
    rendered = render(VARIANTS[variant])
    for role in roles_present(variant):
        (grpc_port,) = [
            p
            for p in rendered.one("Service", f"{RELEASE}-pdserve-{role}")["spec"]["ports"]
            if p["name"] == "grpc"
        ]
        expected = None if serves_tls(variant, role) else "kubernetes.io/h2c"
        assert grpc_port.get("appProtocol") == expected, role


def test_public_tls_serves_the_gateway_port_with_a_secrets_certificate() -> None:
    rendered = render(VARIANTS["public-tls"])
    gateway = rendered.deployment("gateway")
    container = pdserve_container(gateway)
    assert [a for a in container["args"] if "tls" in a] == [
        "--public-tls-cert=/etc/pdserve/public-tls/tls.crt",
        "--public-tls-key=/etc/pdserve/public-tls/tls.key",
    ]
    assert mounts_of(container)["public-tls"] == {
        "name": "public-tls",
        "mountPath": "/etc/pdserve/public-tls",
        "readOnly": True,
    }
    assert volumes_of(gateway)["public-tls"]["secret"] == {
        "secretName": "gateway-tls",
        "defaultMode": 0o440,
        "items": [{"key": "tls.crt", "path": "tls.crt"}, {"key": "tls.key", "path": "tls.key"}],
    }
    for role in ("prefill", "decode", "blockstore"):
        deployment = rendered.deployment(role)
        assert "public-tls" not in volumes_of(deployment), role
        assert [a for a in pdserve_container(deployment)["args"] if "tls" in a] == [], role
    # The helm test trusts the gateway's certificate through the same Secret's ca.crt.
    (pod,) = rendered.of_kind("Pod")
    test_container = pod_spec(pod)["containers"][0]
    assert flag(test_container, "tls-ca") == "/etc/pdserve/public-tls/ca.crt"
    assert mounts_of(test_container)["gateway-ca"]["mountPath"] == "/etc/pdserve/public-tls"
    assert volumes_of(pod)["gateway-ca"]["secret"] == {
        "secretName": "gateway-tls",
        "defaultMode": 0o440,
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }
    (default_pod,) = render().of_kind("Pod")
    assert flag(pod_spec(default_pod)["containers"][0], "tls-ca") is None
    assert "gateway-ca" not in volumes_of(default_pod)


def test_public_tls_without_a_secret_is_refused() -> None:
    with pytest.raises(
        helm.HelmError, match=r"gateway\.publicTls\.enabled needs gateway\.publicTls\."
    ):
        render({"gateway": {"publicTls": {"enabled": True}}})


def test_notes_show_the_key_and_tls_a_first_request_needs() -> None:
    secured = {
        "gateway": {
            **VARIANTS["public-tls"]["gateway"],
            **VARIANTS["api-keys"]["gateway"],
        }
    }
    notes = render(secured).notes
    assert "export PDSERVE_API_KEY=<key>" in notes
    gateway_host = service_address("gateway", 50051).rsplit(":", 1)[0]
    assert f"grpcurl -cacert ca.crt -servername {gateway_host} -H" in notes
    assert '-H "authorization: Bearer $PDSERVE_API_KEY"' in notes
    assert "pdserve generate --target localhost:50051 --tls-ca ca.crt" in notes
    assert "-plaintext" not in notes
    plain = render().notes
    assert "grpcurl -plaintext \\\n" in plain
    assert "PDSERVE_API_KEY" not in plain


def test_the_gateway_serves_its_http_and_kserve_ports_on_its_service_or_not_at_all() -> None:
    rendered = render()
    container = pdserve_container(rendered.deployment("gateway"))
    assert flag(container, "http-port") == "8000"
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    service = rendered.one("Service", f"{RELEASE}-pdserve-gateway")
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    assert (http["port"], http["targetPort"], http["appProtocol"]) == (8000, "http", "http")
    tls = rendered_service_http(render(VARIANTS["public-tls"]))
    assert tls["appProtocol"] == "https"

    assert flag(container, "kserve-port") == "8001"
    assert {"name": "kserve", "containerPort": 8001, "protocol": "TCP"} in container["ports"]
    (kserve,) = [p for p in service["spec"]["ports"] if p["name"] == "kserve"]
    assert (kserve["port"], kserve["targetPort"], kserve["appProtocol"]) == (
        8001, "kserve", "kubernetes.io/h2c",
    )  # fmt: skip

    off = render({"gateway": {"http": {"enabled": False, "port": 8000},
                              "kserve": {"enabled": False, "port": 8001}}})  # fmt: skip
    container = pdserve_container(off.deployment("gateway"))
    assert flag(container, "http-port") == "-1" and flag(container, "kserve-port") == "-1"
    assert all(p["name"] not in ("http", "kserve") for p in container["ports"])
    assert "grpc" in container["readinessProbe"]  # the gRPC health check again
    service = off.one("Service", f"{RELEASE}-pdserve-gateway")
    assert all(p["name"] not in ("http", "kserve") for p in service["spec"]["ports"])


def rendered_service_http(rendered: Rendered) -> Manifest:
    service = rendered.one("Service", f"{RELEASE}-pdserve-gateway")
    (http,) = [p for p in service["spec"]["ports"] if p["name"] == "http"]
    return http


def test_the_block_store_disk_tier_is_a_kept_claim_mounted_where_the_flag_points() -> None:
    plain = render().deployment("blockstore")
    assert flag(pdserve_container(plain), "disk-dir") is None and "kv" not in volumes_of(plain)
    assert plain["spec"]["strategy"]["type"] == "RollingUpdate"
    assert render().of_kind("PersistentVolumeClaim") == []

    rendered = render(VARIANTS["blockstore-disk"])
    store = rendered.deployment("blockstore")
    container = pdserve_container(store)
    assert flag(container, "disk-capacity") == "40GiB"
    assert mounts_of(container)["kv"]["mountPath"] == flag(container, "disk-dir")
    assert store["spec"]["strategy"] == {"type": "Recreate"}  # the claim is ReadWriteOnce
    (claim,) = rendered.of_kind("PersistentVolumeClaim")
    volume = volumes_of(store)["kv"]["persistentVolumeClaim"]
    assert volume["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert claim["spec"]["storageClassName"] == "ssd"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"

    given = render({"blockstore": {"disk": {"enabled": True, "size": "1Gi", "capacity": "0.9",
                                            "existingClaim": "my-kv"}}})  # fmt: skip
    assert given.of_kind("PersistentVolumeClaim") == []
    claim_name = volumes_of(given.deployment("blockstore"))["kv"]["persistentVolumeClaim"]
    assert claim_name == {"claimName": "my-kv"}
