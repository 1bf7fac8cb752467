"""Raw bytes -> parsed request -> the real GatewayServicer, in one process, no network.

The bytes go through the deserializer every pdserve server uses (common/rpc/malformed.py)
and then through ``GatewayServicer.Generate``, ``Tokenize`` and ``GetModelInfo`` with their
``rpc_method`` error mapping, up to routing: the worker registry here is empty, so a request
that passes every check ends UNAVAILABLE ("no decode worker"). What a call ends with is the
status a client would see; INTERNAL or UNKNOWN (or an exception escaping) is a finding.
Used by the atheris harness (tests/fuzz/atheris_gateway.py) and its test.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from common.contract.model_spec import load_spec
from common.rpc.malformed import MalformedRequest, _safe
from common.text.tokenizer import Tokenizer
from pdserve.gateway.v1 import gateway_pb2
from services.gateway.config import GatewayConfig
from services.gateway.directory import WorkerDirectory
from services.gateway.metrics import GatewayMetrics
from services.gateway.servicer import GatewayServicer

FORBIDDEN = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class Aborted(grpc.aio.AbortError):
    pass


class FakeContext:
    """Just what the gateway's handlers use of a grpc.aio.ServicerContext."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()

    def time_remaining(self) -> float:
        return 5.0

    async def abort_with_status(self, status: grpc.Status) -> None:
        self.code, self.details = status.code, status.details
        raise Aborted()


class _EmptyRegistry:
    async def list(self) -> list[Any]:
        return []


class _EmptyIndex:
    async def lookup(self, block_hashes: Any) -> list[Any]:
        return []


class Harness:
    def __init__(self, model_dir: str) -> None:
        config = GatewayConfig(model=model_dir, redis_url="redis://unused", port=0)
        self.servicer = GatewayServicer(
            config,
            Tokenizer(model_dir),
            load_spec(model_dir),
            WorkerDirectory(_EmptyRegistry(), 0.0),  # type: ignore[arg-type]
            _EmptyIndex(),  # type: ignore[arg-type]
            "gateway-fuzz",
            "127.0.0.1:0",
            GatewayMetrics(CollectorRegistry(), Tokenizer.__name__),
        )
        self.loop = asyncio.new_event_loop()
        self.parsers = {
            "Generate": _safe(gateway_pb2.GenerateRequest.FromString),
            "Tokenize": _safe(gateway_pb2.TokenizeRequest.FromString),
            "GetModelInfo": _safe(gateway_pb2.GetModelInfoRequest.FromString),
        }

    def run(self, data: bytes) -> dict[str, grpc.StatusCode]:
        """The status each method ends with for ``data``."""
        return {name: self.loop.run_until_complete(self._call(name, data)) for name in self.parsers}

    async def _call(self, name: str, data: bytes) -> grpc.StatusCode:
        parse = self.parsers[name]
        assert parse is not None
        request = parse(data)
        if isinstance(request, MalformedRequest):
            return grpc.StatusCode.INVALID_ARGUMENT  # what the interceptor answers
        context = FakeContext()
        handler = getattr(self.servicer, name)
        try:
            if name == "Generate":
                async for _ in handler(request, context):
                    pass
            else:
                await handler(request, context)
        except Aborted:
            pass
        assert context.code is not None or name != "Generate", "Generate routed to no worker"
        return context.code or grpc.StatusCode.OK

    def close(self) -> None:
        self.loop.run_until_complete(self.servicer.close())
        self.loop.close()


def seeds() -> list[bytes]:
    """A few well-formed requests for the fuzzer to start from."""
    generate = gateway_pb2.GenerateRequest
    return [
        generate(prompt="What is the capital of France?").SerializeToString(),
        generate(raw_prompt="Hello", sampling={"max_tokens": 4, "stop": ["."]}).SerializeToString(),
        generate(token_ids={"ids": [1, 2, 3]}, sampling={"temperature": 0.5}).SerializeToString(),
        generate(
            messages={
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                ]
            },
            sampling={"top_p": 0.9, "top_k": 5, "seed": 7, "logprobs": True, "top_logprobs": 2},
        ).SerializeToString(),
        gateway_pb2.TokenizeRequest(prompt="Hi", add_generation_prompt=True).SerializeToString(),
    ]
