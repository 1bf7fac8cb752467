"""DecodeService: pull (or compute) a request's KV, then stream its tokens."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc

from common.engine.request import KvImport
from common.engine.sampling_params import SamplingParams
from common.errors import (
    DataLossError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
from common.kv.hashing import HASH_SCHEME_VERSION
from common.kv.layout import KvLayout
from common.kv.pull import pull_kv, release_lease
from common.rpc.channels import remaining_timeout
from common.rpc.errors import rpc_method
from common.worker.pb import finish_reason_pb, logprob_pb
from common.worker.runtime import WorkerRuntime
from pdserve.common.v1 import common_pb2
from pdserve.decode.v1 import decode_pb2, decode_pb2_grpc

log = logging.getLogger(__name__)


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    @rpc_method
    async def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        arrival = time.monotonic()
        runtime = self.runtime
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
        num_bytes, transfer_ms = 0, 0.0
        if source == "kv_handle":
            kv_import, num_bytes, transfer_ms = await self._fetch(
                request.kv_handle, prompt, generated, timeout
            )
        else:
            kv_import = await runtime.import_from_store(prompt + generated, salt, timeout)
        imported = kv_import.num_tokens if kv_import is not None else 0
        admitted = time.monotonic()

        published = False
        outputs = runtime.loop.generate(
            request.request_id,
            prompt,
            sampling,
            cache_salt=salt,
            output_token_ids=generated,
            kv_import=kv_import,
        )
        # aclosing: a cancelled call aborts the request now, not when the generator is collected.
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                message = decode_pb2.DecodeResponse(token_ids=out.new_token_ids)
                if sampling.logprobs or sampling.top_logprobs:
                    message.logprobs.extend(
                        logprob_pb(lp) for lp in out.new_logprobs if lp is not None
                    )
                if not published:
                    # The prompt's full blocks now sit in this worker's cache.
                    runtime.in_background(
                        runtime.publish_blocks(runtime.block_hashes(prompt, salt))
                    )
                    published = True
                if out.finished:
                    context_len = len(prompt) + len(generated)
                    message.finish_reason = finish_reason_pb(out.finish_reason)
                    message.cached_tokens = out.num_cached_tokens
                    message.imported_tokens = imported
                    message.computed_tokens = max(0, context_len - out.num_cached_tokens - imported)
                    message.kv_transfer_bytes = num_bytes
                    message.kv_transfer_ms = transfer_ms
                    scheduled = out.first_scheduled_time or admitted
                    message.queue_ms = max(
                        0.0,
                        (scheduled - admitted) * 1000 + (admitted - arrival) * 1000 - transfer_ms,
                    )
                yield message

    async def _fetch(
        self,
        handle: common_pb2.KvHandle,
        prompt: list[int],
        generated: list[int],
        timeout: float | None,
    ) -> tuple[KvImport, int, float]:
        """The prompt's KV: from the producer, else full blocks from the block store."""
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
        runtime.layout.check_same(KvLayout.from_pb(handle.layout), "kv_handle")
        channel = runtime.channels.get(handle.producer_address)
        try:
            pulled = await pull_kv(channel, handle, runtime.layout, timeout)
        except (UnavailableError, NotFoundError, DataLossError) as exc:
            log.info(
                "request %s: producer pull failed (%s); trying the block store",
                handle.request_id,
                exc,
            )
            start = time.perf_counter()
            kv = await self._from_store(handle, timeout)
            return (
                kv,
                kv.data.numel() * kv.data.element_size(),
                (time.perf_counter() - start) * 1000,
            )
        finally:
            runtime.in_background(release_lease(channel, handle.lease_id))
        return KvImport(handle.num_tokens, pulled.data), pulled.num_bytes, pulled.elapsed_ms

    async def _from_store(self, handle: common_pb2.KvHandle, timeout: float | None) -> KvImport:
        store = self.runtime.store
        hashes = list(handle.block_hashes)
        if store is None or not hashes:
            raise NotFoundError(
                f"KV of request {handle.request_id} is gone from its producer and no block store "
                "holds it; retry with local_prefill"
            )
        present = await store.contains(hashes, timeout_s=timeout)
        if present == 0:
            raise NotFoundError(
                f"the block store holds none of request {handle.request_id}'s blocks"
            )
        data = await store.get(hashes[:present], timeout_s=timeout)
        # The tail (a partial block, or blocks the store lacks) is recomputed locally.
        return KvImport(present * self.runtime.engine.block_size, data)

    @rpc_method
    async def GetStatus(
        self, request: decode_pb2.GetStatusRequest, context: grpc.aio.ServicerContext
    ) -> decode_pb2.GetStatusResponse:
        stats = await self.runtime.stats()
        return decode_pb2.GetStatusResponse(status=self.runtime.status_pb(stats))
