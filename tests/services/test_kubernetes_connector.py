"""The planner's KubernetesConnector against a recorded kube-apiserver exchange.

A local HTTPS server replays ``recordings/kube_apiserver_deployment_scale.json``: it
answers the recorded responses in order and keeps every request it receives. The connector
runs as it does in the planner's pod (in-cluster config: the API server from
KUBERNETES_SERVICE_HOST/PORT, the service-account token and CA from their files, here
pointed at a test CA's files), and each test asserts that it sent exactly the recorded
requests (method, path, query, the headers recorded, body) in order and read the answers.

Where the recording comes from. No cluster was at hand, so it is reconstructed from the
Kubernetes sources rather than captured, each part from the code that produces it:

- requests: what kubernetes-client/python 37.0.2 sends for ``read_namespaced_deployment_scale``
  and ``patch_namespaced_deployment_scale`` (``AppsV1Api``; Accept application/json, the
  in-cluster loader's ``bearer`` token); the patch is the one ``kubectl scale`` sends
  (k8s.io/kubectl/pkg/scale ``ScaleSimple``: ``{"spec":{"replicas":N}}`` as
  ``application/merge-patch+json``), and the connector confirms the bytes by sending them;
- Scale answers: ``scaleFromDeployment`` (pkg/registry/apps/deployment/storage/storage.go)
  fills metadata with name, namespace, uid, resourceVersion and creationTimestamp only,
  spec.replicas from the Deployment and status.replicas/selector from its status and
  selector (``labels.Selector.String()``: requirements sorted by key); autoscaling/v1
  ``ScaleSpec.replicas`` is ``omitempty``, so a Deployment at 0 answers ``"spec": {}``,
  while ``ScaleStatus.replicas`` is not; a PATCH answers the new spec with the old status
  (the Deployment controller has not acted yet) and a new resourceVersion;
- errors: the metav1.Status of ``apierrors.NewNotFound`` for the Deployment
  (``deployments.apps "NAME" not found``, details kind ``deployments``) and of
  ``responsewriters.Forbidden`` (staging/src/k8s.io/apiserver/.../responsewriters/errors.go:
  ``User %q cannot %s resource %q in API group %q in the namespace %q``, no RBAC reason,
  ``X-Content-Type-Options: nosniff``), fields in Go's struct order;
- headers: those the apiserver's filter chain sets on every answer (Audit-Id,
  ``Cache-Control: no-cache, private``, the priority-and-fairness UIDs; APF runs before
  authorization, so 403s carry them too). Date and Content-Length come from the replay
  server; the apiserver sends no Server header, nor does the replay.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import ssl
import threading
from collections.abc import Awaitable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import pytest
from kubernetes import client
from kubernetes.config import incluster_config

from common.planner.types import Split
from common.rpc.tls import TlsConfig
from services.planner.connectors import ConnectorError
from services.planner.connectors.kubernetes import KubernetesConnector, load_configuration

T = TypeVar("T")

RECORDING = json.loads(
    (Path(__file__).parent / "recordings" / "kube_apiserver_deployment_scale.json").read_text()
)
EXCHANGES: dict[str, list[dict[str, Any]]] = RECORDING["exchanges"]
NAMESPACE: str = RECORDING["namespace"]
PREFILL: str = RECORDING["deployments"]["prefill"]
DECODE: str = RECORDING["deployments"]["decode"]
# The request headers the recording holds; any other (Host, Content-Length, ...) is the
# HTTP library's business.
RECORDED_HEADERS = ("Accept", "Authorization", "Content-Type", "User-Agent")


class ReplayServer:
    """Answers ``exchange``'s responses in order and keeps every request it receives.
    A request past the end of the recording gets a 500 (and is kept, so the test fails)."""

    def __init__(self, exchange: list[dict[str, Any]], tls: TlsConfig | None) -> None:
        self._responses = [entry["response"] for entry in exchange]
        self.received: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.cert, tls.key)
            self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> ReplayServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def _answer(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            index = len(self.received)
            self.received.append(request)
        if index < len(self._responses):
            return self._responses[index]
        return {"status": 500, "headers": {"Content-Type": "application/json"},
                "body": {"message": f"request {index + 1} is past the recording"}}  # fmt: skip

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the apiserver and urllib3 use

            def do_GET(self) -> None:
                self._replay()

            def do_PATCH(self) -> None:
                self._replay()

            def _replay(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                url = urlsplit(self.path)
                response = server._answer({
                    "method": self.command,
                    "path": url.path,
                    "query": url.query,
                    "headers": {k: self.headers[k] for k in RECORDED_HEADERS if k in self.headers},
                    "body": json.loads(raw) if raw else None,
                })  # fmt: skip
                # The apiserver's JSON serializer: compact, one trailing newline.
                body = (json.dumps(response["body"], separators=(",", ":")) + "\n").encode()
                self.send_response_only(response["status"])
                self.send_header("Date", self.date_time_string())
                for name, value in response["headers"].items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        return Handler


def requests_of(name: str) -> list[dict[str, Any]]:
    return [entry["request"] for entry in EXCHANGES[name]]


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout=60)

    return asyncio.run(bounded())


@pytest.fixture
def in_cluster(
    pki: dict[str, TlsConfig], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    """Starts a replay of one exchange (``in_cluster(name)``) over TLS and points the
    in-cluster config at it, as the kubelet points a pod at the API server."""
    token = tmp_path / "token"
    token.write_text(RECORDING["service_account_token"])  # the kubelet writes no newline
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(pki["server"].ca))
    servers: list[ReplayServer] = []

    def start(name: str) -> ReplayServer:
        server = ReplayServer(EXCHANGES[name], pki["server"]).__enter__()
        servers.append(server)
        monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
        monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(server.port))
        return server

    yield start
    for server in servers:
        server.__exit__(None, None, None)


def connector(kubeconfig: str | None = None) -> KubernetesConnector:
    return KubernetesConnector.connect(
        namespace=NAMESPACE, prefill_deployment=PREFILL, decode_deployment=DECODE,
        kubeconfig=kubeconfig,
    )  # fmt: skip


def test_current_reads_both_deployments_through_their_scale(in_cluster: Any) -> None:
    server = in_cluster("read_the_split")
    planner = connector()
    try:
        assert run(planner.current()) == Split(prefill=1, decode=2)
    finally:
        planner.close()
    assert server.received == requests_of("read_the_split")


def test_apply_grows_decode_before_it_shrinks_prefill(in_cluster: Any) -> None:
    server = in_cluster("move_a_prefill_worker_to_decode_colocated")
    planner = connector()
    try:
        run(planner.apply(Split(prefill=0, decode=3)))
    finally:
        planner.close()
    assert server.received == requests_of("move_a_prefill_worker_to_decode_colocated")
    methods = [(r["method"], r["path"].split("/")[-2]) for r in server.received]
    assert methods == [("GET", PREFILL), ("GET", DECODE), ("PATCH", DECODE), ("PATCH", PREFILL)]


def test_apply_of_the_split_in_force_writes_nothing(in_cluster: Any) -> None:
    server = in_cluster("read_the_split")
    planner = connector()
    try:
        run(planner.apply(Split(prefill=1, decode=2)))
    finally:
        planner.close()
    assert server.received == requests_of("read_the_split")  # two GETs, no PATCH


def test_a_deployment_at_zero_answers_an_empty_spec_and_reads_as_zero(in_cluster: Any) -> None:
    server = in_cluster("read_the_colocated_split")
    planner = connector()
    try:
        assert run(planner.current()) == Split(prefill=0, decode=3)
    finally:
        planner.close()
    assert server.received == requests_of("read_the_colocated_split")


def test_decode_scaled_to_zero_is_no_split(in_cluster: Any) -> None:
    in_cluster("read_decode_scaled_to_zero")
    planner = connector()
    try:
        with pytest.raises(ConnectorError, match=rf"{NAMESPACE}/{DECODE} is scaled to 0"):
            run(planner.current())
    finally:
        planner.close()


def test_a_missing_deployment_is_named_with_the_flag_that_names_it(in_cluster: Any) -> None:
    server = in_cluster("deployment_not_found")
    planner = connector()
    try:
        with pytest.raises(ConnectorError) as error:
            run(planner.apply(Split(prefill=1, decode=2)))
    finally:
        planner.close()
    assert server.received == requests_of("deployment_not_found")  # nothing after the 404
    message = str(error.value)
    assert f"Deployment {NAMESPACE}/{PREFILL} not found" in message
    assert "--prefill-deployment" in message
    assert f'deployments.apps "{PREFILL}" not found' in message  # the API server's words


@pytest.mark.parametrize(
    ("exchange", "split", "verb", "deployment"),
    [
        ("get_forbidden", Split(prefill=1, decode=2), "get", PREFILL),
        ("patch_forbidden", Split(prefill=1, decode=3), "patch", DECODE),
    ],
)
def test_a_403_names_the_verb_and_resource_the_role_lacks(
    in_cluster: Any, exchange: str, split: Split, verb: str, deployment: str
) -> None:
    server = in_cluster(exchange)
    planner = connector()
    try:
        with pytest.raises(ConnectorError) as error:
            run(planner.apply(split))
    finally:
        planner.close()
    assert server.received == requests_of(exchange)
    message = str(error.value)
    assert (
        f"lacks verb '{verb}' on resource 'deployments/scale' in API group 'apps' for "
        f"resourceNames [{deployment}] in namespace {NAMESPACE}"
    ) in message
    assert (
        f'User "system:serviceaccount:{NAMESPACE}:demo-pdserve-planner" cannot {verb} '
        f'resource "deployments/scale"'
    ) in message


def test_an_unreachable_api_server_is_named(
    in_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    in_cluster("read_the_split")
    with socket.socket() as probe:  # a port that nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(port))
    planner = connector()
    try:
        with pytest.raises(
            ConnectorError,
            match=rf"cannot reach the Kubernetes API server at https://127\.0\.0\.1:{port} "
            rf"to get deployments/scale of {NAMESPACE}/{PREFILL}",
        ):
            run(planner.current())
    finally:
        planner.close()


def test_a_kubeconfig_outside_a_pod(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    expected = copy.deepcopy(requests_of("read_the_split"))
    for request in expected:  # kubeconfig tokens go out as "Bearer", the pod's as "bearer"
        request["headers"]["Authorization"] = "Bearer kubeconfig-token"
    with ReplayServer(EXCHANGES["read_the_split"], tls=None) as server:
        kubeconfig = tmp_path / "config"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "dev",
            "clusters": [{"name": "dev", "cluster": {"server": f"http://127.0.0.1:{server.port}"}}],
            "users": [{"name": "dev", "user": {"token": "kubeconfig-token"}}],
            "contexts": [{"name": "dev", "context": {"cluster": "dev", "user": "dev"}}],
        }))  # fmt: skip
        planner = connector(kubeconfig=str(kubeconfig))
        try:
            assert run(planner.current()) == Split(prefill=1, decode=2)
        finally:
            planner.close()
    assert server.received == expected


def test_missing_credentials_say_where_they_were_looked_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = str(tmp_path / "no-such-kubeconfig")
    with pytest.raises(ConnectorError, match=rf"no Kubernetes credentials from {missing}"):
        load_configuration(missing)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    with pytest.raises(
        ConnectorError, match="no Kubernetes credentials from the pod's service account"
    ):
        load_configuration()


def test_the_two_roles_need_two_deployments() -> None:
    api = client.AppsV1Api(client.ApiClient(client.Configuration()))
    with pytest.raises(ValueError, match="same Deployment"):
        KubernetesConnector(api, namespace=NAMESPACE, prefill_deployment=DECODE,
                            decode_deployment=DECODE)  # fmt: skip
