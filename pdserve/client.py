"""A small asyncio client of GatewayService (the CLI uses it; so can scripts)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from common.engine.sampling_params import SamplingParams
from common.rpc.channels import create_channel
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc

FINISH_NAMES = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


@dataclass
class RemoteCompletion:
    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    total_ms: float = 0.0


class GatewayClient:
    def __init__(self, target: str) -> None:
        self.channel = create_channel(target)
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    def stream(
        self,
        *,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        raw_prompt: str | None = None,
        token_ids: Sequence[int] | None = None,
        sampling: SamplingParams | None = None,
        timeout_s: float | None = None,
        cache_salt: str = "",
        request_id: str = "",
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        request = gateway_pb2.GenerateRequest(cache_salt=cache_salt, request_id=request_id)
        if prompt is not None:
            request.prompt = prompt
        elif messages is not None:
            request.messages.messages.extend(gateway_pb2.ChatMessage(**m) for m in messages)
        elif raw_prompt is not None:
            request.raw_prompt = raw_prompt
        elif token_ids is not None:
            request.token_ids.ids.extend(token_ids)
        if sampling is not None:
            sampling.to_pb(request.sampling)
        return self.stub.Generate(request, timeout=timeout_s)

    async def complete(self, **kwargs: object) -> RemoteCompletion:
        result = RemoteCompletion()
        async for message in self.stream(**kwargs):  # type: ignore[arg-type]
            collect(result, message)
        return result

    async def cluster_status(self, timeout_s: float = 5.0) -> gateway_pb2.GetClusterStatusResponse:
        reply: gateway_pb2.GetClusterStatusResponse = await self.stub.GetClusterStatus(
            gateway_pb2.GetClusterStatusRequest(), timeout=timeout_s
        )
        return reply


def collect(result: RemoteCompletion, message: gateway_pb2.GenerateResponse) -> None:
    result.request_id = message.request_id
    result.token_ids += list(message.token_ids)
    result.text += message.text
    if message.finish_reason:
        result.finish_reason = FINISH_NAMES.get(message.finish_reason, "unspecified")
        result.prompt_tokens = message.usage.prompt_tokens
        result.cached_tokens = message.usage.cached_tokens
        result.ttft_ms = message.timings.ttft_ms
        result.total_ms = message.timings.total_ms
