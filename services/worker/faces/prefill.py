"""The prefill face of an engine worker (PrefillService): prefill one prompt, hand back the
first token and a KvHandle. Admitted while the worker's role takes prefill calls (prefill,
both); a prefill under way when the role changes finishes, and its lease stands."""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from common.contract.sampling import SamplingParams
from common.engine.request import FinishReason
from common.errors import InvalidRequestError, NotFoundError
from common.kv.hashing import HASH_SCHEME_VERSION
from common.planner.types import PREFILL
from common.rpc.channels import remaining_timeout
from common.rpc.errors import rpc_method
from common.telemetry.logs import bind_request_id
from common.telemetry.metrics import TokenTimes
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from pdserve.prefill.v1 import prefill_pb2, prefill_pb2_grpc
from services.worker.pb import finish_reason_pb, logprob_pb
from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

# How long a prefill's reply waits for its blocks to reach the prefix index (Redis down or
# slow: the reply goes on without, and the write finishes in the background).
PUBLISH_WAIT_S = 0.05


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    @rpc_method
    async def Prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        with self.runtime.admit(PREFILL, request.request_id):
            return await self._prefill(request, context)

    async def _prefill(
        self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.PrefillResponse:
        arrival = time.monotonic()
        runtime = self.runtime
        bind_request_id(request.request_id)
        if not request.request_id:
            raise InvalidRequestError("request_id", "a request_id is required")
        if len(request.lease_id) > 128:
            raise InvalidRequestError("lease_id", "at most 128 characters")
        prompt = list(request.prompt_token_ids)
        if not prompt:
            raise InvalidRequestError("prompt_token_ids", "the prompt is empty")
        max_len = runtime.engine.max_model_len
        sampling = SamplingParams.from_pb(request.sampling, max(1, max_len - len(prompt)))
        salt = request.cache_salt or None
        kv_import = None
        if sampling.prompt_logprobs is None:  # prompt logprobs: every position computed here
            kv_import = await runtime.kv.from_store(prompt, salt, remaining_timeout(context))
        imported = kv_import.num_tokens if kv_import is not None else 0

        metrics = runtime.metrics.requests
        with tracer().start_as_current_span("prefill") as span:
            admitted = time.monotonic()
            last = None
            prompt_logprobs = None
            try:
                async for out in runtime.loop.generate(
                    request.request_id,
                    prompt,
                    sampling,
                    cache_salt=salt,
                    prefill_only=True,
                    kv_import=kv_import,
                ):
                    last = out
                    prompt_logprobs = out.prompt_logprobs or prompt_logprobs
            except asyncio.CancelledError:
                metrics.finished("abort")
                raise
            assert last is not None and last.finished, "prefill stream ended without a result"
            done = time.monotonic()
            scheduled = last.first_scheduled_time or admitted
            cached = last.num_cached_tokens + imported
            finish = last.finish_reason.value if last.finish_reason else "abort"
            span.set_attributes(
                {
                    "pdserve.prompt_tokens": len(prompt),
                    "pdserve.cached_tokens": cached,
                    "pdserve.imported_tokens": imported,
                    "pdserve.computed_tokens": len(prompt) - cached,
                    "pdserve.queue_ms": (scheduled - admitted) * 1000,
                    "pdserve.prefill_ms": (done - scheduled) * 1000,
                    "pdserve.finish_reason": finish,
                }
            )
        response = prefill_pb2.PrefillResponse(
            first_token_id=last.new_token_ids[0],
            cached_tokens=cached,
            computed_tokens=len(prompt) - cached,
            queue_ms=(scheduled - arrival) * 1000,
            prefill_ms=(done - scheduled) * 1000,
            finish_reason=finish_reason_pb(last.finish_reason),
        )
        if last.new_logprobs and last.new_logprobs[0] is not None:
            response.first_logprob.CopyFrom(logprob_pb(last.new_logprobs[0]))
        if prompt_logprobs is not None:  # entry 0 (the first prompt token) is None
            response.prompt_logprobs.extend(
                logprob_pb(lp) for lp in prompt_logprobs if lp is not None
            )
        if last.finish_reason is FinishReason.PREFILLED:
            response.kv_handle.CopyFrom(
                await self._lease(request.request_id, prompt, salt, request.lease_id)
            )
        end = time.monotonic()
        metrics.request_queue_time.observe(scheduled - admitted)
        TokenTimes(metrics, arrival).tokens(len(last.new_token_ids), done)
        metrics.e2e_request_latency.observe(end - arrival)
        metrics.prompt_tokens.inc(len(prompt))
        metrics.finished(finish)
        log.info(
            "prefill %s: %s, prompt %d tokens (%d cached, %d imported, %d computed); "
            "queue %.1f ms, prefill %.1f ms, total %.1f ms",
            request.request_id,
            finish,
            len(prompt),
            last.num_cached_tokens,
            imported,
            len(prompt) - cached,
            (scheduled - admitted) * 1000,
            (done - scheduled) * 1000,
            (end - arrival) * 1000,
        )
        return response

    async def _lease(
        self, request_id: str, prompt: list[int], salt: str | None, lease_id: str
    ) -> common_pb2.KvHandle:
        """Exports the held KV under a lease; on any failure the held blocks are freed."""
        runtime = self.runtime
        try:
            export = await runtime.loop.call(lambda e: e.export_kv(request_id))
            hashes = [int(h) for h in export.block_hashes]
            kept = export.kept_blocks
            # A compressed prompt's lease holds its kept blocks (the partial last one has
            # no hash); the store takes the run of them that is still a dense prefix.
            leased = hashes if kept is None else [hashes[i] for i in kept if i < len(hashes)]
            stored = len(hashes) if kept is None else _dense_run(kept, len(hashes))
            lease = await runtime.leases.create(
                request_id, export.num_tokens, leased, export.data, lease_id
            )
        except BaseException:
            runtime.loop.submit(lambda e: e.release(request_id))
            raise
        if lease is None:  # the caller released it before it existed: blocks already freed
            raise NotFoundError(f"lease {lease_id!r} was released by the caller; request dropped")
        published = runtime.in_background(runtime.sync.publish_blocks(hashes))
        if stored:
            runtime.in_background(runtime.store.put(hashes[:stored], export.data[:stored]))
        # The first token reaches the caller once the index knows these blocks (up to a
        # bound: Redis is advisory), so a request routed after it (an n-copies request's
        # later copies, a client's next turn) finds them; in the background it raced the
        # reply and such a request could miss the blocks it was sent after.
        await asyncio.wait({published}, timeout=PUBLISH_WAIT_S)
        return common_pb2.KvHandle(
            request_id=request_id,
            hash_scheme_version=HASH_SCHEME_VERSION,
            block_hashes=hashes,
            num_tokens=export.num_tokens,
            layout=runtime.layout.to_pb(),
            producer_address=runtime.address,
            lease_id=lease.lease_id,
            lease_expiry_unix_ms=lease.expiry_unix_ms,
            model=runtime.model,
            weight_format=runtime.engine.weight_identity or "",
            kept_block_indices=kept or [],
        )

    @rpc_method
    async def GetStatus(
        self, request: prefill_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> prefill_pb2.GetStatusResponse:
        stats = await self.runtime.stats()
        return prefill_pb2.GetStatusResponse(status=self.runtime.status_pb(stats))


def _dense_run(kept: list[int], num_full: int) -> int:
    """How many of the kept blocks are the prompt's first full blocks, in order."""
    run = 0
    while run < len(kept) and kept[run] == run and run < num_full:
        run += 1
    return run
