"""DecodeService: pull (or compute) a request's KV, then stream its tokens."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass

import grpc
from opentelemetry.trace import Span, SpanKind

from common.contract.sampling import SamplingParams
from common.engine.engine import RequestOutput
from common.engine.request import KvImport
from common.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    KvLoadError,
)
from common.kv.hashing import HASH_SCHEME_VERSION
from common.kv.layout import KvLayout
from common.kv.pull import pull_kv
from common.kv.release import RELEASE_RETRY_S, release_lease
from common.rpc.channels import remaining_timeout
from common.rpc.errors import rpc_method
from common.rpc.tracing import record_error
from common.telemetry.logs import bind_request_id
from common.telemetry.metrics import RequestMetrics, TokenTimes
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc
from services.worker.metrics import BLOCK_STORE, PRODUCER, RECEIVED
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
        with self.runtime.admit():
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
        transfer = _Transfer()
        if source == "kv_handle":
            kv_import, transfer = await self._fetch(
                request.kv_handle, prompt, generated, salt, timeout
            )
        elif sampling.prompt_logprobs is None:
            kv_import = await runtime.import_from_store(prompt + generated, salt, timeout)
            if kv_import is not None:
                transfer.peer = BLOCK_STORE
                transfer.num_bytes = kv_import.data.numel() * kv_import.data.element_size()
        if sampling.prompt_logprobs is not None:
            kv_import = None  # prompt logprobs: the engine computes every position itself
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
                        message.cached_tokens = out.num_cached_tokens
                        message.imported_tokens = imported
                        message.computed_tokens = max(
                            0, context_len - out.num_cached_tokens - imported
                        )
                        message.kv_transfer_bytes = transfer.num_bytes
                        message.kv_transfer_ms = transfer.ms
                        message.queue_ms = stream.queue_ms(transfer.ms)
                        stream.cached_tokens = out.num_cached_tokens
                    yield message
        except BaseException as exc:
            stream.failure = exc
            record_error(span, exc)
            raise
        finally:
            stream.close(span, transfer, imported, request.request_id, len(prompt))

    async def _fetch(
        self,
        handle: common_pb2.KvHandle,
        prompt: list[int],
        generated: list[int],
        salt: str | None,
        timeout: float | None,
    ) -> tuple[KvImport | None, _Transfer]:
        """The prompt's KV: pulled from its producer; when that fails (the producer died,
        hangs past --kv-pull-timeout-s, lost the lease, sent corrupt bytes), the full blocks
        the block store holds; what neither supplies is recomputed here, or with
        ``--kv-load-failure fail`` the request fails with UNAVAILABLE (reason
        KV_LOAD_FAILED). None: everything is computed here."""
        runtime = self.runtime
        if not generated:
            raise InvalidRequestError("generated_token_ids", "a kv_handle needs the first token")
        if handle.num_tokens != len(prompt):
            raise InvalidRequestError(
                "kv_handle.num_tokens", f"{handle.num_tokens} != prompt length {len(prompt)}"
            )
        if handle.hash_scheme_version != HASH_SCHEME_VERSION or handle.model != runtime.model:
            raise FailedPreconditionError(
                f"kv_handle is for model {handle.model!r}, hash scheme {handle.hash_scheme_version}; "
                f"this worker serves {runtime.model!r}, scheme {HASH_SCHEME_VERSION}"
            )
        weights = runtime.engine.weight_identity or ""
        if handle.weight_format != weights:
            raise FailedPreconditionError(
                f"kv_handle's KV was computed under weights {handle.weight_format or 'float'!r}; "
                f"this worker serves {weights or 'float'!r}, and KV of one format is never "
                "reused as another's"
            )
        runtime.layout.check_same(KvLayout.from_pb(handle.layout), "kv_handle")
        channel = runtime.channels.get(handle.producer_address)
        metrics = runtime.metrics
        pull_timeout = runtime.config.kv_pull_timeout_s
        if timeout is not None:
            pull_timeout = min(pull_timeout, timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            pulled = await pull_kv(channel, handle, runtime.layout, pull_timeout)
        except asyncio.CancelledError:
            metrics.transfer_failed(PRODUCER, RECEIVED)
            raise
        except Exception as exc:
            metrics.transfer_failed(PRODUCER, RECEIVED)
            if deadline is not None and time.monotonic() >= deadline:
                raise asyncio.TimeoutError("the deadline passed while pulling KV") from exc
            log.warning(
                "request %s: pulling KV from %s failed (%s); trying the block store",
                handle.request_id,
                handle.producer_address,
                _describe(exc),
            )
            return await self._recover(handle, prompt, salt, timeout, _describe(exc))
        finally:
            runtime.in_background(
                release_lease(
                    channel,
                    handle.lease_id,
                    retry_for_s=RELEASE_RETRY_S,
                    expiry_unix_ms=handle.lease_expiry_unix_ms,
                )
            )
        metrics.transferred(
            PRODUCER, RECEIVED, pulled.num_bytes, pulled.num_blocks, pulled.elapsed_ms / 1000
        )
        transfer = _Transfer(PRODUCER, pulled.num_bytes, pulled.elapsed_ms)
        kept = list(handle.kept_block_indices) or None  # a compressed prompt's (SnapKV)
        return KvImport(handle.num_tokens, pulled.data, kept), transfer

    async def _recover(
        self,
        handle: common_pb2.KvHandle,
        prompt: list[int],
        salt: str | None,
        timeout: float | None,
        why: str,
    ) -> tuple[KvImport | None, _Transfer]:
        """After a failed pull: the block store's blocks, then recompute (or fail)."""
        runtime = self.runtime
        metrics = runtime.metrics
        wanted = len(handle.block_hashes)
        kv: KvImport | None = None
        transfer = _Transfer()
        store_error = ""
        try:
            kv, transfer = await self._from_store(handle, timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            store_error = _describe(exc)
        num_blocks = 0 if kv is None else kv.num_tokens // runtime.engine.block_size
        if wanted and num_blocks == wanted:
            metrics.kv_load_fallbacks.labels("block_store").inc()
            return kv, transfer
        if runtime.config.kv_load_failure == "fail":
            metrics.kv_load_fallbacks.labels("failed").inc()
            store_what = store_error or f"it holds {num_blocks} of the {wanted} full blocks"
            raise KvLoadError(
                f"the KV of request {handle.request_id} could not be loaded: producer "
                f"{handle.producer_address}: {why}; block store: {store_what} "
                "(this decode worker runs with --kv-load-failure fail)"
            )
        metrics.kv_load_fallbacks.labels("recompute").inc()
        if kv is not None:
            # This worker's own prefix cache may hold more of the prompt than the store.
            num_store_tokens = kv.num_tokens
            local = await runtime.loop.call(lambda e: e.num_cached_prefix_tokens(prompt, salt))
            if local >= num_store_tokens:
                kv, transfer = None, _Transfer()
        log.warning(
            "request %s: recomputing %d of %d prompt tokens here (block store: %s)",
            handle.request_id,
            len(prompt) - (kv.num_tokens if kv is not None else 0),
            len(prompt),
            store_error or f"{num_blocks} of {wanted} full blocks",
        )
        return kv, transfer

    async def _from_store(
        self, handle: common_pb2.KvHandle, timeout: float | None
    ) -> tuple[KvImport | None, _Transfer]:
        """The leading full blocks of the handle the block store holds (None when none); the
        tail (a partial block, or blocks the store lacks) is recomputed here."""
        runtime = self.runtime
        hashes = list(handle.block_hashes)
        with tracer().start_as_current_span("kv_transfer", kind=SpanKind.CLIENT) as span:
            span.set_attribute("pdserve.kv.source", BLOCK_STORE)
            try:
                present = await runtime.store.present(hashes, timeout)
                read = (
                    await runtime.store.read(hashes[:present], timeout, span) if present else None
                )
            except BaseException as exc:
                runtime.metrics.transfer_failed(BLOCK_STORE, RECEIVED)
                record_error(span, exc)
                raise
            if read is None:
                span.set_attribute("pdserve.kv.blocks", 0)
                return None, _Transfer()
        return read.kv, _Transfer(BLOCK_STORE, read.num_bytes, read.seconds * 1000)

    @rpc_method
    async def GetStatus(
        self, request: decode_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.GetStatusResponse:
        stats = await self.runtime.stats()
        return decode_pb2.GetStatusResponse(status=self.runtime.status_pb(stats))


@dataclass
class _Transfer:
    """How the request's KV arrived (peer empty: computed here)."""

    peer: str = ""
    num_bytes: int = 0
    ms: float = 0.0


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
        transfer: _Transfer,
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
            "decode %s: %s, prompt %d tokens (%d cached, %d imported from %s: %d bytes in "
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


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
