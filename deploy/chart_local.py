"""Runs the Helm chart's pods as podman containers on this machine, each under its own pod
spec, and checks them as a cluster would: deploy/run_chart_local.sh calls it.

The chart is rendered with the project's helm tooling (helm-python-sdk: Helm's own template
engine, no cluster). Every rendered pod (Deployments' replicas, the Redis StatefulSet, the
chart's test pod) becomes containers on one podman network: init containers first, to
completion, then the main container, each with its command and args, its env (field and
Secret references resolved, `$(VAR)` expanded as the kubelet does), its security context
(user and group, a read-only root, dropped capabilities, no privilege escalation), its
`emptyDir`s as podman volumes (world-writable, as the kubelet makes them), no
service-account token, and its resource limits. Services resolve through the network's DNS
to the pods they select, under every name a pod's resolver would try. The probes the chart
declares run from this host against the pods' addresses, as the kubelet's do.

Then: the chart's test pod answers a prompt through the gateway, `pdserve status` lists
every worker, nothing was written outside the volumes (`podman diff`), every process runs as
the chart's uid, and, with two decode pods, a stream survives `podman kill` of the decode
container serving it, token for token.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CHART_DIR = REPO / "deploy" / "helm" / "pdserve"
Manifest = dict[str, Any]


def log(message: str) -> None:
    print(f"chart_local: {message}", file=sys.stderr, flush=True)


class CheckFailed(RuntimeError):
    """A check of the running chart failed; the message says which and why."""


def podman(*args: str, check: bool = True, timeout: float = 600, **kwargs: Any) -> str:
    completed = subprocess.run(["podman", *args], capture_output=True, text=True,
                               timeout=timeout, check=False, **kwargs)  # fmt: skip
    if check and completed.returncode != 0:
        raise CheckFailed(f"podman {' '.join(args[:3])} ...: exit {completed.returncode}: "
                          f"{completed.stderr.strip()[-2000:]}")  # fmt: skip
    return completed.stdout


# ---------------------------------------------------------------------------- rendering


def render(values: dict[str, Any], release: str, namespace: str) -> list[Manifest]:
    import helm_python as helm
    import yaml

    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(values, name=release, namespace=namespace, is_install=True)
    return [obj for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for obj in yaml.safe_load_all(text) if obj]  # fmt: skip


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_set(assignments: list[str]) -> dict[str, Any]:
    """helm's --set a.b.c=value (value read as YAML: numbers, booleans, strings)."""
    import yaml

    values: dict[str, Any] = {}
    for assignment in assignments:
        path, _, raw = assignment.partition("=")
        node = values
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = yaml.safe_load(raw)
    return values


# ------------------------------------------------------------------------------- pods


@dataclass
class Pod:
    name: str
    spec: Manifest
    labels: dict[str, str]
    ip: str
    aliases: list[str] = field(default_factory=list)
    role: str = ""

    def container_name(self, container: Manifest) -> str:
        return f"{self.name}--{container['name']}"

    @property
    def main(self) -> list[Manifest]:
        return list(self.spec["containers"])

    @property
    def init(self) -> list[Manifest]:
        return list(self.spec.get("initContainers", []))


def pods_of(objects: list[Manifest], subnet_prefix: str) -> list[Pod]:
    """The pods the workloads make: a Deployment's replicas named <name>-<i>, a StatefulSet's
    <name>-<i>, a bare Pod (the chart's test) by its name; addresses in order."""
    pods: list[Pod] = []
    for obj in objects:
        kind = obj["kind"]
        if kind in ("Deployment", "StatefulSet"):
            template = obj["spec"]["template"]
            replicas = obj["spec"].get("replicas", 1)
            for i in range(replicas):
                pods.append(Pod(f"{obj['metadata']['name']}-{i}", template["spec"],
                                template["metadata"].get("labels", {}), ""))  # fmt: skip
        elif kind == "Pod":
            pods.append(Pod(obj["metadata"]["name"], obj["spec"], obj["metadata"]["labels"], ""))
    for i, pod in enumerate(pods):
        pod.ip = f"{subnet_prefix}.{10 + i}"
        pod.role = pod.labels.get("app.kubernetes.io/component", "")
    return pods


