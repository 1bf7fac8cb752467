"""``pdserve health`` against real servers in this process: the exit status a probe reads
(0 SERVING, 1 NOT_SERVING, 2 unreachable or refused), over plaintext and mutual TLS,
including a certificate that names the pod's DNS name while the probe dials 127.0.0.1."""

from __future__ import annotations

import asyncio
import sys

import grpc

from common.rpc.server import create_server
from common.rpc.tls import TlsConfig
from pdserve.cli.launcher import free_port
from tests.services.conftest import POD_NAME


def tls_flags(tls: TlsConfig) -> list[str]:
    return ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key), "--tls-ca", str(tls.ca)]


async def health(target: str, *flags: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve", "health", "--target", target, *flags,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, output.decode()


def run(coro: object) -> object:
    return asyncio.run(asyncio.wait_for(coro, timeout=120))  # type: ignore[arg-type]


def test_exit_status_follows_the_servers_health() -> None:
    async def body() -> None:
        server = await create_server("127.0.0.1:0", lambda s: None, [])
        target = f"127.0.0.1:{server.port}"
        try:
            code, output = await health(target)
            assert (code, output.strip()) == (0, f"{target}: SERVING")
            await server.set_serving(False)  # draining
            code, output = await health(target)
            assert (code, output.strip()) == (1, f"{target}: NOT_SERVING")
            code, output = await health(target, "--service", "no.such.Service")
            assert code == 2 and "NOT_FOUND" in output
        finally:
            await server.stop(0)
        code, output = await health(f"127.0.0.1:{free_port()}", "--timeout-s", "0.5")
        assert code == 2 and "UNAVAILABLE" in output

    run(body())


def test_mutual_tls_needs_a_certificate_of_the_stacks_ca(pki: dict[str, TlsConfig]) -> None:
    async def body() -> None:
        server = await create_server(
            "127.0.0.1:0", lambda s: None, [], credentials=pki["server"].server_credentials()
        )
        target = f"127.0.0.1:{server.port}"
        try:
            assert (await health(target, *tls_flags(pki["client"])))[0] == 0
            assert (await health(target))[0] == 2  # plaintext to a TLS port
            assert (await health(target, *tls_flags(pki["stranger"])))[0] == 2
            # Server authentication only (a gateway's public TLS): no client certificate.
            assert (await health(target, "--public-tls-ca", str(pki["server"].ca)))[0] == 2
        finally:
            await server.stop(0)

    run(body())


def test_server_name_checks_a_certificate_issued_for_the_pods_dns_name(
    pki: dict[str, TlsConfig],
) -> None:
    async def body() -> None:
        server = await create_server(
            "127.0.0.1:0", lambda s: None, [], credentials=pki["pod"].server_credentials()
        )
        target = f"127.0.0.1:{server.port}"
        client = tls_flags(pki["client"])
        try:
            code, output = await health(target, *client)
            assert code == 2, output  # the certificate does not name 127.0.0.1
            assert (await health(target, *client, "--server-name", POD_NAME))[0] == 0
            assert (await health(target, *client, "--server-name", "other.svc"))[0] == 2
        finally:
            await server.stop(0)

    run(body())


def test_public_tls_ca_alone_reaches_a_server_authenticated_port(
    pki: dict[str, TlsConfig],
) -> None:
    async def body() -> None:
        server_tls = pki["server"]
        credentials = grpc.ssl_server_credentials(
            [(server_tls.key.read_bytes(), server_tls.cert.read_bytes())]
        )
        server = await create_server("127.0.0.1:0", lambda s: None, [], credentials=credentials)
        target = f"127.0.0.1:{server.port}"
        try:
            assert (await health(target, "--public-tls-ca", str(server_tls.ca)))[0] == 0
            assert (await health(target))[0] == 2
        finally:
            await server.stop(0)

    run(body())
