"""BlockStoreClient: put, get and look up full KV blocks in the block store.

# n = blocks, L = layers, S = block_size tokens, Hkv = KV heads, D = head dim
# a blocks tensor is [n, L, 2, S, Hkv, D] in the client's layout dtype

Every call takes ``timeout_s``, the caller's remaining budget for the whole operation (a put
is three RPCs); each RPC gets what is left of it. Failures raise our errors
(``common.errors``) via ``from_rpc_error``; statuses without one (DEADLINE_EXCEEDED,
CANCELLED, INTERNAL) raise ``grpc.aio.AioRpcError``. One client serves many concurrent calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Iterator, Sequence
from typing import NoReturn, TypeVar

import grpc
import torch
from opentelemetry.trace import Span, SpanKind

from common.errors import DataLossError, InvalidRequestError, PdserveError
from common.kv.hashing import HASH_SCHEME_VERSION
from common.kv.layout import BlockAssembler, KvLayout, block_pieces
from common.rpc.channels import create_channel
from common.rpc.errors import from_rpc_error
from common.rpc.tls import TlsConfig
from common.rpc.tracing import outgoing_metadata, record_error
from common.telemetry.tracing import tracer
from pdserve.kv.v1 import block_store_pb2, block_store_pb2_grpc

ABORT_TIMEOUT_S = 2.0
SERVICE = block_store_pb2.DESCRIPTOR.services_by_name["BlockStoreService"].full_name

T = TypeVar("T")


class BlockStoreClient:
    def __init__(
        self,
        target: str,
        model: str,
        layout: KvLayout,
        hash_scheme_version: int = HASH_SCHEME_VERSION,
        tls: TlsConfig | None = None,
    ) -> None:
        self.target = target
        self.model = model
        self.layout = layout
        self.hash_scheme_version = hash_scheme_version
        self._channel = create_channel(target, tls.channel_credentials() if tls else None)
        self._stub = block_store_pb2_grpc.BlockStoreServiceStub(self._channel)

    async def put(
        self, block_hashes: Sequence[int], blocks: torch.Tensor, timeout_s: float | None = None
    ) -> int:
        """Writes the blocks the store lacks; returns how many this call made visible.

        ``blocks`` is [n, L, 2, S, Hkv, D] with n = len(block_hashes), on any device. On any
        failure after the put was opened the put is aborted (else it expires in the store).
        """
        self._check_blocks(block_hashes, blocks)
        if not block_hashes:
            return 0
        with self._span("put", len(block_hashes)) as span:
            committed, num_sent = await self._put(block_hashes, blocks, timeout_s)
            span.set_attributes(
                {
                    "pdserve.kv.blocks_sent": num_sent,
                    "pdserve.kv.bytes": num_sent * self.layout.bytes_per_block,
                    "pdserve.kv.blocks_committed": committed,
                }
            )
        return committed

    async def _put(
        self, block_hashes: Sequence[int], blocks: torch.Tensor, timeout_s: float | None
    ) -> tuple[int, int]:
        """(blocks committed, blocks sent)."""
        deadline = _Deadline(timeout_s)
        begin = await self._call(
            "BeginPut",
            self._stub.BeginPut(
                block_store_pb2.BeginPutRequest(
                    block_hashes=list(block_hashes),
                    layout=self.layout.to_pb(),
                    model=self.model,
                    hash_scheme_version=self.hash_scheme_version,
                ),
                timeout=deadline.left(),
                metadata=outgoing_metadata(),
            ),
        )
        if not begin.put_id:
            return 0, 0
        try:
            indexes = _first_indexes(block_hashes, begin.missing_block_hashes)
            blocks = blocks.detach().to("cpu")
            await self._call(
                "PutBlocks",
                self._stub.PutBlocks(
                    _put_requests(begin.put_id, blocks, block_hashes, indexes),
                    timeout=deadline.left(),
                    metadata=outgoing_metadata(),
                ),
                deadline,
            )
            commit = await self._call(
                "CommitPut",
                self._stub.CommitPut(
                    block_store_pb2.CommitPutRequest(put_id=begin.put_id),
                    timeout=deadline.left(),
                    metadata=outgoing_metadata(),
                ),
            )
        except BaseException:
            await self._abort(begin.put_id)
            raise
        return int(commit.num_blocks_committed), len(indexes)

    async def get(
        self, block_hashes: Sequence[int], timeout_s: float | None = None
    ) -> torch.Tensor:
        """The blocks, bit-exact, as a [n, L, 2, S, Hkv, D] CPU tensor.

        Raises NotFoundError when any block is missing, DataLossError on a corrupt block and
        FailedPreconditionError when the store holds this model in another layout.
        """
        if not block_hashes:
            return torch.empty(0, *self.layout.wire_shape, dtype=self.layout.wire_dtype)
        with self._span("get", len(block_hashes)) as span:
            data = await self._get(block_hashes, timeout_s)
            span.set_attribute("pdserve.kv.bytes", data.numel() * data.element_size())
        return data

    async def _get(self, block_hashes: Sequence[int], timeout_s: float | None) -> torch.Tensor:
        assembler = BlockAssembler(self.layout, len(block_hashes))
        call = self._stub.GetBlocks(
            block_store_pb2.GetBlocksRequest(
                block_hashes=list(block_hashes),
                model=self.model,
                hash_scheme_version=self.hash_scheme_version,
            ),
            timeout=timeout_s,
            metadata=outgoing_metadata(),
        )
        try:
            async for response in call:
                if response.HasField("layout"):
                    self.layout.check_same(KvLayout.from_pb(response.layout), "block store")
                assembler.add(response.chunk)
        except grpc.aio.AioRpcError as exc:
            _raise_translated(exc, "block store GetBlocks")
        except PdserveError:
            call.cancel()
            raise
        if assembler.hashes != list(block_hashes):
            raise DataLossError("block store GetBlocks: the blocks came with other hashes")
        return assembler.tensor()

    async def contains(self, block_hashes: Sequence[int], timeout_s: float | None = None) -> int:
        """How many leading blocks of ``block_hashes`` the store holds."""
        if not block_hashes:
            return 0
        with self._span("contains", len(block_hashes)) as span:
            response = await self._call(
                "ContainsBlocks",
                self._stub.ContainsBlocks(
                    block_store_pb2.ContainsBlocksRequest(
                        block_hashes=list(block_hashes),
                        model=self.model,
                        hash_scheme_version=self.hash_scheme_version,
                    ),
                    timeout=timeout_s,
                    metadata=outgoing_metadata(),
                ),
            )
            span.set_attribute("pdserve.kv.blocks_present", response.num_prefix_present)
        return int(response.num_prefix_present)

    async def close(self) -> None:
        await self._channel.close()

    @contextlib.contextmanager
    def _span(self, operation: str, num_blocks: int) -> Iterator[Span]:
        """A CLIENT span ``blockstore.<operation>``, current while its RPCs run (their
        metadata carries it); errors mark it and propagate."""
        with tracer().start_as_current_span(
            f"blockstore.{operation}",
            kind=SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": SERVICE,
                "server.address": self.target,
                "pdserve.kv.num_blocks": num_blocks,
            },
            record_exception=False,
            set_status_on_exception=False,
        ) as span:
            try:
                yield span
            except BaseException as exc:
                record_error(span, exc)
                raise

    def _check_blocks(self, block_hashes: Sequence[int], blocks: torch.Tensor) -> None:
        expected = (len(block_hashes), *self.layout.wire_shape)
        if tuple(blocks.shape) != expected:
            raise InvalidRequestError("blocks", f"shape {tuple(blocks.shape)}, expected {expected}")
        if blocks.dtype != self.layout.wire_dtype:
            raise InvalidRequestError(
                "blocks", f"dtype {blocks.dtype}, layout {self.layout.wire_dtype}"
            )

    async def _call(self, what: str, call: Awaitable[T], deadline: _Deadline | None = None) -> T:
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            if (
                deadline is not None
                and deadline.expired()
                and exc.code() == grpc.StatusCode.INTERNAL
            ):
                # grpcio reports a client stream whose deadline passed while a message was being
                # sent as INTERNAL ("Failed execute_batch"); the cause is the deadline.
                exc = grpc.aio.AioRpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.aio.Metadata(),
                    grpc.aio.Metadata(),
                    details=f"deadline exceeded while streaming ({exc.details()})",
                )
            _raise_translated(exc, f"block store {what}")

    async def _abort(self, put_id: str) -> None:
        """Best effort: the store also expires puts nobody finishes."""
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            await self._stub.AbortPut(
                block_store_pb2.AbortPutRequest(put_id=put_id),
                timeout=ABORT_TIMEOUT_S,
                metadata=outgoing_metadata(),
            )


class _Deadline:
    def __init__(self, timeout_s: float | None) -> None:
        self._at = None if timeout_s is None else time.monotonic() + timeout_s

    def left(self) -> float | None:
        return None if self._at is None else max(0.0, self._at - time.monotonic())

    def expired(self) -> bool:
        return self._at is not None and time.monotonic() >= self._at


def _first_indexes(block_hashes: Sequence[int], missing: Sequence[int]) -> list[int]:
    """Position of each missing hash in the put (its first occurrence), ascending."""
    first: dict[int, int] = {}
    for index, block_hash in enumerate(block_hashes):
        first.setdefault(block_hash, index)
    return sorted(first[h] for h in missing)


async def _put_requests(
    put_id: str, blocks: torch.Tensor, block_hashes: Sequence[int], indexes: list[int]
) -> AsyncIterator[block_store_pb2.PutBlocksRequest]:
    for index in indexes:
        # One block at a time, so a large put never holds a second copy of all its bytes.
        for piece in block_pieces(
            blocks[index : index + 1], [block_hashes[index]], first_index=index
        ):
            request = block_store_pb2.PutBlocksRequest(put_id=put_id)
            piece.fill(request.chunk)
            yield request


def _raise_translated(exc: grpc.aio.AioRpcError, what: str) -> NoReturn:
    error = from_rpc_error(exc, what)
    if error is exc:
        raise exc
    raise error from exc