def service_names(name: str, namespace: str) -> list[str]:
    # What a pod's resolver finds a Service by: its search path is <ns>.svc.cluster.local,
    # svc.cluster.local, cluster.local.
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
            f"{name}.{namespace}.svc.cluster.local"]  # fmt: skip


def attach_services(objects: list[Manifest], pods: list[Pod], namespace: str) -> None:
    for svc in (o for o in objects if o["kind"] == "Service"):
        selector = svc["spec"].get("selector") or {}
        chosen = [p for p in pods if selector and all(p.labels.get(k) == v
                                                      for k, v in selector.items())]  # fmt: skip
        for pod in chosen:
            pod.aliases += service_names(svc["metadata"]["name"], namespace)


# -------------------------------------------------------------------------- env and args


def secret_value(objects: list[Manifest], name: str, key: str) -> str:
    for obj in objects:
        if obj["kind"] == "Secret" and obj["metadata"]["name"] == name:
            if key in obj.get("stringData", {}):
                return str(obj["stringData"][key])
            if key in obj.get("data", {}):
                return base64.b64decode(obj["data"][key]).decode()
    raise CheckFailed(f"Secret {name} (key {key}) is not among the rendered objects: this "
                      "runner has no cluster to read it from")  # fmt: skip


_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: a defined VAR is replaced, an unknown one kept as
    written, $$ escapes a $."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _REF.sub(one, text)


def container_env(container: Manifest, pod: Pod, objects: list[Manifest],
                  namespace: str) -> dict[str, str]:  # fmt: skip
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
            continue
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            fields = {"metadata.name": pod.name, "metadata.namespace": namespace,
                      "status.podIP": pod.ip, "spec.nodeName": "local-node",
                      "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default")}  # fmt: skip
            if path not in fields:
                raise CheckFailed(f"{pod.name}: env {var['name']} reads field {path}, which "
                                  "this runner does not provide")  # fmt: skip
            env[var["name"]] = fields[path]
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secret_value(objects, ref["name"], ref["key"])
        elif "resourceFieldRef" in source:
            raise CheckFailed(f"{pod.name}: env {var['name']} reads a resource field")
        else:
            raise CheckFailed(f"{pod.name}: env {var['name']}: unsupported source {source}")
    return env


def security_args(pod: Pod, container: Manifest) -> list[str]:
    pod_ctx = pod.spec.get("securityContext", {})
    ctx = {**{k: v for k, v in pod_ctx.items() if k in ("runAsUser", "runAsGroup",
                                                         "runAsNonRoot")},
           **container.get("securityContext", {})}  # fmt: skip
    # --passwd=false: the kubelet adds no /etc/passwd entry for a uid the image lacks.
    args: list[str] = ["--passwd=false"]
    user, group = ctx.get("runAsUser"), ctx.get("runAsGroup")
    if user is not None:
        args += ["--user", f"{user}:{group}" if group is not None else str(user)]
    if ctx.get("runAsNonRoot") and user in (None, 0):
        raise CheckFailed(f"{pod.name}: runAsNonRoot without a non-zero runAsUser")
    if "fsGroup" in pod_ctx:
        args += ["--group-add", str(pod_ctx["fsGroup"])]
    if ctx.get("readOnlyRootFilesystem"):
        # podman's --read-only adds its own tmpfs on /tmp, /run and /var/tmp; the kubelet
        # adds none, so neither does this (the chart mounts /tmp itself).
        args += ["--read-only", "--read-only-tmpfs=false"]
    if ctx.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    caps = ctx.get("capabilities", {})
    args += [a for cap in caps.get("drop", []) for a in ("--cap-drop", cap)]
    args += [a for cap in caps.get("add", []) for a in ("--cap-add", cap)]
    return args


