"""Fixtures shared by the service tests."""

from __future__ import annotations

import pytest

from common.rpc.pki import make_ca
from common.rpc.tls import TlsConfig

# A name a worker's certificate holds instead of an IP: its pod's DNS name in a cluster.
POD_NAME = "decode-0.pdserve-decode.default.svc"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsConfig]:
    """Certificates of one CA (a server's for 127.0.0.1, one for POD_NAME only, a client's)
    and a stranger's from another CA."""
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ours")
    other = make_ca(root / "other")
    return {
        "server": ca.issue("server", root / "ours"),
        "pod": ca.issue("pod", root / "ours", hosts=(POD_NAME,)),
        "client": ca.issue("client", root / "ours"),
        "stranger": other.issue("stranger", root / "other"),
    }
