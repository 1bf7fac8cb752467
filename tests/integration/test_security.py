"""Strangers turned away, on a real ``pdserve up --mtls`` stack with API keys: redis-server
(TLS only, a password), the block store, a prefill and a decode worker and the gateway,
every internal hop over mutual TLS with certificates from the stack's own CA.

What a refused peer observes: a gateway call without a valid key ends UNAUTHENTICATED
(ErrorInfo reason UNAUTHENTICATED); a plaintext client, a client without a certificate and
one with a certificate from another CA all fail the TLS handshake on a worker's or the block
store's port, which the client sees as UNAVAILABLE ("failed to connect to all addresses ...
Socket closed") and the server logs as "Handshake failed". Redis refuses a client without
the password (AuthenticationError) and a plaintext one (ConnectionError).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.contract.sampling import SamplingParams
from common.rpc.errors import reason_of
from common.rpc.pki import make_ca
from common.rpc.tls import TlsConfig
from pdserve.cli.launcher import StackState, free_port
from pdserve.client import GatewayClient
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.kv.v1 import block_store_pb2, block_store_pb2_grpc
from services.gateway.auth import tenant_cache_salt
from tests.integration.conftest import Stack
from tests.prompts import prompt_with_context

pytestmark = pytest.mark.slow

SHORT = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
KEYS = {"alpha": "key-of-alpha-7c1e", "beta": "key-of-beta-90ad"}


@pytest.fixture(scope="module")
def secure_stack(smollm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed: run scripts/setup_system.sh")
    run_dir = tmp_path_factory.mktemp("secure")
    keys_file = run_dir / "api-keys"
    keys_file.write_text("".join(f"{key} {tenant}\n" for tenant, key in KEYS.items()))
    env = {**os.environ, "PDSERVE_RUN_DIR": str(run_dir), "PDSERVE_LOG_LEVEL": "INFO"}
    port = free_port()
    stack = Stack(f"127.0.0.1:{port}", run_dir, env, smollm_dir)
    started = stack.cli(
        "up", "--detach", "--port", str(port), "--http-port", "0", "--kserve-port", "0", "--prefill", "1", "--decode", "1", "--mtls",
        "--api-keys-file", str(keys_file), "--model", str(smollm_dir),
        "--kv-cache-memory", "128MiB", timeout=900,
    )  # fmt: skip
    if started.returncode != 0:
        pytest.fail(f"pdserve up --mtls failed:\n{started.stdout}\n{started.stderr}")
    try:
        yield stack
    finally:
        stopped = stack.cli("down", timeout=120)
        assert stopped.returncode == 0, stopped.stderr


def state_of(stack: Stack) -> StackState:
    state = StackState.load(stack.run_dir / "stack.json")
    assert state is not None
    return state


def address_of(stack: Stack, name: str) -> str:
    return next(c.address for c in state_of(stack).children if c.name == name)


async def gateway_calls(
    target: str, metadata: tuple[tuple[str, str], ...]
) -> list[grpc.StatusCode]:
    """The status of each GatewayService method called with ``metadata``."""
    codes = []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = gateway_pb2_grpc.GatewayServiceStub(channel)
        calls = [
            stub.GetModelInfo(gateway_pb2.GetModelInfoRequest(), metadata=metadata, timeout=10),
            stub.Tokenize(gateway_pb2.TokenizeRequest(raw_prompt="Hi"), metadata=metadata,
                          timeout=10),
            stub.GetClusterStatus(gateway_pb2.GetClusterStatusRequest(), metadata=metadata,
                                  timeout=10),
        ]  # fmt: skip
        for call in calls:
            try:
                await call
                codes.append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
                assert reason_of(exc) == "UNAUTHENTICATED", exc
        stream = stub.Generate(
            gateway_pb2.GenerateRequest(raw_prompt="Hi", sampling={"max_tokens": 2}),
            metadata=metadata,
            timeout=60,
        )
        try:
            async for _ in stream:
                pass
            codes.append(grpc.StatusCode.OK)
        except grpc.aio.AioRpcError as exc:
            codes.append(exc.code())
            assert "authorization" in (exc.details() or "") or "not valid" in (exc.details() or "")
    return codes


@pytest.mark.parametrize(
    ("name", "metadata"),
    [
        ("no key", ()),
        ("wrong key", (("authorization", "Bearer not-a-key"),)),
        ("not a bearer token", (("authorization", f"Basic {KEYS['alpha']}"),)),
    ],
)
def test_calls_without_a_valid_key_are_unauthenticated(
    secure_stack: Stack, name: str, metadata: tuple[tuple[str, str], ...]
) -> None:
    codes = asyncio.run(gateway_calls(secure_stack.target, metadata))
    assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 4, name


def test_a_valid_key_is_served_and_probes_need_none(secure_stack: Stack) -> None:
    metadata = (("authorization", f"Bearer {KEYS['beta']}"),)
    assert asyncio.run(gateway_calls(secure_stack.target, metadata)) == [grpc.StatusCode.OK] * 4

    async def probes() -> tuple[int, list[str]]:
        async with grpc.aio.insecure_channel(secure_stack.target) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            names: list[str] = []
            async for reply in reflection.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            ):
                names = [s.name for s in reply.list_services_response.service]
            return health.status, names

    status, names = asyncio.run(probes())
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert "pdserve.gateway.v1.GatewayService" in names
    # The CLI takes the key from PDSERVE_API_KEY; every process is reached over mTLS.
    secure_stack.env["PDSERVE_API_KEY"] = KEYS["alpha"]
    try:
        shown = secure_stack.cli("status", "--json", "--target", secure_stack.target, timeout=60)
    finally:
        del secure_stack.env["PDSERVE_API_KEY"]
    assert shown.returncode == 0, shown.stderr
    roles = sorted(w["role"] for w in json.loads(shown.stdout))
    assert roles == ["blockstore", "decode", "gateway", "prefill"]


async def status_over(address: str, credentials: grpc.ChannelCredentials | None) -> str:
    """OK, or the code and details a worker's GetStatus fails with over this channel."""
    channel = (
        grpc.aio.insecure_channel(address)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials)
    )
    async with channel:
        try:
            if "blockstore" in address:
                await block_store_pb2_grpc.BlockStoreServiceStub(channel).GetStatus(
                    block_store_pb2.GetStatusRequest(), timeout=5
                )
            else:
                await decode_pb2_grpc.DecodeServiceStub(channel).GetStatus(
                    decode_pb2.GetStatusRequest(), timeout=5
                )
            return "OK"
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"


