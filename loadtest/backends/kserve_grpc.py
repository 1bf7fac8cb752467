"""A KServe v2 / Triton gRPC server with a text model in the shape of Triton's vLLM backend
(pdserve's gateway on --kserve-port, Triton with vLLM): each request is a decoupled
``ModelStreamInfer`` stream of its own with ``stream: true``, as perf_analyzer and
genai-perf send them. The prompt goes as text (its token ids decoded), so the server's
token count may differ a little from the dataset's; output tokens are the final response's
``num_output_tokens`` when the server sends it, else one per response."""

from __future__ import annotations

import asyncio
import json
import struct
import time
from collections.abc import Callable, Sequence

import grpc

from loadtest.backends.base import Backend, RequestOutput, SendOptions
from loadtest.backends.grpc_gateway import grpc_target
from loadtest.datasets.base import SampleRequest
from pdserve.kserve.v2 import grpc_service_pb2 as pb
from pdserve.kserve.v2 import grpc_service_pb2_grpc


def _bytes_tensor(value: bytes) -> bytes:
    return struct.pack("<I", len(value)) + value


def _output(response: pb.ModelInferResponse, name: str) -> bytes | None:
    for index, tensor in enumerate(response.outputs):
        if tensor.name == name and index < len(response.raw_output_contents):
            return bytes(response.raw_output_contents[index])
    return None


class KServeBackend(Backend):
    name = "kserve"

    def __init__(
        self,
        target: str,
        model: str,
        detokenize: Callable[[Sequence[int]], str],
        *,
        metadata: dict[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> None:
        self.target = grpc_target(target)
        self.model = model
        self.detokenize = detokenize
        self.metadata = tuple((k.lower(), v) for k, v in (metadata or {}).items())
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: grpc_service_pb2_grpc.GRPCInferenceServiceStub | None = None

    @property
    def stub(self) -> grpc_service_pb2_grpc.GRPCInferenceServiceStub:
        if self._stub is None:  # on first use: a channel belongs to its event loop
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub = grpc_service_pb2_grpc.GRPCInferenceServiceStub(self._channel)
        return self._stub

    async def ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                reply = await self.stub.ModelReady(pb.ModelReadyRequest(name=self.model),
                                                   timeout=5, metadata=self.metadata)  # fmt: skip
                if reply.ready:
                    return
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.target}: model {self.model!r} not ready")
            await asyncio.sleep(0.5)

    def request(
        self, request: SampleRequest, request_id: str, options: SendOptions
    ) -> pb.ModelInferRequest:
        sampling = {"max_tokens": request.expected_output_len,
                    "temperature": options.temperature, "ignore_eos": options.ignore_eos}  # fmt: skip
        message = pb.ModelInferRequest(model_name=self.model, id=request_id)
        message.inputs.add(name="text_input", datatype="BYTES", shape=[1])
        message.inputs.add(name="stream", datatype="BOOL", shape=[1])
        message.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
        message.raw_input_contents.extend([
            _bytes_tensor(self.detokenize(request.prompt_token_ids).encode()), b"\x01",
            _bytes_tensor(json.dumps(sampling).encode()),
        ])  # fmt: skip
        if options.cache_salt:  # pdserve's extension (a request parameter)
            message.parameters["cache_salt"].string_param = options.cache_salt
        return message

    async def send(
        self, request: SampleRequest, request_id: str, options: SendOptions
    ) -> RequestOutput:
        out = RequestOutput(request_id, request.prompt_len, request.category)
        message = self.request(request, request_id, options)
        counted: int | None = None
        out.start_time = time.perf_counter()
        try:
            call = self.stub.ModelStreamInfer(iter([message]), timeout=self.timeout_s,
                                              metadata=self.metadata)  # fmt: skip
            async for reply in call:
                now = time.perf_counter()
                if reply.error_message:
                    out.end_time = now
                    out.status_code = "STREAM_ERROR"
                    out.error = reply.error_message[:500]
                    return out
                response = reply.infer_response
                raw = _output(response, "text_output")
                text = raw[4:].decode(errors="replace") if raw else ""
                final = response.parameters["triton_final_response"].bool_param
                if text or not final:  # every response brings a token burst but a bare final
                    out.add_chunk(now, 1, text)
                out.end_time = now
                if final:
                    tokens = _output(response, "num_output_tokens")
                    counted = struct.unpack("<I", tokens)[0] if tokens else None
                    break
            out.success = True
        except grpc.aio.AioRpcError as exc:
            out.end_time = time.perf_counter()
            out.status_code = exc.code().name
            out.error = exc.details() or exc.code().name
            return out
        out.output_tokens = counted if counted is not None else sum(out.chunk_tokens)
        return out

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
