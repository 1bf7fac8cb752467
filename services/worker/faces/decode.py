"""The decode face of an engine worker (DecodeService): a request's KV imported
(services/worker/kv_import.py), then its tokens streamed.

Admitted while the worker's role takes decode calls (decode, both). When the role changes
away from decode, every stream here ends with UNAVAILABLE (reason ROLE_CHANGED) before its
next message, and its gateway continues it on another decode worker from the stored KV.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

import grpc
from opentelemetry.trace import Span

from common.contract.sampling import SamplingParams
from common.engine.engine import RequestOutput
from common.engine.request import KvImport
from common.errors import InvalidRequestError
from common.planner.types import DECODE
from common.rpc.channels import remaining_timeout
from common.rpc.errors import rpc_method
from common.rpc.tracing import record_error
from common.telemetry.logs import bind_request_id
from common.telemetry.metrics import RequestMetrics, TokenTimes
from common.telemetry.tracing import tracer
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from services.worker.kv_import import Transfer
from services.worker.pb import finish_reason_pb, logprob_pb
from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    @rpc_method
    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        with self.runtime.admit(DECODE, request.request_id):
            # aclosing: a cancelled call runs _decode's cleanup now (frees the blocks).
            async with contextlib.aclosing(self._decode(request, context)) as messages:
                async for message in messages:
                    yield message

    async def _decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[decode_pb2.DecodeResponse, None]:
        arrival = time.monotonic()
        runtime = self.runtime
        bind_request_id(request.request_id)
        if not request.request_id:
            raise InvalidRequestError("request_id", "a request_id is required")
        prompt = list(request.prompt_token_ids)
        generated = list(request.generated_token_ids)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids", "the prompt is empty")
        source = request.WhichOneof("kv_source")
        if source is None or (source == "local_prefill" and not request.local_prefill):
            raise InvalidRequestError("kv_source", "set kv_handle, or local_prefill = true")
        max_len = runtime.engine.max_model_len
        sampling = SamplingParams.from_pb(request.sampling, max(1, max_len - len(prompt)))
        salt = request.cache_salt or None
        timeout = remaining_timeout(context)

        kv_import: KvImport | None = None
        transfer = Transfer()
        handle = request.kv_handle if source == "kv_handle" else None
        if handle is not None or sampling.prompt_logprobs is None:
            kv_import, transfer = await runtime.kv.for_decode(
                handle, prompt, generated, salt, timeout
            )
        if sampling.prompt_logprobs is not None:
            kv_import = None  # prompt logprobs: the engine computes every position itself
        runtime.roles.admit(DECODE, runtime.worker_id)  # it may have changed meanwhile
        imported = kv_import.num_tokens if kv_import is not None else 0
        admitted = time.monotonic()

        metrics = runtime.metrics.requests
        span = tracer().start_span(
            "decode", attributes={"pdserve.local_prefill": source != "kv_handle"}
        )
        if sampling.structured_output is not None:  # rebuilt here from the tokens so far
            span.set_attribute("pdserve.structured_output", sampling.structured_output.kind.value)
        stream = _Stream(arrival, admitted, metrics)
        published = False
        outputs = runtime.loop.generate(
            request.request_id,
            prompt,
            sampling,
            cache_salt=salt,
            output_token_ids=generated,
            kv_import=kv_import,
            write_behind=runtime.store.enabled,
        )
        try:
            # aclosing: a cancelled call aborts the request now, not when the generator is
            # collected.
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    runtime.roles.admit(DECODE, runtime.worker_id)
                    if out.full_blocks is not None:
                        runtime.store.write_behind(out.full_blocks)
                    stream.add(out, len(prompt))
                    message = decode_pb2.DecodeResponse(token_ids=out.new_token_ids)
                    if sampling.logprobs or sampling.top_logprobs:
                        message.logprobs.extend(
                            logprob_pb(lp) for lp in out.new_logprobs if lp is not None
                        )
                    if out.prompt_logprobs is not None:  # entry 0 (the first token) is None
                        message.prompt_logprobs.extend(
                            logprob_pb(lp) for lp in out.prompt_logprobs if lp is not None
                        )
                    if not published and (kv_import is None or kv_import.kept_blocks is None):
                        # The prompt's full blocks now sit in this worker's cache (not those
                        # a compressed prompt dropped).
                        runtime.in_background(
                            runtime.sync.publish_blocks(runtime.block_hashes(prompt, salt))
                        )
                        published = True
                    if out.finished:
                        context_len = len(prompt) + len(generated)
                        message.finish_reason = finish_reason_pb(out.finish_reason)
                        cached = out.num_context_cached_tokens
                        message.cached_tokens = cached
                        message.imported_tokens = imported
                        message.computed_tokens = max(0, context_len - cached - imported)
                        message.kv_transfer_bytes = transfer.num_bytes
                        message.kv_transfer_ms = transfer.ms
                        message.queue_ms = stream.queue_ms(transfer.ms)
                        stream.cached_tokens = cached
                    yield message
        except BaseException as exc:
            stream.failure = exc
            record_error(span, exc)
            raise
        finally:
            stream.close(span, transfer, imported, request.request_id, len(prompt))

    @rpc_method
    async def GetStatus(
        self, request: decode_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.GetStatusResponse:
        stats = await self.runtime.stats()
        return decode_pb2.GetStatusResponse(status=self.runtime.status_pb(stats))


class _Stream:
    """One Decode call's timings and counts, for its metrics, span and log line."""

    def __init__(self, arrival: float, admitted: float, metrics: RequestMetrics) -> None:
        self.arrival = arrival
        self.admitted = admitted
        self.scheduled: float | None = None
        self.metrics = metrics
        self.times = TokenTimes(metrics, arrival)
        self.num_generated = 0
        self.cached_tokens = 0
        self.spec = (0, 0, 0)  # speculation: verify rounds, proposals verified, kept
        self.finish: str | None = None
        self.failure: BaseException | None = None

    def add(self, out: RequestOutput, num_prompt: int) -> None:
        metrics = self.metrics
        now = time.monotonic()
        if self.scheduled is None:
            self.scheduled = out.first_scheduled_time or self.admitted
            metrics.request_queue_time.observe(max(0.0, self.scheduled - self.admitted))
            metrics.prompt_tokens.inc(num_prompt)
        if out.new_token_ids:
            self.times.tokens(len(out.new_token_ids), now)
            self.num_generated += len(out.new_token_ids)
        if out.finish_reason is not None:
            self.finish = out.finish_reason.value
        if out.new_token_ids:
            self.spec = out.spec

    def queue_ms(self, transfer_ms: float) -> float:
        """Waiting time before the first step, less the KV transfer (reported apart)."""
        scheduled = self.scheduled or self.admitted
        return max(0.0, (scheduled - self.arrival) * 1000 - transfer_ms)

    def close(
        self,
        span: Span,
        transfer: Transfer,
        imported: int,
        request_id: str,
        num_prompt: int,
    ) -> None:
        metrics = self.metrics
        now = time.monotonic()
        finish = self.finish
        if finish is None and isinstance(self.failure, (asyncio.CancelledError, GeneratorExit)):
            finish = "abort"
        if finish is not None:
            metrics.finished(finish)
            metrics.e2e_request_latency.observe(now - self.arrival)
        queue_ms = ((self.scheduled or now) - self.admitted) * 1000
        span.set_attributes(
            {
                "pdserve.queue_ms": queue_ms,
                "pdserve.tokens_generated": self.num_generated,
                "pdserve.prompt_tokens": num_prompt,
                "pdserve.cached_tokens": self.cached_tokens,
                "pdserve.imported_tokens": imported,
                "pdserve.kv.source": transfer.peer or "computed",
                "pdserve.finish_reason": finish or "error",
            }
        )
        rounds, proposed, kept = self.spec
        if rounds:  # a speculating worker: what was proposed and kept for this request
            span.set_attributes(
                {
                    "pdserve.spec.rounds": rounds,
                    "pdserve.spec.draft_tokens": proposed,
                    "pdserve.spec.accepted_tokens": kept,
                    "pdserve.spec.mean_acceptance_length": 1 + kept / rounds,
                }
            )
        span.end()
        log.info(
            "decode %s: %s, prompt %d tokens (%d context tokens cached, %d imported from %s: %d bytes in "
            "%.1f ms), %d tokens generated; queue %.1f ms, ttft %.1f ms, total %.1f ms",
            request_id,
            finish or f"failed ({type(self.failure).__name__}: {self.failure})",
            num_prompt,
            self.cached_tokens,
            imported,
            transfer.peer or "-",
            transfer.num_bytes,
            transfer.ms,
            self.num_generated,
            queue_ms,
            self.times.ttft_ms(now),
            (now - self.arrival) * 1000,
        )

