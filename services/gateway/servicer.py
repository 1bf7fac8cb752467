"""GatewayService: validate, tokenize, route, relay tokens, detokenize, account."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry import trace

from common.engine.sampling_params import SamplingParams
from common.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    NotFoundError,
    PdserveError,
    UnavailableError,
)
from common.index.prefix_index import PrefixIndex, prefix_overlap
from common.kv.hashing import HASH_SCHEME_VERSION, hash_prompt_blocks
from common.kv.pull import release_lease
from common.models.spec import ModelSpec
from common.rpc.channels import ChannelPool, remaining_timeout
from common.rpc.errors import from_rpc_error, rpc_method
from common.rpc.tracing import ClientSpan, client_span
from common.telemetry.logs import bind_request_id
from common.telemetry.tracing import tracer
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.gateway.admission import Admission, Ticket, estimate_prompt_tokens
from services.gateway.auth import tenant_cache_salt
from services.gateway.config import GatewayConfig
from services.gateway.directory import WorkerDirectory
from services.gateway.frontend import check_sizes, prompt_token_ids
from services.gateway.metrics import GatewayMetrics
from services.gateway.relay import Relay
from services.gateway.routing import Route, Router
from services.gateway.status import cluster_status
from services.gateway.telemetry import describe_request, record_request, route_attributes

log = logging.getLogger(__name__)

PREFILL_METHOD = "/pdserve.prefill.v1.PrefillService/Prefill"
DECODE_METHOD = "/pdserve.decode.v1.DecodeService/Decode"


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
        self.channels = ChannelPool(config.tls)
        self.gateway_id = gateway_id
        self.address = address
        self.metrics = metrics
        self.admission = Admission(config.admission_limits, metrics.admission_rejected)
        metrics.queued_prompt_tokens.set_function(lambda: self.admission.total.queued_tokens)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
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

    def _tenant(self, context: grpc.aio.ServicerContext) -> str | None:
        """The caller's tenant (None with authentication off); the interceptor has already
        refused calls without a valid key."""
        keys = self.config.api_keys
        return None if keys is None else keys.tenant_of(context.invocation_metadata())

    async def _tokenize(
        self, request: Any, add_generation_prompt: bool = True
    ) -> tuple[str, list[int]]:
        """Off the event loop (a long prompt takes a while), one at a time: the tokenizer
        is not safe to share between threads."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tokenizer_thread,
            prompt_token_ids,
            request,
            self.tokenizer,
            self.spec.vocab_size,
            add_generation_prompt,
        )

    @rpc_method
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        """Cheap checks and admission first, before any tokenization; the request then holds
        its admission ticket until it ends."""
        bind_request_id(request.request_id)
        self._check_model(request.model)
        tenant = self._tenant(context)
        limit = await self._context_limit()
        check_sizes(request, limit)
        ticket = self.admission.admit(tenant or "", estimate_prompt_tokens(request))
        try:
            async with contextlib.aclosing(
                self._generate(request, context, ticket, tenant, limit)
            ) as messages:
                async for message in messages:
                    if message.token_ids:
                        ticket.prefilled()
                    yield message
        finally:
            ticket.release()

    async def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        context: grpc.aio.ServicerContext,
        ticket: Ticket,
        tenant: str | None,
        limit: int,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        span = trace.get_current_span()  # the server span of this call: the request's span
        with tracer().start_as_current_span("tokenize") as tokenize:
            field, prompt = await self._tokenize(request)
            tokenize.set_attributes(
                {"pdserve.input_field": field, "pdserve.num_tokens": len(prompt)}
            )
        ticket.account(len(prompt))
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
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        bind_request_id(request_id)
        describe_request(span, self.model, field, request_id, sampling, len(prompt))
        salt = tenant_cache_salt(tenant, request.cache_salt)
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
        handle: common_pb2.KvHandle | None = None
        first: gateway_pb2.GenerateResponse | None = None
        if route.prefill is not None:
            prefilled = await self._prefill(route, relay, sampling, salt, context)
            relay.cached_tokens = prefilled.cached_tokens
            first = relay.message([prefilled.first_token_id], _first_logprob(prefilled))
            if prefilled.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                yield relay.finish(first, prefilled.finish_reason)
                return
            handle = prefilled.kv_handle
            decode_request.kv_handle.CopyFrom(handle)
            decode_request.generated_token_ids.append(prefilled.first_token_id)
        else:
            decode_request.local_prefill = True

        decode_id = route.decode.worker_id
        started = False
        call: Any = None
        span: ClientSpan | None = None
        self.router.in_flight[decode_id] += 1
        try:
            if first is not None:
                if relay.detok.stop_string is not None:
                    yield relay.finish(first, common_pb2.FINISH_REASON_STOP)
                    return
                yield first
            stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(route.decode.address))
            span = ClientSpan(DECODE_METHOD, route.decode.address, {"pdserve.worker_id": decode_id})
            dispatched_ms = (time.monotonic() - relay.arrival) * 1000
            call = stub.Decode(
                decode_request, timeout=remaining_timeout(context), metadata=span.metadata
            )
            async for message in call:
                started = True
                reply = relay.message(list(message.token_ids), list(message.logprobs))
                if route.prefill is None and message.finish_reason:
                    relay.cached_tokens = message.cached_tokens + message.imported_tokens
                    relay.queue_ms = dispatched_ms + message.queue_ms
                if relay.detok.stop_string is not None:
                    yield relay.finish(reply, common_pb2.FINISH_REASON_STOP)
                    return
                if message.finish_reason:
                    yield relay.finish(reply, message.finish_reason)
                    return
                if reply.token_ids or reply.text:
                    yield reply
            raise PdserveError("the decode stream ended without a finish reason")
        except grpc.aio.AioRpcError as exc:
            if span is not None:
                span.failed(exc)
            error = _downstream_error(exc, f"decode worker {decode_id}")
            if relay.generated and not isinstance(error, asyncio.TimeoutError):
                # Tokens already reached the client: close the stream's accounting first.
                ending = gateway_pb2.GenerateResponse(request_id=relay.request_id)
                yield relay.finish(ending, common_pb2.FINISH_REASON_ERROR)
            raise error from exc
        except BaseException as exc:
            if span is not None:
                span.failed(exc)
            raise
        finally:
            if span is not None:
                span.end()
            self.router.in_flight[decode_id] -= 1
            if call is not None and not call.done():
                call.cancel()
            if handle is not None and not started:
                self._release_later(handle)

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
                raise _downstream_error(exc, f"prefill worker {worker.worker_id}") from exc
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
        check_sizes(request, await self._context_limit())
        ticket = self.admission.admit(self._tenant(context) or "", estimate_prompt_tokens(request))
        try:
            _, ids = await self._tokenize(request, request.add_generation_prompt)
        finally:
            ticket.release()
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
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def _downstream_error(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    """What to answer when a worker call fails. The caller's deadline, passed down, expires
    there first: that stays DEADLINE_EXCEEDED (tokens sent stand), not a server fault."""
    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return asyncio.TimeoutError(f"{what}: the deadline passed")
    return from_rpc_error(exc, what)


def _first_logprob(response: prefill_pb2.PrefillResponse) -> list[common_pb2.TokenLogprob]:
    return [response.first_logprob] if response.HasField("first_logprob") else []
