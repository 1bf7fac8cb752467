"""KServe / Triton's RepositoryIndex on the gateway: the served model and its state."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from common.errors import InvalidRequestError, UnavailableError
from common.rpc.errors import status_code_for
from pdserve.kserve.v2 import grpc_service_pb2 as pb
from services.gateway.kserve.servicer import KServeServicer


class Directory:
    def __init__(self, decode: list[str] | Exception) -> None:
        self.decode = decode

    async def by_role(self, role: str, model: str) -> list[str]:
        if isinstance(self.decode, Exception):
            raise self.decode
        return self.decode if role == "decode" else []


def index(decode: list[str] | Exception, draining: bool = False, **request: Any) -> Any:
    servicer = KServeServicer(SimpleNamespace(model="m", directory=Directory(decode)))  # type: ignore[arg-type]
    servicer.draining = draining
    method = KServeServicer.RepositoryIndex.__wrapped__  # type: ignore[attr-defined]
    return asyncio.run(method(servicer, pb.RepositoryIndexRequest(**request), None))


def entries(reply: pb.RepositoryIndexResponse) -> list[tuple[str, str, str, str]]:
    return [(m.name, m.version, m.state, m.reason) for m in reply.models]


def test_the_served_model_is_ready_while_a_decode_worker_serves_it() -> None:
    assert entries(index(["d0"])) == [("m", "1", "READY", "")]
    assert entries(index(["d0"], ready=True)) == [("m", "1", "READY", "")]


def test_an_unready_model_is_listed_with_why_unless_only_ready_ones_are_asked() -> None:
    assert entries(index([])) == [("m", "1", "UNAVAILABLE", "no decode worker serves it")]
    assert entries(index(UnavailableError("redis down"))) == [
        ("m", "1", "UNAVAILABLE", "no decode worker serves it")
    ]
    assert entries(index(["d0"], draining=True)) == [("m", "1", "UNAVAILABLE", "draining")]
    assert entries(index([], ready=True)) == []


def test_a_named_repository_is_an_invalid_argument() -> None:
    with pytest.raises(InvalidRequestError, match="repository_name") as refused:
        index(["d0"], repository_name="other")
    assert status_code_for(refused.value) == grpc.StatusCode.INVALID_ARGUMENT
