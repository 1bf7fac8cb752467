"""Applies a split on Kubernetes: the replica counts of the prefill and decode Deployments,
through their scale subresource (``apps/v1 deployments/scale``) and nothing wider.

Only two requests are ever made, as ``kubectl scale`` makes them:

- ``GET  /apis/apps/v1/namespaces/NS/deployments/NAME/scale``, for the count in force;
- ``PATCH`` of the same path with ``{"spec": {"replicas": N}}`` as
  ``application/merge-patch+json`` (``?fieldManager=pdserve-planner``, so the Deployment's
  managedFields name who set its count).

So the Role the chart gives the planner holds ``get`` and ``patch`` on
``deployments/scale`` in group ``apps``, for these two Deployments by name.

The official client is synchronous; every call runs in a worker thread, so the planner's
event loop never waits on the API server. Errors of the environment become
``ConnectorError`` with the fix in the message (the planner logs it and keeps going).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable
from typing import TypeVar

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from common.planner.types import DECODE, PREFILL, Split
from services.planner.connectors import ConnectorError

log = logging.getLogger(__name__)

T = TypeVar("T")

FIELD_MANAGER = "pdserve-planner"
USER_AGENT = "pdserve-planner"
MERGE_PATCH = "application/merge-patch+json"
SCALE_RESOURCE = "deployments/scale"
SCALE_GROUP = "apps"
REQUEST_TIMEOUT_S = 10.0
# One retry covers a keep-alive connection the API server closed between intervals; an
# API server that stays away is the next interval's to retry, not this thread's to wait on.
CONNECT_RETRIES = 1
# Set in every pod by the kubelet; client-go's in-cluster config looks for the same.
IN_CLUSTER_ENV = "KUBERNETES_SERVICE_HOST"


def load_configuration(kubeconfig: str | None = None) -> client.Configuration:
    """The API server and credentials: ``kubeconfig`` when given; else, in a pod, its
    service account (token and CA mounted by the kubelet, re-read as they rotate); else
    the client's default kubeconfig (``KUBECONFIG``, then ``~/.kube/config``)."""
    configuration = client.Configuration()
    try:
        if kubeconfig is None and os.environ.get(IN_CLUSTER_ENV):
            config.load_incluster_config(client_configuration=configuration)
        else:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    except (ConfigException, OSError) as exc:
        where = kubeconfig or (
            "the pod's service account" if os.environ.get(IN_CLUSTER_ENV) else "KUBECONFIG"
        )
        raise ConnectorError(f"no Kubernetes credentials from {where}: {exc}") from exc
    configuration.retries = CONNECT_RETRIES
    return configuration


