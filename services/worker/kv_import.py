"""Where an engine worker's request gets its KV from, before the engine runs it: the policy
both faces share.

- A prompt to prefill (either face) first asks the block store for full blocks beyond what
  the worker's own prefix cache holds (``from_store``).
- A decode call with a ``KvHandle`` pulls the blocks from their producer (``fetch``); when
  that fails (the producer died, hangs past --kv-pull-timeout-s, lost the lease, sent
  corrupt bytes) it takes the full blocks the block store holds; what neither supplies is
  recomputed here, or with ``--kv-load-failure fail`` the request fails with UNAVAILABLE
  (reason KV_LOAD_FAILED).

None of this ever fails a request on its own account, except that last policy: the index
and the store are caches.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc
from opentelemetry.trace import SpanKind

from common.engine.request import KvImport
from common.errors import FailedPreconditionError, InvalidRequestError, KvLoadError
from common.kv.hashing import HASH_SCHEME_VERSION
from common.kv.layout import KvLayout
from common.kv.pull import pull_kv
from common.kv.release import RELEASE_RETRY_S, release_lease
from common.rpc.tracing import record_error
from common.telemetry.tracing import tracer
from pdserve.common.v1 import common_pb2
from services.worker.metrics import BLOCK_STORE, PRODUCER, RECEIVED
from services.worker.store_tier import BlockStoreSkipped

if TYPE_CHECKING:
    from services.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)


@dataclass
class Transfer:
    """How a request's KV arrived (peer empty: computed here)."""

    peer: str = ""
    num_bytes: int = 0
    ms: float = 0.0


class KvImporter:
    def __init__(self, runtime: WorkerRuntime) -> None:
        self.runtime = runtime

    async def from_store(
        self, token_ids: list[int], cache_salt: str | None, timeout_s: float | None
    ) -> KvImport | None:
        """Full prompt blocks from the block store, when it holds more than our own cache."""
        runtime = self.runtime
        if not runtime.store.enabled:
            return None
        block_size = runtime.engine.block_size
        hashes = runtime.block_hashes(token_ids, cache_salt)[: (len(token_ids) - 1) // block_size]
        if not hashes:
            return None
        with tracer().start_as_current_span("kv_import") as span:
            span.set_attributes(
                {"pdserve.kv.source": BLOCK_STORE, "pdserve.kv.num_blocks_wanted": len(hashes)}
            )
            try:
                present = await runtime.store.present(hashes, timeout_s)
                span.set_attribute("pdserve.kv.store_blocks", present)
                if present == 0:
                    return None  # without asking the engine, which answers between steps
                local = await runtime.loop.call(
                    lambda e: e.num_cached_prefix_tokens(token_ids, cache_salt)
                )
                span.set_attribute("pdserve.kv.local_tokens", local)
                if present * block_size <= local:
                    return None
                read = await runtime.store.read(hashes[:present], timeout_s, span)
            except BlockStoreSkipped:
                span.set_attribute("pdserve.kv.store_skipped", True)
                return None
            except Exception as exc:
                runtime.metrics.transfer_failed(BLOCK_STORE, RECEIVED)
                record_error(span, exc)
                log.warning("block store lookup failed, computing instead: %s", exc)
                return None
        return read.kv

    async def for_decode(
        self,
        handle: common_pb2.KvHandle | None,
        prompt: list[int],
        generated: list[int],
        salt: str | None,
        timeout: float | None,
    ) -> tuple[KvImport | None, Transfer]:
        """A decode call's KV: through ``handle`` (see ``fetch``), or, for a call that
        prefills locally, the block store's full blocks of its whole context. None: the
        engine computes everything."""
        if handle is not None:
            return await self.fetch(handle, prompt, generated, salt, timeout)
        kv = await self.from_store(prompt + generated, salt, timeout)
        if kv is None:
            return None, Transfer()
        return kv, Transfer(BLOCK_STORE, kv.data.numel() * kv.data.element_size())

    async def fetch(
        self,
        handle: common_pb2.KvHandle,
        prompt: list[int],
        generated: list[int],
        salt: str | None,
        timeout: float | None,
    ) -> tuple[KvImport | None, Transfer]:
        """The prompt's KV pulled from its producer; after a failed pull, ``recover``."""
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
                describe(exc),
            )
            return await self.recover(handle, prompt, salt, timeout, describe(exc))
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
        transfer = Transfer(PRODUCER, pulled.num_bytes, pulled.elapsed_ms)
        kept = list(handle.kept_block_indices) or None  # a compressed prompt's (SnapKV)
        return KvImport(handle.num_tokens, pulled.data, kept), transfer

    async def recover(
        self,
        handle: common_pb2.KvHandle,
        prompt: list[int],
        salt: str | None,
        timeout: float | None,
        why: str,
    ) -> tuple[KvImport | None, Transfer]:
        """After a failed pull: the block store's blocks, then recompute (or fail)."""
        runtime = self.runtime
        metrics = runtime.metrics
        wanted = len(handle.block_hashes)
        kv: KvImport | None = None
        transfer = Transfer()
        store_error = ""
        try:
            kv, transfer = await self._handle_from_store(handle, timeout)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            store_error = describe(exc)
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
                "(this worker runs with --kv-load-failure fail)"
            )
        metrics.kv_load_fallbacks.labels("recompute").inc()
        if kv is not None:
            # This worker's own prefix cache may hold more of the prompt than the store.
            num_store_tokens = kv.num_tokens
            local = await runtime.loop.call(lambda e: e.num_cached_prefix_tokens(prompt, salt))
            if local >= num_store_tokens:
                kv, transfer = None, Transfer()
        log.warning(
            "request %s: recomputing %d of %d prompt tokens here (block store: %s)",
            handle.request_id,
            len(prompt) - (kv.num_tokens if kv is not None else 0),
            len(prompt),
            store_error or f"{num_blocks} of {wanted} full blocks",
        )
        return kv, transfer

    async def _handle_from_store(
        self, handle: common_pb2.KvHandle, timeout: float | None
    ) -> tuple[KvImport | None, Transfer]:
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
                return None, Transfer()
        return read.kv, Transfer(BLOCK_STORE, read.num_bytes, read.seconds * 1000)


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
