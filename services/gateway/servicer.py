"""GatewayService: validate, tokenize, route, relay tokens, detokenize, account."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from typing import Any

import grpc
from opentelemetry import trace

from common.engine.sampling_params import SamplingParams
from common.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    NotFoundError,
    QueueFullError,
    UnavailableError,
)
from common.index.prefix_index import PrefixIndex, prefix_overlap
from common.kv.hashing import HASH_SCHEME_VERSION, hash_prompt_blocks
from common.kv.pull import release_lease
from common.models.spec import ModelSpec
from common.rpc.channels import ChannelPool, remaining_timeout
from common.rpc.errors import rpc_method
from common.rpc.tracing import client_span
from common.telemetry.logs import bind_request_id
from common.telemetry.tracing import tracer
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.decode_stream import DecodeStreamer, downstream_error
from services.gateway.directory import WorkerDirectory
from services.gateway.frontend import prompt_token_ids
from services.gateway.metrics import GatewayMetrics
from services.gateway.relay import Relay
from services.gateway.routing import Route, Router
from services.gateway.status import cluster_status
from services.gateway.telemetry import describe_request, record_request, route_attributes

log = logging.getLogger(__name__)

PREFILL_METHOD = "/pdserve.prefill.v1.PrefillService/Prefill"


class GatewayServicer(gateway_pb2_grpc.GatewayServiceServicer):
    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Tokenizer,
        spec: ModelSpec,
        directory: WorkerDirectory,
        index: PrefixIndex,
        gateway_id: str,
        address: str,
        metrics: GatewayMetrics,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.model = config.served_model_name
        self.max_model_len = min(
            config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings
        )
        self.directory = directory
        self.index = index
        self.router = Router(config.block_size, config.local_prefill_tokens, config.overlap_weight)
        self.channels = ChannelPool()
        self.decoder = DecodeStreamer(
            self.router, directory, self.channels, metrics, self.model, config.max_migrations
        )
        self.gateway_id = gateway_id
        self.address = address
        self.metrics = metrics
        self.num_in_flight = 0
        metrics.num_requests_running.set_function(lambda: self.num_in_flight)
        self._request_ids: set[str] = set()  # of the requests in flight
        self._background: set[asyncio.Task[Any]] = set()

    def _check_model(self, model: str) -> None:
        if model and model != self.model:
            raise NotFoundError(
                f"model {model!r} is not served here; this cluster serves {self.model!r}"
            )

    async def _context_limit(self) -> int:
        """Most tokens a request may span: the configured limit, lowered to what every live
        worker of the model serves (a worker's KV pool bounds its limit too). The configured
        limit alone when the registry cannot be read; routing will then answer UNAVAILABLE."""
        try:
            workers = await self.directory.workers()
        except UnavailableError:
            return self.max_model_len
        limits = [
            w.max_model_len
            for w in workers
            if w.role in ("prefill", "decode") and w.model == self.model and w.max_model_len > 0
        ]
        return min([self.max_model_len, *limits])

    # -- Generate ---------------------------------------------------------------------------

    @rpc_method
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        span = trace.get_current_span()  # the server span of this call: the request's span
        bind_request_id(request.request_id)
        self._check_model(request.model)
        with tracer().start_as_current_span("tokenize") as tokenize:
            field, prompt = prompt_token_ids(request, self.tokenizer, self.spec.vocab_size)
            tokenize.set_attributes(
                {"pdserve.input_field": field, "pdserve.num_tokens": len(prompt)}
            )
        limit = await self._context_limit()
        if len(prompt) >= limit:
            raise InvalidRequestError(
                field, f"the prompt has {len(prompt)} tokens; the model's context holds {limit}"
            )
        if request.sampling.max_tokens > limit - len(prompt):
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt ({len(prompt)}) + max_tokens ({request.sampling.max_tokens}) exceeds the "
                f"context of {limit} tokens",
            )
        sampling = SamplingParams.from_pb(request.sampling, limit - len(prompt))
        sampling.check_vocab(self.spec.vocab_size)
        if request.request_id in self._request_ids:
            raise AlreadyExistsError(f"a request with id {request.request_id!r} is in flight")
        if self.num_in_flight >= self.config.max_in_flight:
            raise QueueFullError(
                f"the gateway has {self.num_in_flight} requests in flight; retry later"
            )
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        bind_request_id(request_id)
        describe_request(span, self.model, field, request_id, sampling, len(prompt))
        salt = request.cache_salt or None
        relay = Relay(
            request_id,
            prompt,
            IncrementalDetokenizer(self.tokenizer, prompt, sampling.stop),
            self.metrics.requests,
        )
        self.num_in_flight += 1
        self._request_ids.add(request_id)
        route: Route | None = None
        failure: BaseException | None = None
        try:
            route = await self._route(request_id, prompt, salt)
            span.set_attributes(route_attributes(route))
            # aclosing: when the client goes away, _run's cleanup (lease release, cancelling
            # the decode call) runs now, not whenever the generator is collected.
            async with contextlib.aclosing(
                self._run(route, relay, sampling, salt, context)
            ) as messages:
                async for message in messages:
                    yield message
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.num_in_flight -= 1
            self._request_ids.discard(request_id)
            record_request(span, self.metrics, relay, route, failure)
            failure = None  # no frame <-> traceback cycle

    async def _route(self, request_id: str, prompt: list[int], salt: str | None) -> Route:
        with tracer().start_as_current_span("route") as span:
            hashes = hash_prompt_blocks(
                prompt, self.config.block_size, salt, seed=self.config.hash_seed
            )
            try:
                locations = await self.index.lookup([int(h) for h in hashes])
                self.metrics.redis.ok()
            except Exception as exc:  # the index is advisory: route without it
                log.warning("prefix index lookup failed: %s", exc)
                self.metrics.redis.failed("index_lookup")
                span.set_attribute("pdserve.route.index_error", str(exc))
                locations = []
            overlap = prefix_overlap(locations)
            prefills = await self.directory.by_role("prefill", self.model)
            decodes = await self.directory.by_role("decode", self.model)
            route = self.router.choose(request_id, len(prompt), overlap, prefills, decodes)
            span.set_attributes(route_attributes(route))
            span.set_attribute("pdserve.route.num_prompt_blocks", len(hashes))
        self.metrics.routed(route.reason)
        return route

    async def _run(
        self,
        route: Route,
        relay: Relay,
        sampling: SamplingParams,
        salt: str | None,
        context: grpc.aio.ServicerContext,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        decode_request = decode_pb2.DecodeRequest(
            request_id=relay.request_id,
            prompt_token_ids=relay.prompt,
            cache_salt=salt or "",
        )
        sampling.to_pb(decode_request.sampling)
        first: gateway_pb2.GenerateResponse | None = None
        prefilled = None
        if route.prefill is not None:
            try:
                prefilled = await self._prefill(route, relay, sampling, salt, context)
            except UnavailableError as exc:  # gone or draining: the decode worker prefills
                log.info("request %s: %s; prefilling on the decode worker", relay.request_id, exc)
        if prefilled is None:
            decode_request.local_prefill = True
        else:
            relay.cached_tokens = prefilled.cached_tokens
            first = relay.message([prefilled.first_token_id], _first_logprob(prefilled))
            if prefilled.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                yield relay.finish(first, prefilled.finish_reason)
                return
            decode_request.kv_handle.CopyFrom(prefilled.kv_handle)
            decode_request.generated_token_ids.append(prefilled.first_token_id)

        decoding = False  # from then on the decoder owns the lease
        try:
            if first is not None:
                if relay.detok.stop_string is not None:
                    yield relay.finish(first, common_pb2.FINISH_REASON_STOP)
                    return
                yield first
            decoding = True
            decode = self.decoder.stream(
                route.decode, decode_request, relay, sampling, context, self._release_later
            )
            # aclosing: the decode call is cancelled (and an unused lease released) as soon
            # as the client goes away.
            async with contextlib.aclosing(decode) as replies:
                async for reply in replies:
                    yield reply
        finally:
            if prefilled is not None and not decoding:
                self._release_later(prefilled.kv_handle)

    async def _prefill(
        self,
        route: Route,
        relay: Relay,
        sampling: SamplingParams,
        salt: str | None,
        context: grpc.aio.ServicerContext,
    ) -> prefill_pb2.PrefillResponse:
        assert route.prefill is not None
        worker = route.prefill
        # Our own lease id: if we give up on the call, we can still release what it pinned.
        lease_id = f"lease-{secrets.token_hex(8)}"
        request = prefill_pb2.PrefillRequest(
            request_id=relay.request_id,
            prompt_token_ids=relay.prompt,
            cache_salt=salt or "",
            lease_id=lease_id,
        )
        sampling.to_pb(request.sampling)
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(worker.address))
        self.router.in_flight[worker.worker_id] += 1
        relay.queue_ms = (time.monotonic() - relay.arrival) * 1000
        with client_span(
            PREFILL_METHOD, worker.address, {"pdserve.worker_id": worker.worker_id}
        ) as span:
            call = stub.Prefill(request, timeout=remaining_timeout(context), metadata=span.metadata)
            try:
                response: prefill_pb2.PrefillResponse = await call
            except grpc.aio.AioRpcError as exc:
                span.failed(exc)
                raise downstream_error(exc, f"prefill worker {worker.worker_id}") from exc
            except asyncio.CancelledError:
                call.cancel()
                # Released whether or not the lease exists yet: the worker remembers.
                self._in_background(release_lease(self.channels.get(worker.address), lease_id))
                raise
            finally:
                self.router.in_flight[worker.worker_id] -= 1
            span.span.set_attributes(
                {
                    "pdserve.cached_tokens": response.cached_tokens,
                    "pdserve.computed_tokens": response.computed_tokens,
                }
            )
        relay.queue_ms += response.queue_ms
        return response

    async def _release(self, handle: common_pb2.KvHandle) -> None:
        await release_lease(self.channels.get(handle.producer_address), handle.lease_id)

    def _release_later(self, handle: common_pb2.KvHandle) -> None:
        """Hands a lease back when no decode will pull it (cancellation, early stop)."""
        self._in_background(self._release(handle))

    def _in_background(self, coro: Coroutine[Any, Any, object]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- the other RPCs -----------------------------------------------------------------------

    @rpc_method
    async def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetModelInfoResponse:
        self._check_model(request.model)
        return gateway_pb2.GetModelInfoResponse(
            model=self.model,
            architecture=self.spec.architecture,
            max_context_tokens=await self._context_limit(),
            vocab_size=self.spec.vocab_size,
            eos_token_ids=list(self.spec.eos_token_ids),
            has_chat_template=self.tokenizer.has_chat_template,
            block_size=self.config.block_size,
            hash_scheme_version=HASH_SCHEME_VERSION,
        )

    @rpc_method
    async def Tokenize(
        self, request: gateway_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.TokenizeResponse:
        self._check_model(request.model)
        _, ids = prompt_token_ids(
            request, self.tokenizer, self.spec.vocab_size, request.add_generation_prompt
        )
        return gateway_pb2.TokenizeResponse(
            token_ids=ids, tokens=self.tokenizer.convert_ids_to_tokens(ids)
        )

    @rpc_method
    async def GetClusterStatus(
        self, request: gateway_pb2.GetClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetClusterStatusResponse:
        workers = await self.directory.registry.list()
        statuses = await cluster_status(
            workers, self.channels, self.gateway_id, self.address, self.model
        )
        return gateway_pb2.GetClusterStatusResponse(workers=statuses)

    async def close(self) -> None:
        for task in list(self._background):
            await asyncio.wait([task], timeout=2.0)
        await self.channels.close()


def _first_logprob(response: prefill_pb2.PrefillResponse) -> list[common_pb2.TokenLogprob]:
    return [response.first_logprob] if response.HasField("first_logprob") else []
