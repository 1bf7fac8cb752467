"""GatewayService: validate, tokenize, route, relay tokens, detokenize, account."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc

from common.engine.sampling_params import SamplingParams
from common.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    NotFoundError,
    PdserveError,
    QueueFullError,
    UnavailableError,
)
from common.index.prefix_index import PrefixIndex, prefix_overlap
from common.kv.hashing import HASH_SCHEME_VERSION, hash_prompt_blocks
from common.kv.pull import release_lease
from common.models.spec import ModelSpec
from common.rpc.channels import ChannelPool, remaining_timeout
from common.rpc.errors import from_rpc_error, rpc_method
from common.text.detokenizer import IncrementalDetokenizer
from common.text.tokenizer import Tokenizer
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from pdserve.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.directory import WorkerDirectory
from services.gateway.frontend import prompt_token_ids
from services.gateway.routing import Route, Router
from services.gateway.status import cluster_status

log = logging.getLogger(__name__)


class _Relay:
    """One request's running state while tokens stream through the gateway."""

    def __init__(self, request_id: str, prompt: list[int], detok: IncrementalDetokenizer) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.detok = detok
        self.generated: list[int] = []
        self.cached_tokens = 0
        self.arrival = time.monotonic()
        self.first_token_at: float | None = None
        self.queue_ms = 0.0

    def message(self, token_ids: list[int], logprobs: list[Any]) -> gateway_pb2.GenerateResponse:
        self.generated += token_ids
        if self.first_token_at is None and token_ids:
            self.first_token_at = time.monotonic()
        return gateway_pb2.GenerateResponse(
            request_id=self.request_id,
            text=self.detok.add(token_ids),
            token_ids=token_ids,
            logprobs=logprobs,
        )

    def finish(
        self, message: gateway_pb2.GenerateResponse, reason: common_pb2.FinishReason
    ) -> gateway_pb2.GenerateResponse:
        now = time.monotonic()
        message.text += self.detok.flush()
        message.finish_reason = reason
        message.usage.CopyFrom(
            common_pb2.Usage(
                prompt_tokens=len(self.prompt),
                completion_tokens=len(self.generated),
                cached_tokens=self.cached_tokens,
            )
        )
        first = self.first_token_at or now
        message.timings.CopyFrom(
            gateway_pb2.Timings(
                queue_ms=self.queue_ms,
                ttft_ms=(first - self.arrival) * 1000,
                total_ms=(now - self.arrival) * 1000,
            )
        )
        return message


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
        self.gateway_id = gateway_id
        self.address = address
        self.num_in_flight = 0
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
        self._check_model(request.model)
        field, prompt = prompt_token_ids(request, self.tokenizer, self.spec.vocab_size)
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
        salt = request.cache_salt or None
        relay = _Relay(
            request_id, prompt, IncrementalDetokenizer(self.tokenizer, prompt, sampling.stop)
        )
        self.num_in_flight += 1
        self._request_ids.add(request_id)
        try:
            route = await self._route(request_id, prompt, salt)
            async for message in self._run(route, relay, sampling, salt, context):
                yield message
        finally:
            self.num_in_flight -= 1
            self._request_ids.discard(request_id)

    async def _route(self, request_id: str, prompt: list[int], salt: str | None) -> Route:
        hashes = hash_prompt_blocks(
            prompt, self.config.block_size, salt, seed=self.config.hash_seed
        )
        try:
            locations = await self.index.lookup([int(h) for h in hashes])
        except Exception as exc:  # the index is advisory: route without it
            log.warning("prefix index lookup failed: %s", exc)
            locations = []
        overlap = prefix_overlap(locations)
        prefills = await self.directory.by_role("prefill", self.model)
        decodes = await self.directory.by_role("decode", self.model)
        return self.router.choose(request_id, len(prompt), overlap, prefills, decodes)

    async def _run(
        self,
        route: Route,
        relay: _Relay,
        sampling: SamplingParams,
        salt: str | None,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[gateway_pb2.GenerateResponse]:
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
        self.router.in_flight[decode_id] += 1
        try:
            if first is not None:
                if relay.detok.stop_string is not None:
                    yield relay.finish(first, common_pb2.FINISH_REASON_STOP)
                    return
                yield first
            stub = decode_pb2_grpc.DecodeServiceStub(self.channels.get(route.decode.address))
            call = stub.Decode(decode_request, timeout=remaining_timeout(context))
            async for message in call:
                started = True
                reply = relay.message(list(message.token_ids), list(message.logprobs))
                if route.prefill is None and message.finish_reason:
                    relay.cached_tokens = message.cached_tokens + message.imported_tokens
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
            error = _downstream_error(exc, f"decode worker {decode_id}")
            if relay.generated and not isinstance(error, asyncio.TimeoutError):
                # Tokens already reached the client: close the stream's accounting first.
                ending = gateway_pb2.GenerateResponse(request_id=relay.request_id)
                yield relay.finish(ending, common_pb2.FINISH_REASON_ERROR)
            raise error from exc
        finally:
            self.router.in_flight[decode_id] -= 1
            if call is not None and not call.done():
                call.cancel()
            if handle is not None and not started:
                self._release_later(handle)

    async def _prefill(
        self,
        route: Route,
        relay: _Relay,
        sampling: SamplingParams,
        salt: str | None,
        context: grpc.aio.ServicerContext,
    ) -> prefill_pb2.PrefillResponse:
        assert route.prefill is not None
        worker = route.prefill
        request = prefill_pb2.PrefillRequest(
            request_id=relay.request_id, prompt_token_ids=relay.prompt, cache_salt=salt or ""
        )
        sampling.to_pb(request.sampling)
        stub = prefill_pb2_grpc.PrefillServiceStub(self.channels.get(worker.address))
        self.router.in_flight[worker.worker_id] += 1
        relay.queue_ms = (time.monotonic() - relay.arrival) * 1000
        call = stub.Prefill(request, timeout=remaining_timeout(context))
        try:
            response: prefill_pb2.PrefillResponse = await call
        except grpc.aio.AioRpcError as exc:
            raise _downstream_error(exc, f"prefill worker {worker.worker_id}") from exc
        except asyncio.CancelledError:
            call.cancel()
            self._in_background(self._release_if_leased(call))
            raise
        finally:
            self.router.in_flight[worker.worker_id] -= 1
        relay.queue_ms += response.queue_ms
        return response

    async def _release_if_leased(self, call: grpc.aio.UnaryUnaryCall) -> None:
        """A Prefill call given up on may have finished all the same (its response arrived
        before the cancel): then nobody else knows its lease, so release it here."""
        try:
            response: prefill_pb2.PrefillResponse = await call
        except (asyncio.CancelledError, grpc.aio.AioRpcError):
            return  # the worker aborted the request and freed its blocks
        if response.HasField("kv_handle"):
            await self._release(response.kv_handle)

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


def _downstream_error(exc: grpc.aio.AioRpcError, what: str) -> Exception:
    """What to answer when a worker call fails. The caller's deadline, passed down, expires
    there first: that stays DEADLINE_EXCEEDED (tokens sent stand), not a server fault."""
    if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
        return asyncio.TimeoutError(f"{what}: the deadline passed")
    return from_rpc_error(exc, what)


def _first_logprob(response: prefill_pb2.PrefillResponse) -> list[common_pb2.TokenLogprob]:
    return [response.first_logprob] if response.HasField("first_logprob") else []
