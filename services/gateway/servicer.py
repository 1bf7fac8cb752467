"""GatewayService: validate, tokenize, route, relay tokens, detokenize, account."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from opentelemetry import trace

from common.contract.model_spec import ModelSpec
from common.contract.sampling import SamplingParams
from common.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from common.index.prefix_index import PrefixIndex, prefix_overlap
from common.kv.hashing import HASH_SCHEME_VERSION, hash_prompt_blocks
from common.rpc.breaker import CircuitState
from common.rpc.channels import ChannelPool
from common.rpc.errors import rpc_method
from common.telemetry.logs import bind_request_id
from common.telemetry.tracing import tracer
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2
from services.gateway.admission import Admission, Ticket, estimate_prompt_tokens
from services.gateway.auth import tenant_cache_salt
from services.gateway.call import Call
from services.gateway.config import GatewayConfig
from services.gateway.constraints import ConstraintChecker
from services.gateway.decode_stream import DecodeStreamer
from services.gateway.directory import WorkerDirectory
from services.gateway.frontend import check_sizes, prompt_token_ids
from services.gateway.health import IndexHealth, WorkerBreakers
from services.gateway.leases import LeaseReturns
from services.gateway.metrics import GatewayMetrics
from services.gateway.prefill_call import PrefillCaller, RoutedRequest
from services.gateway.relay import Relay
from services.gateway.resume import (
    ResumeMetrics,
    ResumeRecord,
    ResumeStore,
    check_resume,
    make_token,
    parse_token,
)
from services.gateway.routing import Route, Router
from services.gateway.status import ENGINE_ROLES, cluster_status
from services.gateway.telemetry import describe_request, record_request, route_attributes

log = logging.getLogger(__name__)

# How long a message may wait for its tokens to reach the resume record when its client
# resumes by position (server-sent events); past it (Redis slow or down) it goes anyway.
RECORD_WAIT_S = 0.05

_CIRCUIT_STATES = {
    CircuitState.CLOSED: gateway_pb2.CIRCUIT_STATE_CLOSED,
    CircuitState.OPEN: gateway_pb2.CIRCUIT_STATE_OPEN,
    CircuitState.HALF_OPEN: gateway_pb2.CIRCUIT_STATE_HALF_OPEN,
}


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
        clock: Callable[[], float] = time.monotonic,
        resume_redis: Any = None,
    ) -> None:
        """``clock``: the circuit breakers' (tests move it instead of waiting cool-downs);
        ``resume_redis``: the Redis client of the resume records (None: no records, no
        resume tokens)."""
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.model = config.served_model_name
        self.max_model_len = min(
            config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings
        )
        self.directory = directory
        self.index = index
        self.health = directory.health or IndexHealth(metrics)
        directory.health = self.health
        self.breakers = WorkerBreakers(
            metrics, config.breaker_failure_threshold, config.breaker_cooldown_s, clock
        )
        self.router = Router(
            config.block_size,
            config.local_prefill_tokens,
            config.overlap_weight,
            config.routing_policy,
        )
        self.channels = ChannelPool(config.tls)
        self.leases = LeaseReturns(self.channels)
        self.prefiller = PrefillCaller(
            self.router,
            directory,
            self.channels,
            self.breakers,
            metrics,
            self.leases,
            self.model,
            config.prefill_timeout_s,
        )
        self.decoder = DecodeStreamer(
            self.router,
            directory,
            self.channels,
            metrics,
            self.leases,
            self.model,
            config.max_migrations,
            self.breakers,
            stall_timeout_s=config.decode_stall_timeout_s,
            first_message_extra_s=config.prefill_timeout_s,
        )
        self.gateway_id = gateway_id
        self.address = address
        self.http_address = ""  # the OpenAI-compatible API's base URL (.../v1), when served
        self.kserve_address = ""  # the KServe v2 port, grpc://host:port, when served
        self.metrics = metrics
        self.admission = Admission(config.admission_limits, metrics.admission_rejected)
        self.constraints = ConstraintChecker(metrics.registry)
        metrics.queued_prompt_tokens.set_function(lambda: self.admission.total.queued_tokens)
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self.num_in_flight = 0
        metrics.num_requests_running.set_function(lambda: self.num_in_flight)
        self._request_ids: set[str] = set()  # of the requests in flight
        # Every streamed request's record, for resuming it on any gateway (resume.py).
        self.resume = ResumeStore(
            resume_redis, self.model, config.resume_ttl_s if resume_redis is not None else 0.0,
            ResumeMetrics(metrics.registry),
        )  # fmt: skip

    def _check_model(self, model: str) -> None:
        if model and model != self.model:
            raise NotFoundError(
                f"model {model!r} is not served here; this cluster serves {self.model!r}"
            )

    async def context_limit(self) -> int:
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
            if w.role in ENGINE_ROLES and w.model == self.model and w.max_model_len > 0
        ]
        return min([self.max_model_len, *limits])

    # -- Generate ---------------------------------------------------------------------------

    def _tenant(self, context: Call) -> str | None:
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

    async def prompt_ids(self, request: gateway_pb2.GenerateRequest) -> list[int]:
        """The prompt's token ids as Generate reads them (the HTTP API's echo)."""
        return (await self._tokenize(request))[1]

    @rpc_method
    async def Generate(
        self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        async with contextlib.aclosing(self.generate(request, context)) as messages:
            async for message in messages:
                yield message

    async def generate(
        self, request: gateway_pb2.GenerateRequest, context: Call
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """The request path every front door takes (gRPC's Generate, the HTTP APIs): raises
        PdserveError for the caller to map onto its protocol. Cheap checks and admission
        first, before any tokenization; the request then holds its admission ticket until it
        ends."""
        bind_request_id(request.request_id)
        self._check_model(request.model)
        tenant = self._tenant(context)
        limit = await self.context_limit()
        resuming = request.HasField("resume")
        if not resuming:
            check_sizes(request, limit)
        ticket = self.admission.admit(tenant or "", estimate_prompt_tokens(request))
        try:
            run = (
                self._resumed(request, context, ticket, tenant, limit)
                if resuming
                else self._generate(request, context, ticket, tenant, limit)
            )
            async with contextlib.aclosing(run) as messages:
                async for message in messages:
                    if message.token_ids:
                        ticket.prefilled()
                    yield message
        finally:
            ticket.release()

    async def _generate(
        self,
        request: gateway_pb2.GenerateRequest,
        context: Call,
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
        streams = request.sampling.HasField("kv_eviction")  # StreamingLLM: past the context
        if request.sampling.max_tokens > limit - len(prompt) and not streams:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"prompt ({len(prompt)}) + max_tokens ({request.sampling.max_tokens}) exceeds the "
                f"context of {limit} tokens",
            )
        sampling = SamplingParams.from_pb(request.sampling, limit - len(prompt))
        sampling.check_vocab(self.spec.vocab_size)
        if sampling.kv_eviction is not None:  # refused here, before any prefill
            sampling.kv_eviction.check(self.config.block_size, self.spec.max_position_embeddings)
        if sampling.kv_compression is not None:
            sampling.kv_compression.check(self.config.block_size)
            if sampling.kv_eviction is not None:
                raise InvalidRequestError(
                    "sampling.kv_compression", "SnapKV does not combine with kv_eviction"
                )
        if sampling.structured_output is not None:
            with tracer().start_as_current_span("compile_constraint"):
                await self.constraints.check(sampling.structured_output)
        if request.request_id in self._request_ids:
            raise AlreadyExistsError(f"a request with id {request.request_id!r} is in flight")
        request_id = request.request_id or f"req-{uuid.uuid4().hex[:16]}"
        bind_request_id(request_id)
        describe_request(span, self.model, field, request_id, sampling, len(prompt))
        salt = tenant_cache_salt(tenant, request.cache_salt)
        relay = Relay(
            request_id,
            prompt,
            IncrementalDetokenizer(
                self.tokenizer, prompt, sampling.stop, min_tokens=sampling.min_tokens
            ),
            self.metrics.requests,
        )
        self.metrics.request_prompt_tokens.observe(len(prompt))  # a valid request arrived
        self.num_in_flight += 1
        self._request_ids.add(request_id)
        route: Route | None = None
        failure: BaseException | None = None
        resume_id = ""
        if self.resume.enabled:
            resume_id = self.resume.begin(_worker_request(request_id, prompt, sampling, salt))
        try:
            # Prompt logprobs are computed from every position: no cached prefix counts.
            reuse = sampling.prompt_logprobs is None
            route, overlap = await self._route(request_id, prompt, salt, reuse_prefix=reuse)
            span.set_attributes(route_attributes(route))
            # aclosing: when the client goes away, _run's cleanup (lease release, cancelling
            # the decode call) runs now, not whenever the generator is collected.
            routed = RoutedRequest(route, overlap, relay, sampling, salt, context)
            async with contextlib.aclosing(self._run(routed)) as messages:
                async for message in messages:
                    await self._stamp(resume_id, relay, message, context)
                    yield message
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.num_in_flight -= 1
            self._request_ids.discard(request_id)
            if resume_id:
                self.resume.forget(resume_id)
            record_request(span, self.metrics, relay, route, failure)
            failure = None  # no frame <-> traceback cycle

    async def _stamp(
        self, resume_id: str, relay: Relay, message: gateway_pb2.GenerateResponse, context: Call
    ) -> None:
        """A message's resume token, and its tokens (and end) into the request's record:
        behind the stream, or before the message goes (at most RECORD_WAIT_S) for a front
        door whose clients resume by position alone (``records_before_sending``)."""
        if not resume_id:
            return
        message.resume_token = make_token(resume_id, len(relay.generated))
        self.resume.sent(resume_id, list(message.token_ids))
        if message.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            self.resume.finished(resume_id, message)
        if getattr(context, "records_before_sending", False):
            await self.resume.flushed(resume_id, RECORD_WAIT_S)

    async def resumed_text(self, request: gateway_pb2.GenerateRequest, context: Call) -> str:
        """The text a resumed stream's client holds: the tokens before its resume position
        as the request's detokenizer sent them (what it held back, at a possible stop string
        or a partial character, the continuation sends). Raises as the resume itself would
        (NOT_FOUND, INVALID_ARGUMENT, UNAVAILABLE)."""
        resume_id, position = parse_token(request.resume.resume_token)
        salt = tenant_cache_salt(self._tenant(context), request.cache_salt) or ""
        try:
            record = await self.resume.load(resume_id) if self.resume.enabled else None
        except Exception as exc:
            raise UnavailableError(f"the resume records (Redis) cannot be read: {exc}") from exc
        record, received = check_resume(record, salt, list(request.resume.token_ids), position)
        stored = record.request
        prompt = list(stored.prompt_token_ids)
        sampling = SamplingParams.from_pb(stored.sampling, max(1, len(prompt) + len(received)))
        detok = IncrementalDetokenizer(
            self.tokenizer, prompt, sampling.stop, min_tokens=sampling.min_tokens
        )
        return detok.add(received)

    async def _resumed(
        self,
        request: gateway_pb2.GenerateRequest,
        context: Call,
        ticket: Ticket,
        tenant: str | None,
        limit: int,
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """A broken stream continued (GenerateRequest.resume): the request as its record
        says, after the tokens the client received. A finished request returns its end;
        else a decode worker continues it as a migration does (local prefill of prompt and
        tokens, the block store's KV reused, sampling at the next output position)."""
        span = trace.get_current_span()
        resume_id, position = parse_token(request.resume.resume_token)
        salt = tenant_cache_salt(tenant, request.cache_salt) or ""
        received = list(request.resume.token_ids)
        record: ResumeRecord | None = None
        if self.resume.enabled:
            try:
                record = await self.resume.load(resume_id)
            except Exception as exc:
                raise UnavailableError(f"the resume records (Redis) cannot be read: {exc}") from exc
        outcomes = self.resume.metrics.resumes if self.resume.metrics is not None else None
        try:
            record, received = check_resume(record, salt, received, position)
        except NotFoundError:
            if outcomes is not None:
                outcomes.labels("not_found").inc()
            raise
        except InvalidRequestError:
            if outcomes is not None:
                outcomes.labels("mismatch").inc()
            raise
        stored = record.request
        request_id = stored.request_id
        bind_request_id(request_id)
        prompt = list(stored.prompt_token_ids)
        ticket.account(len(prompt))
        sampling = SamplingParams.from_pb(stored.sampling, max(1, limit - len(prompt)))
        relay = Relay(
            request_id,
            prompt,
            IncrementalDetokenizer(
                self.tokenizer, prompt, sampling.stop, min_tokens=sampling.min_tokens
            ),
            self.metrics.requests,
        )
        relay.detok.add(received)  # the text the client has, held-back tail included
        relay.generated = list(received)
        relay.cached_tokens = len(prompt)  # its prompt's KV was computed before
        span.set_attribute("pdserve.resume.tokens_received", len(received))
        if record.final is not None:  # it finished: its end, nothing generated again
            if outcomes is not None:
                outcomes.labels("finished").inc()
            end = relay.message(record.tokens[len(received):], [])
            end.text += relay.detok.flush()
            end.finish_reason = record.final.finish_reason
            end.usage.CopyFrom(record.final.usage)
            end.timings.CopyFrom(record.final.timings)
            end.resume_token = make_token(resume_id, len(relay.generated))
            yield end
            return
        if outcomes is not None:
            outcomes.labels("continued").inc()
        self.resume.adopt(resume_id, received[len(record.tokens):])
        self.num_in_flight += 1
        route: Route | None = None
        failure: BaseException | None = None
        try:
            route, _ = await self._route(request_id, prompt + received, salt or None,
                                         decode_only=True)  # fmt: skip
            span.set_attributes(route_attributes(route))
            decode_request = decode_pb2.DecodeRequest()
            decode_request.CopyFrom(stored)
            # The worker's id for this attempt: the broken stream's request may still be in
            # flight there (under its own id) until the worker sees its gateway gone.
            decode_request.request_id = f"{request_id}.resume-{uuid.uuid4().hex[:8]}"
            decode_request.local_prefill = True
            decode_request.generated_token_ids[:] = received
            if received:  # the first message carried the prompt logprobs
                decode_request.sampling.ClearField("prompt_logprobs")
            decode = self.decoder.stream(route.decode, decode_request, relay, sampling, context)
            async with contextlib.aclosing(decode) as replies:
                async for reply in replies:
                    await self._stamp(resume_id, relay, reply, context)
                    yield reply
        except BaseException as exc:
            failure = exc
            raise
        finally:
            self.num_in_flight -= 1
            self.resume.forget(resume_id)
            span.set_attribute("pdserve.resume.recomputed_tokens", relay.computed_tokens)
            if self.resume.metrics is not None:
                self.resume.metrics.recomputed_tokens.inc(relay.computed_tokens)
            record_request(span, self.metrics, relay, route, failure)
            failure = None  # no frame <-> traceback cycle

    async def _route(
        self, request_id: str, prompt: list[int], salt: str | None, reuse_prefix: bool = True,
        decode_only: bool = False,
    ) -> tuple[Route, dict[str, int]]:  # fmt: skip
        """The route, and the prefix overlap per location it was chosen on. Without Redis
        (index lookups fail, or are skipped while it is down) the overlap is empty: routing
        goes by load on the last worker list read; so it is for a request that reuses no
        cached prefix (``reuse_prefix`` False: prompt logprobs)."""
        with tracer().start_as_current_span("route") as span:
            # decode_only: a request whose decode worker computes what the cache lacks.
            prefills = [] if decode_only else await self.directory.by_role("prefill", self.model)
            decodes = await self.directory.by_role("decode", self.model)
            weights = self.router.weight_format(request_id, decodes)
            prefills = [w for w in prefills if w.weights == weights]
            decodes = [w for w in decodes if w.weights == weights]
            hashes = hash_prompt_blocks(
                prompt, self.config.block_size, salt, seed=self.config.hash_seed,
                weights=weights or None,
            )  # fmt: skip
            locations: list[dict[str, str]] = []
            indexed = False
            if self.health.should_try():
                try:
                    locations = await self.index.lookup([int(h) for h in hashes])
                    self.health.ok()
                    indexed = True
                except Exception as exc:  # the index is advisory: route without it
                    log.debug("prefix index lookup failed: %s", exc)
                    self.health.failed("index_lookup", exc)
                    span.set_attribute("pdserve.route.index_error", str(exc))
            if not indexed:
                self.metrics.routed_without_index.inc()
            span.set_attribute("pdserve.route.index_used", indexed)
            span.set_attribute("pdserve.route.weights", weights or "float")
            overlap = prefix_overlap(locations) if reuse_prefix else {}
            self.breakers.keep_only(w.worker_id for w in self.directory.known())
            route = self.router.choose(
                request_id,
                len(prompt),
                overlap,
                self.breakers.usable(prefills),
                self.breakers.usable(decodes) or decodes,  # all failing: try them all the same
            )
            self.breakers.acquire(route.decode.worker_id)
            if route.prefill is not None:
                self.breakers.acquire(route.prefill.worker_id)
            span.set_attributes(route_attributes(route))
            span.set_attribute("pdserve.route.num_prompt_blocks", len(hashes))
        self.metrics.routed(route.reason)
        return route, overlap

    async def _run(
        self, routed: RoutedRequest
    ) -> AsyncGenerator[gateway_pb2.GenerateResponse, None]:
        """Prefill (with failover), then decode (with migration); the prefill's lease goes
        to the decode hop, or back to its producer when the request ends before that."""
        route, relay, sampling = routed.route, routed.relay, routed.sampling
        decode_request = _worker_request(relay.request_id, relay.prompt, sampling, routed.salt)
        first: gateway_pb2.GenerateResponse | None = None
        prefilled = None
        if route.prefill is not None:
            # Counted on its decode worker from now: requests routed while others prefill
            # would all pick the same decode worker (its heartbeat does not know them yet).
            with self.router.calling(route.decode.worker_id):
                prefilled = await self.prefiller.prefill(routed)
        if prefilled is None:
            decode_request.local_prefill = True
        else:
            relay.cached_tokens = prefilled.cached_tokens
            first = relay.message(
                [prefilled.first_token_id], _first_logprob(prefilled), prefilled.prompt_logprobs
            )
            # Delivered with the first token: the decode worker need not compute them again.
            decode_request.sampling.ClearField("prompt_logprobs")
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
                route.decode, decode_request, relay, sampling, routed.context
            )
            # aclosing: the decode call is cancelled (and an unused lease released) as soon
            # as the client goes away.
            async with contextlib.aclosing(decode) as replies:
                async for reply in replies:
                    yield reply
        finally:
            if prefilled is not None and not decoding:
                self.leases.handle(prefilled.kv_handle)

    # -- the other RPCs -----------------------------------------------------------------------

    @rpc_method
    async def GetModelInfo(
        self, request: gateway_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> gateway_pb2.GetModelInfoResponse:
        self._check_model(request.model)
        return gateway_pb2.GetModelInfoResponse(
            model=self.model,
            architecture=self.spec.architecture,
            max_context_tokens=await self.context_limit(),
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
        check_sizes(request, await self.context_limit())
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
        try:
            workers = await self.directory.refresh()
        except Exception as exc:
            workers = self.directory.known()
            if not workers:
                raise UnavailableError(
                    f"the worker registry (Redis) cannot be read: {exc}"
                ) from exc
        endpoints = [url for url in (self.http_address, self.kserve_address) if url]
        statuses = await cluster_status(
            workers, self.channels, self.gateway_id, self.address, self.model, endpoints
        )
        return gateway_pb2.GetClusterStatusResponse(
            workers=statuses,
            routing_index=gateway_pb2.RoutingIndexStatus(
                available=self.health.available,
                error=self.health.error,
                unavailable_since_unix_ms=self.health.unavailable_since_unix_ms,
            ),
            circuits=[
                gateway_pb2.CircuitStatus(
                    worker_id=worker_id,
                    state=_CIRCUIT_STATES[breaker.state],
                    consecutive_failures=breaker.consecutive_failures,
                )
                for worker_id, breaker in sorted(self.breakers.not_closed().items())
            ],
        )

    async def close(self) -> None:
        await self.resume.close()
        await self.leases.close()
        await self.channels.close()
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)


def _worker_request(
    request_id: str, prompt: list[int], sampling: SamplingParams, salt: str | None
) -> decode_pb2.DecodeRequest:
    """The request as the workers see it (what a resume record keeps)."""
    request = decode_pb2.DecodeRequest(
        request_id=request_id, prompt_token_ids=prompt, cache_salt=salt or ""
    )
    sampling.to_pb(request.sampling)
    return request


def _first_logprob(response: prefill_pb2.PrefillResponse) -> list[common_pb2.TokenLogprob]:
    return [response.first_logprob] if response.HasField("first_logprob") else []
