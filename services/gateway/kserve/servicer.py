"""``inference.GRPCInferenceService``: the KServe v2 protocol with Triton's extensions, in
the gateway process, on the gRPC API's request path (``GatewayServicer.generate``).

The served model looks like one of Triton's vLLM backend (tensors.py): ``text_input`` is a
raw prompt (no chat template); ``ModelInfer`` answers once, ``ModelStreamInfer`` takes any
number of requests on one stream and answers each as its tokens come when it asks
``stream: true`` (decoupled, as the model configuration says), the last response carrying
Triton's ``triton_final_response`` parameter. A request that fails on a stream gets its
``error_message`` there; the stream and the other requests on it go on. Cancelling the
stream cancels every request on it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc

from common.errors import InvalidRequestError, NotFoundError, PdserveError, UnavailableError
from common.rpc.errors import rpc_method
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from pdserve.gateway.v1 import gateway_pb2
from pdserve.kserve.v2 import grpc_service_pb2 as pb
from pdserve.kserve.v2 import grpc_service_pb2_grpc, model_config_pb2
from services.gateway.kserve import tensors
from services.gateway.relay import finish_reason_name
from services.gateway.servicer import GatewayServicer

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
VERSION = "1"
_CONFIG_TYPES = {
    "BYTES": model_config_pb2.TYPE_STRING,
    "BOOL": model_config_pb2.TYPE_BOOL,
    "UINT32": model_config_pb2.TYPE_UINT32,
}


class _StreamCall:
    """A streamed request's call: its client resumes by the ``resume_token`` parameter of
    the last response (a position; it holds no token ids), so each response's tokens are in
    the resume record before it goes."""

    records_before_sending = True

    def __init__(self, context: Any) -> None:
        self._context = context

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def time_remaining(self) -> float | None:
        remaining: float | None = self._context.time_remaining()
        return remaining


class KServeServicer(grpc_service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, gateway: GatewayServicer) -> None:
        self.gateway = gateway
        self.model = gateway.model
        self.draining = False

    # -- health and metadata ------------------------------------------------------------

    async def ServerLive(self, request: pb.ServerLiveRequest, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def _ready(self) -> bool:
        if self.draining:
            return False
        try:
            return bool(await self.gateway.directory.by_role("decode", self.model))
        except UnavailableError:
            return False

    async def ServerReady(
        self, request: pb.ServerReadyRequest, context: Any
    ) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=await self._ready())

    async def ModelReady(self, request: pb.ModelReadyRequest, context: Any) -> pb.ModelReadyResponse:
        known = request.name == self.model and request.version in ("", VERSION)
        return pb.ModelReadyResponse(ready=known and await self._ready())

    async def ServerMetadata(
        self, request: pb.ServerMetadataRequest, context: Any
    ) -> pb.ServerMetadataResponse:
        from importlib.metadata import PackageNotFoundError, version

        try:
            ours = version("pdserve")
        except PackageNotFoundError:
            ours = "0"
        return pb.ServerMetadataResponse(
            name="pdserve", version=ours, extensions=["model_configuration"]
        )

    def _check(self, name: str, version: str) -> None:
        if name != self.model:
            raise NotFoundError(
                f"model {name!r} is not served here; this cluster serves {self.model!r}"
            )
        if version not in ("", VERSION):
            raise NotFoundError(f"model {name!r} has version {VERSION!r} only, not {version!r}")

    @rpc_method
    async def ModelMetadata(
        self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelMetadataResponse:
        self._check(request.name, request.version)
        tensor = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=self.model, versions=[VERSION], platform="pdserve",
            inputs=[tensor(name=n, datatype=t, shape=[1]) for n, (t, _) in tensors.INPUTS.items()],
            outputs=[tensor(name=n, datatype=t, shape=[-1]) for n, t in tensors.OUTPUTS.items()],
        )  # fmt: skip

    @rpc_method
    async def ModelConfig(
        self, request: pb.ModelConfigRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelConfigResponse:
        self._check(request.name, request.version)
        config = model_config_pb2.ModelConfig(
            name=self.model, backend="pdserve", max_batch_size=0,
            model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True),
        )  # fmt: skip
        for name, (datatype, required) in tensors.INPUTS.items():
            config.input.add(name=name, data_type=_CONFIG_TYPES[datatype], dims=[1],
                             optional=not required)  # fmt: skip
        for name, datatype in tensors.OUTPUTS.items():
            config.output.add(name=name, data_type=_CONFIG_TYPES[datatype], dims=[-1])
        return pb.ModelConfigResponse(config=config)

    @rpc_method
    async def RepositoryIndex(
        self, request: pb.RepositoryIndexRequest, context: grpc.aio.ServicerContext
    ) -> pb.RepositoryIndexResponse:
        """Triton's model-repository extension, read-only: the one served model, READY while
        a decode worker serves it, else UNAVAILABLE with the reason (``ready: true`` leaves
        it out then). One repository: a named one is refused, as Triton refuses it."""
        if request.repository_name:
            raise InvalidRequestError(
                "repository_name", f"{request.repository_name!r}: this server has one model "
                "repository, which an empty repository_name lists")  # fmt: skip
        ready = await self._ready()
        if request.ready and not ready:
            return pb.RepositoryIndexResponse()
        reason = "" if ready else ("draining" if self.draining else "no decode worker serves it")
        entry = pb.RepositoryIndexResponse.ModelIndex(
            name=self.model, version=VERSION, state="READY" if ready else "UNAVAILABLE",
            reason=reason,
        )  # fmt: skip
        return pb.RepositoryIndexResponse(models=[entry])

    # -- inference ------------------------------------------------------------------------

    def _generate_request(
        self, request: pb.ModelInferRequest
    ) -> tuple[tensors.TextRequest, gateway_pb2.GenerateRequest]:
        self._check(request.model_name, request.model_version)
        text = tensors.parse_request(request)
        message = gateway_pb2.GenerateRequest(
            request_id=request.id, model=self.model, raw_prompt=text.text,
            cache_salt=text.cache_salt,
        )  # fmt: skip
        message.sampling.CopyFrom(tensors.sampling_pb(text.sampling))
        if text.resume_token:
            message.resume.resume_token = text.resume_token
        return text, message

    async def _run(
        self, request: pb.ModelInferRequest, context: Any, stream: bool | None = None
    ) -> AsyncGenerator[pb.ModelInferResponse, None]:
        """The responses of one request: one at the end, or (``stream``, by default the
        request's own) one per message of the gateway's, the last one final."""
        text, message = self._generate_request(request)
        if stream is not None:
            text.stream = stream
        parts: list[str] = []
        call = _StreamCall(context) if text.stream else context
        async with contextlib.aclosing(self.gateway.generate(message, call)) as replies:
            async for reply in replies:
                last = reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                if text.stream:
                    yield tensors.response(
                        request, self.model, reply.text, text.outputs,
                        finish_reason_name(reply.finish_reason) if last else None,
                        reply.usage.prompt_tokens if last else None,
                        reply.usage.completion_tokens if last else None, final=last,
                        resume_token=reply.resume_token,
                    )  # fmt: skip
                    continue
                parts.append(reply.text)
                if last:
                    output = "".join(parts)
                    if not text.exclude_input:
                        output = text.text + output
                    yield tensors.response(
                        request, self.model, output, text.outputs,
                        finish_reason_name(reply.finish_reason), reply.usage.prompt_tokens,
                        reply.usage.completion_tokens, final=True,
                    )  # fmt: skip

    @rpc_method
    async def ModelInfer(
        self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInferResponse:
        """Unary: the whole completion in one response, whatever ``stream`` says."""
        final: pb.ModelInferResponse | None = None
        async with contextlib.aclosing(self._run(request, context, stream=False)) as replies:
            async for reply in replies:
                final = reply
        assert final is not None, "the gateway ended a request without its last message"
        del final.parameters["triton_final_response"]
        return final

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[pb.ModelInferRequest], context: Any
    ) -> AsyncIterator[pb.ModelStreamInferResponse]:
        out: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        running: set[asyncio.Task[None]] = set()

        async def one(request: pb.ModelInferRequest) -> None:
            try:
                with tracer().start_as_current_span("generate", attributes={
                    "pdserve.request_id": request.id}):  # fmt: skip
                    async with contextlib.aclosing(self._run(request, context)) as replies:
                        async for reply in replies:
                            out.put_nowait(pb.ModelStreamInferResponse(infer_response=reply))
            except PdserveError as exc:
                log.info("ModelStreamInfer request %r: %s: %s", request.id,
                         type(exc).__name__, exc)  # fmt: skip
                out.put_nowait(pb.ModelStreamInferResponse(
                    error_message=f"{exc.reason}: {exc}",
                    infer_response=pb.ModelInferResponse(
                        model_name=self.model, model_version=VERSION, id=request.id),
                ))  # fmt: skip
            except Exception as exc:  # a bug: said on the stream, and logged in full
                log.exception("ModelStreamInfer request %r failed", request.id)
                out.put_nowait(pb.ModelStreamInferResponse(
                    error_message=f"INTERNAL: {type(exc).__name__}: {exc}",
                    infer_response=pb.ModelInferResponse(id=request.id),
                ))  # fmt: skip

        async def read() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(one(request))
                running.add(task)
                task.add_done_callback(running.discard)
            while running:  # the client is done sending: the stream ends with the last
                await asyncio.gather(*list(running), return_exceptions=True)
            out.put_nowait(None)

        reader = asyncio.create_task(read())
        try:
            while (item := await out.get()) is not None:
                yield item
            await reader
        finally:
            reader.cancel()
            for task in list(running):
                task.cancel()
            await asyncio.gather(reader, *list(running), return_exceptions=True)