class KubernetesConnector:
    """Reads and sets the replica counts of one prefill and one decode Deployment."""

    def __init__(
        self,
        api: client.AppsV1Api,
        *,
        namespace: str,
        prefill_deployment: str,
        decode_deployment: str,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        if not (namespace and prefill_deployment and decode_deployment):
            raise ValueError("the namespace and both Deployment names must be given")
        if prefill_deployment == decode_deployment:
            raise ValueError(f"prefill and decode are the same Deployment: {prefill_deployment}")
        self._api = api
        self._namespace = namespace
        self._deployments = {PREFILL: prefill_deployment, DECODE: decode_deployment}
        self._request_timeout_s = request_timeout_s

    @classmethod
    def connect(
        cls,
        *,
        namespace: str,
        prefill_deployment: str,
        decode_deployment: str,
        kubeconfig: str | None = None,
    ) -> KubernetesConnector:
        """A connector on the credentials ``load_configuration`` finds (reads files only;
        the API server is first called by ``current`` or ``apply``)."""
        api_client = client.ApiClient(load_configuration(kubeconfig))
        api_client.user_agent = USER_AGENT
        return cls(
            client.AppsV1Api(api_client),
            namespace=namespace,
            prefill_deployment=prefill_deployment,
            decode_deployment=decode_deployment,
        )

    def close(self) -> None:
        self._api.api_client.close()

    async def current(self) -> Split:
        replicas = await asyncio.to_thread(self._read_replicas)
        if replicas[DECODE] < 1:
            raise ConnectorError(
                f"Deployment {self._where(DECODE)} is scaled to 0: a split needs a decode "
                f"worker (scale it to 1 or more, or let the planner apply a split)"
            )
        return Split(prefill=replicas[PREFILL], decode=replicas[DECODE])

    async def apply(self, split: Split) -> None:
        await asyncio.to_thread(self._apply, split)

    # -- blocking halves, run in a worker thread ---------------------------------------

    def _read_replicas(self) -> dict[str, int]:
        return {role: self._get_replicas(role) for role in (PREFILL, DECODE)}

    def _apply(self, split: Split) -> None:
        wanted = {PREFILL: split.prefill, DECODE: split.decode}
        before = self._read_replicas()
        # The two PATCHes are separate writes. The growing role goes first, so when the second
        # fails (RBAC, the API server gone) the fleet is left larger, not smaller, than both
        # splits; the next apply finishes the move. Neither waits for pods to be ready.
        changes = sorted(
            (role for role in wanted if wanted[role] != before[role]),
            key=lambda role: wanted[role] - before[role],
            reverse=True,
        )
        for role in changes:
            self._patch_replicas(role, wanted[role])
            log.info(
                "scaled Deployment %s from %d to %d replicas",
                self._where(role), before[role], wanted[role],
            )  # fmt: skip

    def _get_replicas(self, role: str) -> int:
        name = self._deployments[role]
        scale = self._call(
            "get",
            role,
            lambda: self._api.read_namespaced_deployment_scale(
                name, self._namespace, _request_timeout=self._request_timeout_s
            ),
        )
        # autoscaling/v1 ScaleSpec.replicas is omitempty: a Deployment at 0 answers "spec": {}.
        return int(scale.spec.replicas or 0) if scale.spec is not None else 0

    def _patch_replicas(self, role: str, replicas: int) -> None:
        name = self._deployments[role]
        self._call(
            "patch",
            role,
            lambda: self._api.patch_namespaced_deployment_scale(
                name,
                self._namespace,
                {"spec": {"replicas": replicas}},
                field_manager=FIELD_MANAGER,
                _content_type=MERGE_PATCH,
                _request_timeout=self._request_timeout_s,
            ),
        )

    def _call(self, verb: str, role: str, request: Callable[[], T]) -> T:
        try:
            return request()
        except ApiException as exc:
            raise self._api_error(exc, verb, role) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # MaxRetryError keeps the cause (refused, timed out, name unknown) in .reason.
            cause = getattr(exc, "reason", None) or exc
            host = self._api.api_client.configuration.host
            raise ConnectorError(
                f"cannot reach the Kubernetes API server at {host} to {verb} "
                f"{SCALE_RESOURCE} of {self._where(role)}: {cause}"
            ) from exc

    def _api_error(self, exc: ApiException, verb: str, role: str) -> ConnectorError:
        said = _status_message(exc)
        name = self._deployments[role]
        if exc.status == 404:
            return ConnectorError(
                f"Deployment {self._where(role)} not found (the {role} Deployment the planner "
                f"was given: --{role}-deployment must name the Deployment the chart rendered); "
                f"API server: {said}"
            )
        if exc.status == 403:
            return ConnectorError(
                f"the planner's Role lacks verb {verb!r} on resource {SCALE_RESOURCE!r} in API "
                f"group {SCALE_GROUP!r} for resourceNames [{name}] in namespace "
                f"{self._namespace} (or no RoleBinding grants it to the planner's "
                f"ServiceAccount); API server: {said}"
            )
        if exc.status == 401:
            return ConnectorError(
                f"the API server refused the planner's credentials (401) to {verb} "
                f"{SCALE_RESOURCE} of {self._where(role)}: an expired or revoked token? "
                f"API server: {said}"
            )
        return ConnectorError(
            f"{verb} {SCALE_RESOURCE} of {self._where(role)} failed: {exc.status} "
            f"{exc.reason}; API server: {said}"
        )

    def _where(self, role: str) -> str:
        return f"{self._namespace}/{self._deployments[role]}"


def _status_message(exc: ApiException) -> str:
    """The message of the metav1.Status the API server answers errors with, else the body."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
    try:
        status = json.loads(body or "")
    except ValueError:
        return (body or str(exc.reason)).strip()
    if isinstance(status, dict) and status.get("message"):
        return str(status["message"])
    return (body or str(exc.reason)).strip()