def cpu_count(quantity: str) -> float:
    return float(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def memory_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6,
             "G": 10**9, "T": 10**12}  # fmt: skip
    for suffix, scale in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * scale)
    return int(quantity)


def resource_args(container: Manifest) -> list[str]:
    limits = container.get("resources", {}).get("limits", {})
    args: list[str] = []
    if "cpu" in limits:  # podman refuses more CPUs than the machine has
        args += ["--cpus", f"{min(cpu_count(str(limits['cpu'])), os.cpu_count() or 1):g}"]
    if "memory" in limits:
        args += ["--memory", str(memory_bytes(str(limits["memory"])))]
    return args


def volume_mounts(pod: Pod, container: Manifest, release: str) -> list[tuple[str, str, str]]:
    """(podman volume, mount path, ro|rw) for each of the container's mounts: an emptyDir is
    the pod's own volume, a claim one volume every pod shares."""
    volumes = {v["name"]: v for v in pod.spec.get("volumes", [])}
    out: list[tuple[str, str, str]] = []
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "emptyDir" in volume:
            name = f"{pod.name}--{mount['name']}"
        elif "persistentVolumeClaim" in volume:
            name = f"{release}--pvc--{volume['persistentVolumeClaim']['claimName']}"
        else:
            kinds = sorted(set(volume) - {"name"})
            raise CheckFailed(f"{pod.name}: volume {mount['name']} is {kinds}: this runner "
                              "mounts emptyDir and persistentVolumeClaim volumes")  # fmt: skip
        if mount.get("subPath"):
            raise CheckFailed(f"{pod.name}: subPath mounts are not supported here")
        out.append((name, mount["mountPath"], "ro" if mount.get("readOnly") else "rw"))
    return out


# ------------------------------------------------------------------------------ runner


