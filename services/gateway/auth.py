"""Gateway authentication: API keys, each naming a tenant, and the tenant's cache salt.

Clients send ``authorization: Bearer KEY`` call metadata. With keys configured, every
GatewayService and AdminService call without a valid key ends UNAUTHENTICATED before its
request is parsed (AdminService then also wants an admin tenant's key: admin.py);
health and reflection stay open (Kubernetes probes, grpcurl). Keys are held as SHA-256
digests, so a lookup takes the same time whichever key is tried.

The tenant becomes the prefix-cache salt (``tenant_cache_salt``): the salt the workers hash
with (``extra_keys``, common/kv/hashing.py) is derived from the tenant *and* the client's
``cache_salt``, injectively, so no client-chosen salt can name another tenant's blocks.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from common.errors import UnauthenticatedError
from common.rpc.errors import abort

GUARDED_PREFIX = "/pdserve.gateway.v1."  # GatewayService and AdminService
SCHEME = "bearer"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def key_tenant(key: str) -> str:
    """The tenant of a key given without one (``--api-key``): named after its fingerprint."""
    return f"key-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


@dataclass(frozen=True)
class ApiKeys:
    tenants: Mapping[bytes, str]  # SHA-256 of the key -> tenant

    def __post_init__(self) -> None:
        if not self.tenants:
            raise ValueError("no API keys given")

    @classmethod
    def load(cls, keys: Sequence[str] = (), keys_file: str | None = None) -> ApiKeys | None:
        """From ``--api-key KEY`` flags (each its own tenant) and an ``--api-keys-file`` of
        ``KEY TENANT`` lines (``#`` comments; a line with a key alone is its own tenant).
        None when neither is given: authentication is off."""
        pairs = [(k, key_tenant(k)) for k in keys]
        if keys_file:
            pairs += parse_keys_file(Path(keys_file).read_text())
        if not pairs:
            return None
        tenants: dict[bytes, str] = {}
        for key, tenant in pairs:
            if not key:
                raise ValueError("an API key is empty")
            tenants[_digest(key)] = tenant
        return cls(tenants)

    def tenant_of(self, metadata: Iterable[tuple[str, Any]] | None) -> str:
        """The caller's tenant, from its ``authorization`` metadata; UnauthenticatedError
        when it has none or an unknown key."""
        values = [v for k, v in metadata or () if k == "authorization"]
        if not values:
            raise UnauthenticatedError(
                "this gateway requires an API key: send the call metadata "
                "'authorization: Bearer <key>'"
            )
        value = values[0] if isinstance(values[0], str) else values[0].decode(errors="replace")
        scheme, _, key = value.strip().partition(" ")
        if scheme.lower() != SCHEME or not key.strip():
            raise UnauthenticatedError("the authorization metadata must read 'Bearer <key>'")
        tenant = self.tenants.get(_digest(key.strip()))
        if tenant is None:
            raise UnauthenticatedError("the API key is not valid")
        return tenant


def parse_keys_file(text: str) -> list[tuple[str, str]]:
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        if len(fields) > 2:
            raise ValueError(f"API keys file line {number}: expected 'KEY [TENANT]'")
        key = fields[0]
        pairs.append((key, fields[1] if len(fields) == 2 else key_tenant(key)))
    return pairs


def tenant_cache_salt(tenant: str | None, client_salt: str) -> str | None:
    """The salt the workers hash a request's blocks with. Without authentication: the
    client's salt (None = the shared cache). With it: a JSON pair of tenant and client
    salt, injective in both, so tenants never share blocks with each other nor with
    unsalted requests, and a tenant's requests with one client salt share among
    themselves."""
    if tenant is None:
        return client_salt or None
    return json.dumps([tenant, client_salt], ensure_ascii=False, separators=(",", ":"))


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Ends unauthenticated calls of the guarded services with UNAUTHENTICATED, unparsed."""

    def __init__(
        self,
        keys: ApiKeys,
        on_reject: Callable[[], None] = lambda: None,
        guarded: str = GUARDED_PREFIX,
        open_methods: frozenset[str] = frozenset(),
    ) -> None:
        """``guarded``: the method prefix that needs a key; ``open_methods``: full method
        names under it that do not (a protocol's liveness checks)."""
        self.keys = keys
        self.on_reject = on_reject
        self.guarded = guarded
        self.open_methods = open_methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if (
            handler is None
            or not details.method.startswith(self.guarded)
            or details.method in self.open_methods
        ):
            return handler
        try:
            self.keys.tenant_of(details.invocation_metadata)
        except UnauthenticatedError as exc:
            self.on_reject()
            return _refusal(handler, exc)
        return handler


def _refusal(handler: grpc.RpcMethodHandler, error: UnauthenticatedError) -> Any:
    """The handler, answering ``error`` without parsing the request."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await abort(context, error)

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, error)
        yield  # an async generator, as the streaming handlers it stands for

    async def refuse_bidi(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, error)
        yield  # as refuse_stream

    ignore_bytes = handler._replace(request_deserializer=lambda data: None)
    if handler.unary_unary is not None:
        return ignore_bytes._replace(unary_unary=refuse)
    if handler.unary_stream is not None:
        return ignore_bytes._replace(unary_stream=refuse_stream)
    if handler.stream_stream is not None:
        return ignore_bytes._replace(stream_stream=refuse_bidi)
    raise AssertionError(f"no client-streaming method is guarded: {handler}")