def test_internal_ports_refuse_peers_without_a_certificate_of_the_stack_ca(
    secure_stack: Stack, tmp_path: Path
) -> None:
    tls_dir = secure_stack.run_dir / "tls"
    ca = (tls_dir / "ca.pem").read_bytes()
    stranger = make_ca(tmp_path / "other").issue("stranger", tmp_path / "other")
    member = TlsConfig(tls_dir / "launcher.pem", tls_dir / "launcher.key", tls_dir / "ca.pem")
    attempts: dict[str, grpc.ChannelCredentials | None] = {
        "plaintext": None,
        "no client certificate": grpc.ssl_channel_credentials(ca),
        "certificate of another CA": grpc.ssl_channel_credentials(
            ca, stranger.key.read_bytes(), stranger.cert.read_bytes()
        ),
    }
    decode = address_of(secure_stack, "decode-0")
    for name, credentials in attempts.items():
        observed = asyncio.run(status_over(decode, credentials))
        print(f"decode port, {name}: {observed}")
        assert observed.startswith("UNAVAILABLE"), (name, observed)
    assert asyncio.run(status_over(decode, member.channel_credentials())) == "OK"
    assert "Handshake failed" in Path(
        next(c.log for c in state_of(secure_stack).children if c.name == "decode-0")
    ).read_text(errors="replace")


def test_pdserve_health_checks_every_mtls_port_with_a_stack_certificate(
    secure_stack: Stack, tmp_path: Path
) -> None:
    """What the chart's probes run: exit 0 with a certificate of the stack's CA, 2 without
    one or with another CA's."""
    tls_dir = secure_stack.run_dir / "tls"
    member = ["--tls-cert", str(tls_dir / "launcher.pem"), "--tls-key",
              str(tls_dir / "launcher.key"), "--tls-ca", str(tls_dir / "ca.pem")]  # fmt: skip
    stranger = make_ca(tmp_path / "other").issue("stranger", tmp_path / "other")
    strange = ["--tls-cert", str(stranger.cert), "--tls-key", str(stranger.key),
               "--tls-ca", str(tls_dir / "ca.pem")]  # fmt: skip
    for name in ("prefill-0", "decode-0", "blockstore"):
        target = address_of(secure_stack, name)
        checked = secure_stack.cli("health", "--target", target, *member, timeout=60)
        assert checked.returncode == 0, (name, checked.stdout, checked.stderr)
        assert checked.stdout.strip() == f"{target}: SERVING"
        for flags in ([], strange):
            refused = secure_stack.cli("health", "--target", target, *flags, timeout=60)
            assert refused.returncode == 2, (name, flags, refused.stdout, refused.stderr)


def test_redis_wants_the_password_and_a_certificate(secure_stack: Stack) -> None:
    url = state_of(secure_stack).redis_url
    assert url.startswith("rediss://:") and "@127.0.0.1:" in url
    with redis.Redis.from_url(url, socket_timeout=5) as client:
        assert client.ping()
    without_password = url.replace(url[len("rediss://") : url.index("@") + 1], "")
    with (
        pytest.raises(redis.AuthenticationError),
        redis.Redis.from_url(without_password, socket_timeout=5) as client,
    ):
        client.ping()
    plaintext = "redis://" + url[len("rediss://") :].split("?")[0]
    with (
        pytest.raises(redis.ConnectionError),
        redis.Redis.from_url(plaintext, socket_timeout=5, socket_connect_timeout=5) as client,
    ):
        client.ping()


def test_a_tenants_cached_prefix_is_never_another_tenants_hit(secure_stack: Stack) -> None:
    prompt = prompt_with_context(6, 3)  # ~100 tokens: several full blocks, prefilled remotely

    async def cached(tenant: str, cache_salt: str = "") -> int:
        client = GatewayClient(secure_stack.target, api_key=KEYS[tenant])
        try:
            result = await client.complete(
                raw_prompt=prompt, sampling=SHORT, cache_salt=cache_salt, timeout_s=120
            )
        finally:
            await client.close()
        assert result.finish_reason is not None
        return result.cached_tokens

    async def run() -> dict[str, int]:
        return {
            "alpha first": await cached("alpha"),
            "alpha again": await cached("alpha"),
            "beta": await cached("beta"),
            # beta names alpha's derived salt: it is salted again with beta's tenant.
            "beta forging alpha's salt": await cached("beta", tenant_cache_salt("alpha", "") or ""),
            "alpha, salt x": await cached("alpha", "x"),
            "alpha, salt x again": await cached("alpha", "x"),
        }

    seen = asyncio.run(run())
    assert seen["alpha first"] == 0, seen
    assert seen["alpha again"] >= 64, seen  # whole blocks of the shared prefix
    assert seen["beta"] == 0 and seen["beta forging alpha's salt"] == 0, seen
    assert seen["alpha, salt x"] == 0 and seen["alpha, salt x again"] >= 64, seen