@dataclass
class Cluster:
    objects: list[Manifest]
    pods: list[Pod]
    image: str
    release: str
    namespace: str
    network: str
    started: list[str] = field(default_factory=list)
    volumes: list[str] = field(default_factory=list)
    mount_points: dict[str, list[str]] = field(default_factory=dict)

    def pod(self, name: str) -> Pod:
        return next(p for p in self.pods if p.name == name)

    def of_role(self, role: str) -> list[Pod]:
        return [p for p in self.pods if p.role == role]

    # -- volumes
    def volume_args(self, pod: Pod, container: Manifest) -> list[str]:
        args: list[str] = []
        for name, path, mode in volume_mounts(pod, container, self.release):
            if name not in self.volumes:
                podman("volume", "create", name)
                self.volumes.append(name)
                # The kubelet makes an emptyDir world-writable (0777).
                point = podman("volume", "inspect", "--format", "{{.Mountpoint}}", name).strip()
                os.chmod(point, 0o777)
            args += ["--volume", f"{name}:{path}:{mode}"]
        self.mount_points[pod.container_name(container)] = [
            path for _, path, _ in volume_mounts(pod, container, self.release)
        ]
        return args

    def run_args(self, pod: Pod, container: Manifest, *, init: bool) -> list[str]:
        if pod.spec.get("automountServiceAccountToken", True):
            raise CheckFailed(f"{pod.name}: automountServiceAccountToken is not false: the "
                              "chart promises no token in its pods")  # fmt: skip
        env = container_env(container, pod, self.objects, self.namespace)
        args = ["--name", pod.container_name(container), "--hostname", pod.name,
                "--network", self.network]  # fmt: skip
        if not init:
            args += ["--ip", pod.ip]
            args += [a for alias in pod.aliases for a in ("--network-alias", alias)]
        args += security_args(pod, container) + resource_args(container)
        args += self.volume_args(pod, container)
        for name, value in env.items():
            args += ["--env", f"{name}={value}"]
        image = container["image"]  # the local values name the local images
        if container.get("command"):
            command = [expand(c, env) for c in container["command"]]
            args += ["--entrypoint", json.dumps(command)]
        return [*args, image, *(expand(a, env) for a in container.get("args", []))]

    def run_init(self, pod: Pod) -> None:
        for container in pod.init:
            name = pod.container_name(container)
            log(f"{pod.name}: init container {container['name']} ...")
            began = time.monotonic()
            podman("run", *self.run_args(pod, container, init=True), timeout=900)
            self.started.append(name)
            log(f"{pod.name}: init container {container['name']} done in "
                f"{time.monotonic() - began:.0f} s")  # fmt: skip

    def init_then_start(self, pod: Pod) -> None:
        self.run_init(pod)
        self.start(pod)

    def start(self, pod: Pod) -> None:
        for container in pod.main:
            podman("run", "--detach", *self.run_args(pod, container, init=False))
            self.started.append(pod.container_name(container))

    # -- probes, run from this host as the kubelet's are
    def probe_once(self, pod: Pod, container: Manifest, probe: Manifest) -> str | None:
        """None when the probe passes, else why not."""
        timeout = float(probe.get("timeoutSeconds", 1))
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", []) if "name" in p}
        if "grpc" in probe:
            import grpc
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            port = probe["grpc"]["port"]
            with grpc.insecure_channel(f"{pod.ip}:{port}") as channel:
                try:
                    reply = health_pb2_grpc.HealthStub(channel).Check(
                        health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                        timeout=timeout)  # fmt: skip
                except grpc.RpcError as exc:
                    return f"gRPC health {port}: {exc.code().name}"
            return None if reply.status == health_pb2.HealthCheckResponse.SERVING else (
                f"gRPC health {port}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")  # fmt: skip
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = ports.get(get["port"], get["port"])
            url = f"{get.get('scheme', 'HTTP').lower()}://{pod.ip}:{port}{get.get('path', '/')}"
            try:
                with urllib.request.urlopen(url, timeout=timeout) as response:
                    return None if 200 <= response.status < 400 else f"{url}: {response.status}"
            except OSError as exc:
                return f"{url}: {exc}"
        if "tcpSocket" in probe:
            import socket

            port = ports.get(probe["tcpSocket"]["port"], probe["tcpSocket"]["port"])
            try:
                socket.create_connection((pod.ip, int(port)), timeout=timeout).close()
            except OSError as exc:
                return f"tcp {port}: {exc}"
            return None
        if "exec" in probe:
            completed = subprocess.run(
                ["podman", "exec", pod.container_name(container), *probe["exec"]["command"]],
                capture_output=True, text=True, timeout=timeout + 10, check=False)  # fmt: skip
            return None if completed.returncode == 0 else f"exec: exit {completed.returncode}"
        raise CheckFailed(f"{pod.name}: a probe of a kind this runner does not know: {probe}")

    def wait_probe(self, pod: Pod, container: Manifest, kind: str) -> None:
        """Runs a probe as the kubelet does: every periodSeconds, failing after
        failureThreshold consecutive failures (the initial delay first)."""
        probe = container.get(kind)
        if probe is None:
            return
        time.sleep(float(probe.get("initialDelaySeconds", 0)))
        period = float(probe.get("periodSeconds", 10))
        threshold = int(probe.get("failureThreshold", 3))
        why = None
        for _ in range(threshold):
            why = self.probe_once(pod, container, probe)
            if why is None:
                return
            state = podman("inspect", "--format", "{{.State.Status}}",
                           pod.container_name(container), check=False).strip()  # fmt: skip
            if state not in ("running", "created"):
                break
            time.sleep(period)
        logs = podman("logs", "--tail", "30", pod.container_name(container), check=False,
                      stderr=subprocess.STDOUT)  # fmt: skip
        raise CheckFailed(f"{pod.name}: {kind} failed: {why}\n--- its last log lines:\n{logs}")

    def wait_ready(self, pod: Pod) -> None:
        for container in pod.main:
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                self.wait_probe(pod, container, kind)
            log(f"{pod.name}: startup, readiness and liveness probes pass")

    # -- teardown
    def remove(self) -> None:
        for name in reversed(self.started):
            podman("rm", "--force", "--time", "2", name, check=False)
        for name in self.volumes:
            podman("volume", "rm", "--force", name, check=False)
        podman("network", "rm", "--force", self.network, check=False)


