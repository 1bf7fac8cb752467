"""pdserve's GatewayService over gRPC: prompts go as token ids, so prompt lengths are exact
(or, with ``detokenize``, as text), and output tokens are counted from the streamed
``token_ids``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import grpc

from common.contract.sampling import SamplingParams
from common.rpc.channels import create_channel
from loadtest.backends.base import Backend, RequestOutput, SendOptions
from loadtest.datasets.base import SampleRequest
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def grpc_target(base_url: str) -> str:
    for scheme in ("grpc://", "http://"):
        if base_url.startswith(scheme):
            return base_url[len(scheme) :].rstrip("/")
    return base_url


class GrpcGatewayBackend(Backend):
    name = "pdserve"

    def __init__(
        self,
        target: str,
        timeout_s: float | None = None,
        *,
        api_key: str | None = None,
        tls_ca: str | None = None,
        metadata: dict[str, str] | None = None,
        detokenize: Callable[[Sequence[int]], str] | None = None,
    ) -> None:
        """``api_key``: sent as ``authorization: Bearer KEY``; ``tls_ca``: PEM CA of a
        gateway whose public port serves TLS; ``metadata``: more headers on every call;
        ``detokenize``: send each prompt as this text of its ids (``raw_prompt``, the
        gateway tokenizes it) instead of the ids."""
        self.detokenize = detokenize
        self.target = grpc_target(target)
        self.timeout_s = timeout_s
        headers = {k.lower(): v for k, v in (metadata or {}).items()}
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        self.metadata = tuple(headers.items())
        self._credentials = (
            grpc.ssl_channel_credentials(Path(tls_ca).read_bytes()) if tls_ca else None
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: gateway_pb2_grpc.GatewayServiceStub | None = None

    @property
    def channel(self) -> grpc.aio.Channel:
        """Created on first use: a grpc.aio channel belongs to the event loop it starts in."""
        if self._channel is None:
            self._channel = create_channel(self.target, self._credentials)
        return self._channel

    @property
    def stub(self) -> gateway_pb2_grpc.GatewayServiceStub:
        if self._stub is None:
            self._stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        return self._stub

    async def ready(self, timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"gateway {self.target} not reachable in {timeout_s:.0f}s") from None

    async def model_info(self) -> gateway_pb2.GetModelInfoResponse:
        reply: gateway_pb2.GetModelInfoResponse = await self.stub.GetModelInfo(
            gateway_pb2.GetModelInfoRequest(), timeout=30, metadata=self.metadata
        )
        return reply

    async def send(
        self, request: SampleRequest, request_id: str, options: SendOptions
    ) -> RequestOutput:
        out = RequestOutput(request_id, request.prompt_len, request.category)
        message = gateway_pb2.GenerateRequest(request_id=request_id, cache_salt=options.cache_salt)
        if self.detokenize is not None:
            message.raw_prompt = self.detokenize(request.prompt_token_ids)
        else:
            message.token_ids.ids.extend(request.prompt_token_ids)
        SamplingParams(
            max_tokens=request.expected_output_len,
            temperature=options.temperature,
            ignore_eos=options.ignore_eos,
        ).to_pb(message.sampling)
        out.start_time = time.perf_counter()
        try:
            call = self.stub.Generate(message, timeout=self.timeout_s, metadata=self.metadata)
            async for reply in call:
                now = time.perf_counter()
                if reply.token_ids:
                    out.add_chunk(now, len(reply.token_ids), reply.text)
                elif reply.text:  # text held back earlier, released without new tokens
                    out.generated_text += reply.text
                if reply.finish_reason:
                    out.cached_tokens = reply.usage.cached_tokens
                out.end_time = now
            out.success = True
        except grpc.aio.AioRpcError as exc:
            out.end_time = time.perf_counter()
            out.status_code = exc.code().name
            out.error = exc.details() or exc.code().name
        out.output_tokens = sum(out.chunk_tokens)
        return out

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