def in_parallel(work: Callable[[Pod], None], pods: list[Pod]) -> None:
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(pods))) as pool:
        for future in [pool.submit(work, pod) for pod in pods]:
            future.result()


# ------------------------------------------------------------------------------ checks


# Files podman itself bind-mounts into every container (the kubelet mounts the same three
# /etc files): their mount targets, and a directory above them marked changed, are podman's.
PODMAN_MOUNTS = ("/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/run/.containerenv")


def written_outside(changes: list[tuple[str, str]], mounts: list[str]) -> list[str]:
    """Of `podman diff`'s (kind, path) lines, those outside the container's volumes."""
    points = [m.rstrip("/") for m in (*mounts, *PODMAN_MOUNTS)]

    def allowed(kind: str, path: str) -> bool:
        if any(path == m or path.startswith(m + "/") for m in points):
            return True
        # A directory above a mount point shows as changed when its target was made.
        return kind == "C" and any(m.startswith(path.rstrip("/") + "/") for m in points)

    return [f"{kind} {path}" for kind, path in changes if not allowed(kind, path)]


def check_written_only_to_volumes(cluster: Cluster, name: str) -> None:
    """`podman diff`: nothing the container wrote may lie outside its mounted volumes."""
    lines = [line.split(maxsplit=1) for line in podman("diff", name).splitlines() if line]
    outside = written_outside([(kind, path) for kind, path in lines],
                              cluster.mount_points.get(name, []))  # fmt: skip
    if outside:
        raise CheckFailed(f"{name} wrote outside its volumes: {outside}")


def check_user_and_root(cluster: Cluster, pod: Pod, uid: int) -> None:
    for container in pod.main:
        name = pod.container_name(container)
        seen = podman("exec", name, "id", "-u").strip()
        if seen != str(uid):
            raise CheckFailed(f"{name} runs as uid {seen}, not {uid}")
        readonly = podman("inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", name).strip()
        probe = subprocess.run(["podman", "exec", name, "touch", "/pdserve-probe"],
                               capture_output=True, check=False)  # fmt: skip
        if readonly != "true" or probe.returncode == 0:
            raise CheckFailed(f"{name}: the root filesystem is writable")
        token = subprocess.run(["podman", "exec", name, "test", "-e",
                                "/var/run/secrets/kubernetes.io/serviceaccount/token"],
                               check=False)  # fmt: skip
        if token.returncode == 0:
            raise CheckFailed(f"{name} holds a service-account token")


def check_kernels_prebuilt(cluster: Cluster, pod: Pod) -> str:
    """The image's C++ kernels load in the pod as its uid, from the image, with no compiler
    there to build them: imported, never compiled, at run time. Returns the build's path."""
    name = pod.container_name(pod.main[0])
    compilers = subprocess.run(["podman", "exec", name, "sh", "-c", "command -v g++ c++ cc"],
                               capture_output=True, text=True, check=False)  # fmt: skip
    if compilers.stdout.strip():
        raise CheckFailed(f"{name} has a compiler: {compilers.stdout.split()}")
    loaded = podman("exec", name, "python", "-c",
                    "from kernels.cpu import load; print(load().__file__)").strip()  # fmt: skip
    if not loaded.startswith("/opt/pdserve/kernels/"):
        raise CheckFailed(f"{name} loads its kernels from {loaded}, not the image's build")
    return loaded


def gateway_target(cluster: Cluster) -> tuple[Pod, str]:
    pod = cluster.of_role("gateway")[0]
    port = next(p["containerPort"] for p in pod.main[0]["ports"] if p["name"] == "grpc")
    return pod, f"{pod.ip}:{port}"


def run_in_network(cluster: Cluster, args: list[str], timeout: float = 300) -> str:
    """A one-off pdserve command from the image on the pods' network (as a client pod)."""
    return podman("run", "--rm", "--network", cluster.network, "--user", "10001:10001",
                  "--read-only", "--read-only-tmpfs=false", "--tmpfs", "/cache",
                  cluster.image, *args, timeout=timeout)  # fmt: skip


def check_status(cluster: Cluster) -> None:
    gateway = cluster.of_role("gateway")[0]
    service = next(a for a in gateway.aliases if a.endswith(".svc.cluster.local"))
    port = next(p["containerPort"] for p in gateway.main[0]["ports"] if p["name"] == "grpc")
    text = run_in_network(cluster, ["--log-level", "WARNING", "status", "--target",
                                    f"{service}:{port}", "--json"])  # fmt: skip
    listed = json.loads(text)
    log("pdserve status --json:\n" + json.dumps(listed, indent=1)[:3000])
    blob = json.dumps(listed)
    missing = [p.name for p in cluster.pods
               if p.role in ("prefill", "decode", "gateway", "blockstore") and p.name not in blob]
    if missing:
        raise CheckFailed(f"pdserve status does not list {missing}")


async def kill_midway(cluster: Cluster, max_tokens: int) -> tuple[list[int], list[int], str]:
    """The same greedy stream twice through the gateway, from this host: undisturbed, then
    with the decode container serving it killed after a quarter of its tokens."""
    from common.contract.sampling import SamplingParams
    from pdserve.client import GatewayClient

    _, target = gateway_target(cluster)
    prompt = "Write a long story about a lighthouse keeper and the sea."
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    decodes = {p.name: p for p in cluster.of_role("decode")}
    client = GatewayClient(target)
    try:
        reference = (await client.complete(prompt=prompt, sampling=sampling)).token_ids
        tokens: list[int] = []
        victim = ""
        async for message in client.stream(prompt=prompt, sampling=sampling):
            tokens += list(message.token_ids)
            if not victim and len(tokens) >= max_tokens // 4:
                status = await client.cluster_status()
                busy = [w.worker_id for w in status.workers
                        if w.worker_id in decodes and w.num_running_requests > 0]  # fmt: skip
                if len(busy) != 1:
                    raise CheckFailed(f"expected one decode pod serving the stream, saw {busy}")
                victim = busy[0]
                podman("kill", decodes[victim].container_name(decodes[victim].main[0]))
                log(f"killed {victim} (podman kill) after {len(tokens)} tokens")
    finally:
        await client.close()
    return reference, tokens, victim


def check_decode_kill(cluster: Cluster, max_tokens: int) -> None:
    if len(cluster.of_role("decode")) < 2:
        log("one decode pod: the decode-kill check needs two (--set decode.replicas=2)")
        return
    reference, again, victim = asyncio.run(kill_midway(cluster, max_tokens))
    if not victim:
        raise CheckFailed("the stream ended before a decode container was killed")
    if again != reference:
        first = next((i for i, (a, b) in enumerate(zip(again, reference, strict=False)) if a != b),
                     min(len(again), len(reference)))  # fmt: skip
        raise CheckFailed(f"after killing {victim} the stream differs from the undisturbed "
                          f"one at token {first} ({len(again)} against {len(reference)} tokens)")
    log(f"decode kill: the stream went on after {victim} died: {len(again)} tokens, the "
        "undisturbed stream's")


# ------------------------------------------------------------------------------- main


def local_values(image: str, redis_image: str) -> dict[str, Any]:
    repository, _, tag = image.rpartition(":")
    redis_repository, _, redis_tag = redis_image.rpartition(":")
    return {
        "image": {"repository": repository, "tag": tag, "pullPolicy": "Never"},
        "redis": {
            "image": {"repository": redis_repository, "tag": redis_tag, "pullPolicy": "Never"}
        },
        # One gateway and one thread a worker: a 2-core machine runs every pod.
        "gateway": {"autoscaling": {"enabled": False}, "replicas": 1},
        "prefill": {"replicas": 1, "threads": 1},
        "decode": {"replicas": 2, "threads": 1},
    }


@contextlib.contextmanager
def running(cluster: Cluster, keep: bool) -> Iterator[Cluster]:
    podman("network", "rm", "--force", cluster.network, check=False)
    subnet = cluster.pods[0].ip.rsplit(".", 1)[0]
    podman("network", "create", "--subnet", f"{subnet}.0/24", cluster.network)
    try:
        yield cluster
    finally:
        if keep:
            log(f"--keep: containers left running on network {cluster.network}")
        else:
            cluster.remove()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--image", default="localhost/pdserve:0.1.0")
    parser.add_argument("--redis-image", default="localhost/pdserve-redis:bookworm")
    parser.add_argument("--release", default="demo")
    parser.add_argument("--namespace", default="llm")
    parser.add_argument("--subnet", default="10.89.77", help="the pods' /24 (first 3 octets)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="chart values over the local ones (helm's --set)")
    parser.add_argument("--kill-tokens", type=int, default=128,
                        help="tokens of the decode-kill check's stream (0: skip the check)")
    parser.add_argument("--keep", action="store_true", help="leave the containers running")
    args = parser.parse_args(argv)

    values = deep_merge(local_values(args.image, args.redis_image), parse_set(args.set))
    objects = render(values, args.release, args.namespace)
    pods = pods_of(objects, args.subnet)
    attach_services(objects, pods, args.namespace)
    cluster = Cluster(objects, pods, args.image, args.release, args.namespace,
                      network=f"pdserve-{args.release}")  # fmt: skip
    test_pods = [p for p in pods if p.role == "test"]
    serving = [p for p in pods if p.role != "test"]
    log("pods: " + ", ".join(f"{p.name} ({p.ip})" for p in pods))
    began = time.monotonic()
    answers: list[str] = []
    with running(cluster, args.keep):
        # The kubelet starts every pod at once; a pod's init containers run first.
        order = {"redis": 0, "blockstore": 1}
        for pod in sorted(serving, key=lambda p: order.get(p.role, 2)):
            if not pod.init:
                cluster.start(pod)
        in_parallel(cluster.init_then_start, [p for p in serving if p.init])
        in_parallel(cluster.wait_ready, serving)
        log(f"every pod ready {time.monotonic() - began:.0f} s after the start")
        for pod in test_pods:  # `helm test`
            cluster.run_init(pod)
            for container in pod.main:
                output = podman("run", *cluster.run_args(pod, container, init=False), timeout=600)
                cluster.started.append(pod.container_name(container))
                log(f"{pod.name} answered: {output.strip()!r}")
                if not output.strip():
                    raise CheckFailed(f"{pod.name} printed nothing")
                answers.append(output.strip())
        check_status(cluster)
        for pod in serving:
            uid = pod.spec.get("securityContext", {}).get("runAsUser")
            check_user_and_root(cluster, pod, uid)
        for pod in cluster.of_role("prefill") + cluster.of_role("decode"):
            built = check_kernels_prebuilt(cluster, pod)
        log(f"the engine pods load the image's C++ kernels ({built}); no compiler in the image")
        for name in cluster.started:
            check_written_only_to_volumes(cluster, name)
        log(f"{len(cluster.started)} containers: each as its pod's uid, a read-only root, no "
            "token, nothing written outside its volumes")  # fmt: skip
        if args.kill_tokens:
            check_decode_kill(cluster, args.kill_tokens)
    log(f"every check passed in {time.monotonic() - began:.0f} s; the chart's test pod answered:")
    print("\n".join(answers), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except CheckFailed as failure:
        log(f"FAILED: {failure}")
        sys.exit(1)
