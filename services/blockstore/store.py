"""The block store's memory tier: content-addressed KV blocks written by two-phase puts.

A block is keyed by ``(model, hash_scheme_version, block_hash)`` and holds the block's wire
bytes (``KvLayout``: ``[L, 2, S, Hkv, D]`` row-major). Each model's blocks share one layout,
fixed by the first put for that model and kept while the store holds a committed block or an
open put of that model.

Room. ``capacity_bytes`` bounds committed bytes plus reserved bytes, at all times. BeginPut
reserves room for every block the put will write, evicting to make it; when even evicting
every evictable block would not make enough room it fails with ``CapacityError`` and neither
reserves nor evicts anything. A begun put therefore always has room to commit; CommitPut
turns the reservation into committed bytes, AbortPut and expiry give it back.

Visibility. Blocks received into a put live in the put only: ``contains`` and ``pin`` see
committed blocks alone, and ``commit_put`` adds all of a put's blocks in one call. Two open
puts may write the same block; the first commit wins and the second keeps the stored copy.

Eviction. Committed blocks sit in one LRU list; eviction takes the least recently used block
that is not pinned. A commit, a read (``pin``) and a put that finds blocks present all touch
their blocks last-first, so of one prompt the tail is evicted before its head: a prefix is
useless without its first block, and the head is the part other prompts share.

Disk tier (optional, ``attach_disk``). Every committed block is also written to disk behind
its commit (write-behind, off the event loop: tiering.py), so the store keeps its blocks
over a restart. Until that write is reported done the block stays in ``_writing``, readable
even after memory evicts it; memory evicting a block already on disk just drops it, and one
whose disk copy was since dropped is written again. ``contains``, ``begin_put`` and ``pin``
see all three places (memory, being written, disk); a block only on disk is pinned as a
placeholder, read on a thread, and promoted back into memory when room can be made without
failing anyone (``fill``). The bytes being written are bounded by ``max_writing_bytes``:
past it a commit is not written behind (its eviction writes it) and an eviction is dropped.
A model's layout is fixed while the store holds any block of it in any place; a put in
another layout while the model has only disk blocks drops those (they are of an older
fleet) rather than refusing every put. This thread's view of what is on disk
(``_on_disk``) changes only when the spiller reports (``disk_written``), so every method
here stays synchronous.

Concurrency. Not thread-safe, and needs no lock: every method is synchronous and never awaits,
and the servicer calls them from the event loop thread only, so each call is atomic with
respect to other RPCs. ``pin`` hands out blocks whose ``data`` (immutable ``bytes``) may be
read across awaits until the matching ``unpin``: a pinned block is never evicted. The caller
who pins must unpin, in a ``finally``.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from common.errors import (
    CapacityError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
)
from common.kv.hashing import HASH_SCHEME_VERSION
from common.kv.layout import KvLayout

if TYPE_CHECKING:
    from services.blockstore.disk import DiskBlock


class BlockKey(NamedTuple):
    model: str
    hash_scheme_version: int
    block_hash: int


@dataclass(eq=False)
class StoredBlock:
    key: BlockKey
    data: bytes  # exactly bytes_per_block of the model's layout
    crc32c: int  # of data, checked when the block was received
    num_pins: int = 0
    resident: bool = True  # in the memory LRU (False: being written to disk, or read from it)


@dataclass(eq=False)
class OpenPut:
    put_id: str
    model: str
    hash_scheme_version: int
    layout: KvLayout
    block_hashes: tuple[int, ...]  # as in BeginPutRequest; block_index points into it
    missing: dict[int, None]  # hashes to receive, request order, each once
    reserved_bytes: int
    deadline: float  # on the store's clock
    expiry_unix_ms: int
    received: dict[int, tuple[bytes, int]] = field(default_factory=dict)  # hash -> (data, crc)


@dataclass(frozen=True)
class BeginPutResult:
    put_id: str  # "" when no block was missing
    missing_block_hashes: list[int]
    expiry_unix_ms: int  # 0 when no put was opened


@dataclass(frozen=True)
class StoreStats:
    capacity_bytes: int
    committed_bytes: int
    reserved_bytes: int
    pinned_bytes: int
    num_blocks: int
    num_open_puts: int
    num_evictions: int
    num_expired_puts: int
    bytes_per_block: dict[str, int]  # per model held
    prefix_hit_rate: float  # blocks found / blocks looked up by ``contains``
    num_blocks_looked_up: int  # by ``contains``, since start
    num_blocks_found: int
    num_blocks_found_on_disk: int  # of those, found on disk only (or being written)
    num_disk_blocks: int  # on disk, as last reported by the spiller
    writing_bytes: int  # held for writes to disk not yet done
    num_disk_reads: int  # blocks read back from disk
    num_promotions: int  # of those, put back into memory
    num_spill_dropped: int  # evicted from memory and not written: too much was being written


class DiskSpill(Protocol):
    """Writes blocks to disk off the store's thread and reads them back; reports each write
    through ``BlockStore.disk_written``, on the store's thread (tiering.DiskSpiller)."""

    def submit(self, block: StoredBlock, layout: KvLayout) -> None: ...

    async def read(self, keys: Sequence[BlockKey]) -> list[DiskBlock | None]: ...


@dataclass(eq=False)
class Pinned:
    """Blocks of one read: pinned in memory, or ``None`` where only the disk holds them."""

    layout: KvLayout
    keys: list[BlockKey]
    blocks: list[StoredBlock | None]

    @property
    def on_disk(self) -> list[BlockKey]:
        return [key for key, block in zip(self.keys, self.blocks, strict=True) if block is None]


class StoreListener(Protocol):
    """Told, synchronously and in order, which blocks became visible or were evicted."""

    def blocks_stored(self, model: str, block_hashes: Sequence[int]) -> None: ...

    def blocks_removed(self, model: str, block_hashes: Sequence[int]) -> None: ...


@dataclass
class _ModelState:
    layout: KvLayout
    num_blocks: int = 0
    num_open_puts: int = 0
    num_spilled: int = 0  # blocks on disk or being written there


class BlockStore:
    def __init__(
        self,
        capacity_bytes: int,
        put_expiry_s: float,
        hash_scheme_versions: Sequence[int] = (HASH_SCHEME_VERSION,),
        listener: StoreListener | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_writing_bytes: int = 256 << 20,
    ) -> None:
        if capacity_bytes < 1 or put_expiry_s <= 0:
            raise ValueError(f"bad store size or expiry: {capacity_bytes} bytes, {put_expiry_s} s")
        self.capacity_bytes = capacity_bytes
        self.put_expiry_s = put_expiry_s
        self.hash_scheme_versions = frozenset(hash_scheme_versions)
        self.listener = listener
        self._clock = clock
        self._wall_clock = wall_clock
        self._lru: OrderedDict[BlockKey, StoredBlock] = OrderedDict()  # least recent first
        self._puts: dict[str, OpenPut] = {}
        self._models: dict[str, _ModelState] = {}
        self.committed_bytes = 0
        self.reserved_bytes = 0
        self.pinned_bytes = 0  # bytes of committed blocks with num_pins > 0
        self.num_evictions = 0
        self.num_expired_puts = 0
        self._num_looked_up = 0
        self._num_found = 0
        self._num_found_on_disk = 0
        # The disk tier (attach_disk): what is being written, and what the disk holds.
        self.disk: DiskSpill | None = None
        self.max_writing_bytes = max_writing_bytes
        self._writing: dict[BlockKey, StoredBlock] = {}
        self.writing_bytes = 0
        self._on_disk: dict[BlockKey, None] = {}
        self.num_disk_reads = 0
        self.num_promotions = 0
        self.num_spill_dropped = 0

    # -- the disk tier ------------------------------------------------------------------------

    def attach_disk(self, disk: DiskSpill, held: Sequence[tuple[BlockKey, KvLayout]]) -> int:
        """Writes go to ``disk`` from now on; ``held`` is what it holds (DiskTier.open).
        Returns how many blocks were taken (a model's blocks in a second layout are not)."""
        self.disk = disk
        taken = 0
        for key, layout in held:
            if key.hash_scheme_version not in self.hash_scheme_versions:
                continue
            state = self._models.get(key.model)
            if state is None:
                state = self._models[key.model] = _ModelState(layout)
            if state.layout != layout or key in self._on_disk:
                continue
            self._on_disk[key] = None
            state.num_spilled += 1
            taken += 1
        return taken

    def disk_written(
        self, submitted: Sequence[BlockKey], written: Sequence[BlockKey],
        evicted: Sequence[BlockKey],
    ) -> None:  # fmt: skip
        """The spiller's report: of ``submitted``, ``written`` are on disk; ``evicted``
        left the disk to make room."""
        done = set(written)
        removed: dict[str, list[int]] = {}
        for key in submitted:
            block = self._writing.pop(key, None)
            if block is None:
                continue
            self.writing_bytes -= len(block.data)
            if key in done:
                self._on_disk[key] = None
            else:
                self._spill_gone(key, removed)
        for key in evicted:
            if key in self._on_disk and key not in done:
                del self._on_disk[key]
                self._spill_gone(key, removed)
        self._report_removed(removed)

    def _spill_gone(self, key: BlockKey, removed: dict[str, list[int]]) -> None:
        """``key`` is neither on disk nor being written any more."""
        state = self._models[key.model]
        state.num_spilled -= 1
        if key not in self._lru:
            removed.setdefault(key.model, []).append(key.block_hash)
        self._forget_model_if_empty(key.model)

    def _write_behind(self, block: StoredBlock) -> bool:
        """Hands a block to the disk unless it is there, on its way, or too much is."""
        key = block.key
        if self.disk is None or key in self._on_disk or key in self._writing:
            return self.disk is not None
        if self.writing_bytes + len(block.data) > self.max_writing_bytes:
            return False
        self._writing[key] = block
        self.writing_bytes += len(block.data)
        self._models[key.model].num_spilled += 1
        self.disk.submit(block, self._models[key.model].layout)
        return True

    def _held(self, key: BlockKey) -> bool:
        return key in self._lru or key in self._writing or key in self._on_disk

    def _drop_disk_blocks(self, model: str) -> None:
        """A put in a new layout while ``model`` has only disk blocks: those are dropped."""
        gone = [key for key in self._on_disk if key.model == model]
        for key in gone:
            del self._on_disk[key]
        state = self._models.pop(model)
        state.num_spilled -= len(gone)
        if self.listener is not None and gone:
            self.listener.blocks_removed(model, [key.block_hash for key in gone])

    # -- puts ---------------------------------------------------------------------------------

    def begin_put(
        self, model: str, hash_scheme_version: int, layout: KvLayout, block_hashes: Sequence[int]
    ) -> BeginPutResult:
        _check_model(model)
        if not block_hashes:
            raise InvalidRequestError("block_hashes", "no blocks to put")
        if 0 in block_hashes:
            raise InvalidRequestError("block_hashes", "0 is not a block hash")
        if 0 in (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size):
            raise InvalidRequestError("layout", f"a layout dimension is 0: {layout}")
        self._check_version(hash_scheme_version)
        state = self._models.get(model)
        if (
            state is not None
            and state.layout != layout
            and not (state.num_blocks or state.num_open_puts or self._writing_of(model))
        ):
            self._drop_disk_blocks(model)
            state = None
        if state is not None:
            state.layout.check_same(layout, f"model {model!r} in the block store")
        self.expire_puts()

        missing: dict[int, None] = {}
        for block_hash in block_hashes:
            if not self._held(BlockKey(model, hash_scheme_version, block_hash)):
                missing[block_hash] = None
        # Touch what is present first, so that making room never evicts this prompt's head.
        self._touch_last_first(model, hash_scheme_version, block_hashes)
        if not missing:
            return BeginPutResult("", [], 0)

        need = len(missing) * layout.bytes_per_block
        self._make_room(need, len(missing))  # may forget this model's state when it evicts
        state = self._models.get(model)
        put = OpenPut(
            put_id=secrets.token_hex(16),
            model=model,
            hash_scheme_version=hash_scheme_version,
            layout=layout,
            block_hashes=tuple(block_hashes),
            missing=missing,
            reserved_bytes=need,
            deadline=self._clock() + self.put_expiry_s,
            expiry_unix_ms=int((self._wall_clock() + self.put_expiry_s) * 1000),
        )
        self._puts[put.put_id] = put
        self.reserved_bytes += need
        if state is None:
            state = self._models[model] = _ModelState(layout)
        state.num_open_puts += 1
        return BeginPutResult(put.put_id, list(missing), put.expiry_unix_ms)

    def _writing_of(self, model: str) -> bool:
        return any(key.model == model for key in self._writing)

    def check_block(self, put_id: str, block_index: int, block_hash: int) -> KvLayout:
        """The put's layout, if ``block_index`` names a block the put may receive."""
        put = self._open_put(put_id)
        if not 0 <= block_index < len(put.block_hashes):
            raise InvalidRequestError(
                "chunk.block_index",
                f"{block_index} is outside the put's {len(put.block_hashes)} blocks",
            )
        if put.block_hashes[block_index] != block_hash:
            raise InvalidRequestError(
                "chunk.block_hash",
                f"block {block_index} has hash {put.block_hashes[block_index]:#x}, not {block_hash:#x}",
            )
        if block_hash not in put.missing:
            raise InvalidRequestError(
                "chunk.block_hash",
                f"block {block_index} ({block_hash:#x}) is not missing from the store",
            )
        return put.layout

    def receive_block(
        self, put_id: str, block_index: int, block_hash: int, data: bytes, crc32c: int
    ) -> None:
        """Keeps one whole, checksum-checked block in the put (invisible until commit).

        Receiving a block again replaces it, so a client may resend after a broken stream.
        """
        layout = self.check_block(put_id, block_index, block_hash)
        assert len(data) == layout.bytes_per_block, f"block of {len(data)} bytes, layout {layout}"
        self._puts[put_id].received[block_hash] = (data, crc32c)

    def commit_put(self, put_id: str) -> int:
        """Makes every block of the put visible; returns how many were not already stored."""
        if not put_id:
            raise InvalidRequestError("put_id", "empty")
        put = self._open_put(put_id)
        absent = [h for h in put.missing if h not in put.received]
        if absent:
            raise FailedPreconditionError(
                f"put {put_id}: {len(absent)} of {len(put.missing)} blocks not received "
                f"(first {absent[0]:#x})"
            )
        stored: list[int] = []
        for block_hash in reversed(put.block_hashes):
            key = BlockKey(put.model, put.hash_scheme_version, block_hash)
            block = self._lru.get(key)
            if block is not None:
                self._lru.move_to_end(key)
            elif block_hash in put.received and not self._held(key):
                data, crc = put.received.pop(block_hash)
                self._lru[key] = StoredBlock(key, data, crc)
                self.committed_bytes += len(data)
                stored.append(block_hash)
        self._models[put.model].num_blocks += len(stored)
        for block_hash in reversed(stored):  # written behind, the prompt's head first
            self._write_behind(self._lru[BlockKey(put.model, put.hash_scheme_version, block_hash)])
        self._close_put(put)
        assert self.committed_bytes + self.reserved_bytes <= self.capacity_bytes, "over capacity"
        stored.reverse()
        if stored and self.listener is not None:
            self.listener.blocks_stored(put.model, stored)
        return len(stored)

    def abort_put(self, put_id: str) -> bool:
        """Drops an open put; False if it was unknown, committed, aborted or expired."""
        if not put_id:
            raise InvalidRequestError("put_id", "empty")
        put = self._puts.get(put_id)
        if put is None:
            return False
        expired = put.deadline <= self._clock()
        self._close_put(put)
        self.num_expired_puts += expired
        return not expired

    def expire_puts(self) -> int:
        """Aborts every put past its deadline; returns how many."""
        now = self._clock()
        expired = [put for put in self._puts.values() if put.deadline <= now]
        for put in expired:
            self._close_put(put)
        self.num_expired_puts += len(expired)
        return len(expired)

    # -- reads --------------------------------------------------------------------------------

    def pin(
        self, model: str, hash_scheme_version: int, block_hashes: Sequence[int]
    ) -> tuple[KvLayout, list[StoredBlock]]:
        """Pins every requested block (all or none) and touches them; unpin when done.
        Blocks only on disk count as absent here: readers that may wait use ``pin_or_locate``
        and ``fill``."""
        pinned = self.pin_or_locate(model, hash_scheme_version, block_hashes)
        if pinned.on_disk:
            self.unpin([block for block in pinned.blocks if block is not None])
            raise NotFoundError(
                f"block {pinned.on_disk[0].block_hash:#x} of model {model!r} is on disk only"
            )
        return pinned.layout, [block for block in pinned.blocks if block is not None]

    def pin_or_locate(
        self, model: str, hash_scheme_version: int, block_hashes: Sequence[int]
    ) -> Pinned:
        """Pins the requested blocks held in memory (or being written to disk) and touches
        them; leaves ``None`` for those only on disk. All or nothing: NotFoundError when a
        block is nowhere. Read the disk ones, then ``fill``; unpin what ``fill`` returns."""
        _check_model(model)
        if not block_hashes:
            raise InvalidRequestError("block_hashes", "no blocks to get")
        self._check_version(hash_scheme_version)
        keys = [BlockKey(model, hash_scheme_version, h) for h in block_hashes]
        blocks: list[StoredBlock | None] = []
        for key in keys:
            block = self._lru.get(key) or self._writing.get(key)
            if block is None and key not in self._on_disk:
                raise NotFoundError(
                    f"block {key.block_hash:#x} of model {model!r} is not in the store"
                )
            blocks.append(block)
        self._pin_all(block for block in blocks if block is not None)
        self._touch_last_first(model, hash_scheme_version, block_hashes)
        return Pinned(self._models[model].layout, keys, blocks)

    def fill(self, pinned: Pinned, reads: Sequence[DiskBlock | None]) -> list[StoredBlock]:
        """Completes ``pinned`` with the disk reads of ``pinned.on_disk`` (in that order),
        promoting each into memory when room can be made; returns every block, pinned.
        A block that the disk no longer had (evicted, or failed its checksum) unpins
        everything and raises NotFoundError."""
        assert len(reads) == len(pinned.on_disk), "one read per block on disk"
        blocks = [block for block in pinned.blocks if block is not None]
        lost = next(
            (key for key, read in zip(pinned.on_disk, reads, strict=True) if read is None), None
        )
        if lost is None:
            lost = next(
                (read.key for read in reads if read is not None and read.layout != pinned.layout),
                None,
            )
        if lost is not None:
            removed: dict[str, list[int]] = {}
            for key, read in zip(pinned.on_disk, reads, strict=True):
                if read is None and key in self._on_disk:
                    del self._on_disk[key]  # the tier dropped it (damaged) or is dropping it
                    self._spill_gone(key, removed)
            self.unpin(blocks)
            self._report_removed(removed)
            raise NotFoundError(
                f"block {lost.block_hash:#x} of model {lost.model!r} was lost from the disk tier"
            )
        promoted: dict[BlockKey, StoredBlock] = {}
        for read in reversed(reads):  # the head promoted last: the most recent, as a commit
            assert read is not None
            promoted[read.key] = block = self._promote(read.key, read.data, read.crc32c)
            self._pin_all([block])
        self.num_disk_reads += len(reads)
        return [
            promoted[key] if block is None else block
            for key, block in zip(pinned.keys, pinned.blocks, strict=True)
        ]

    def _promote(self, key: BlockKey, data: bytes, crc: int) -> StoredBlock:
        """The block read from disk, back in memory (most recent) if room can be made."""
        block = self._lru.get(key) or self._writing.get(key)
        if block is not None:
            return block  # a put brought it back while we read
        block = StoredBlock(key, data, crc, resident=False)
        try:
            self._make_room(len(data), 1)
        except CapacityError:
            return block  # served from the read, not kept in memory
        block.resident = True
        self._lru[key] = block
        self.committed_bytes += len(data)
        self._models[key.model].num_blocks += 1
        self.num_promotions += 1
        return block

    def _pin_all(self, blocks: Iterable[StoredBlock]) -> None:
        for block in blocks:
            if block.num_pins == 0 and block.resident:
                self.pinned_bytes += len(block.data)
            block.num_pins += 1

    def unpin(self, blocks: Sequence[StoredBlock]) -> None:
        for block in blocks:
            assert block.num_pins > 0, f"unpin of unpinned block {block.key}"
            block.num_pins -= 1
            if block.num_pins == 0 and block.resident:
                self.pinned_bytes -= len(block.data)

    def contains(
        self, model: str, hash_scheme_version: int, block_hashes: Sequence[int]
    ) -> list[bool]:
        """Which blocks are committed; does not touch them."""
        _check_model(model)
        self._check_version(hash_scheme_version)
        keys = [BlockKey(model, hash_scheme_version, h) for h in block_hashes]
        in_memory = [key in self._lru for key in keys]
        present = [hit or self._held(key) for hit, key in zip(in_memory, keys, strict=True)]
        self._num_looked_up += len(present)
        self._num_found += sum(present)
        self._num_found_on_disk += sum(present) - sum(in_memory)
        return present

    def layout_of(self, model: str) -> KvLayout | None:
        state = self._models.get(model)
        return state.layout if state is not None else None

    def committed_hashes(self) -> dict[str, list[int]]:
        """Every committed block's hash per model held in memory, least recently used first."""
        by_model: dict[str, list[int]] = {}
        for key in self._lru:
            by_model.setdefault(key.model, []).append(key.block_hash)
        return by_model

    def disk_only_hashes(self) -> dict[str, list[int]]:
        """Every block's hash per model held on disk (or being written) and not in memory."""
        by_model: dict[str, list[int]] = {}
        for key in (*self._writing, *self._on_disk):
            if key not in self._lru:
                by_model.setdefault(key.model, []).append(key.block_hash)
        return by_model

    def lru_order(self) -> list[BlockKey]:
        """Committed blocks, next to be evicted first (pinned ones included)."""
        return list(self._lru)

    def stats(self) -> StoreStats:
        return StoreStats(
            capacity_bytes=self.capacity_bytes,
            committed_bytes=self.committed_bytes,
            reserved_bytes=self.reserved_bytes,
            pinned_bytes=self.pinned_bytes,
            num_blocks=len(self._lru),
            num_open_puts=len(self._puts),
            num_evictions=self.num_evictions,
            num_expired_puts=self.num_expired_puts,
            bytes_per_block={m: s.layout.bytes_per_block for m, s in self._models.items()},
            prefix_hit_rate=self._num_found / self._num_looked_up if self._num_looked_up else 0.0,
            num_blocks_looked_up=self._num_looked_up,
            num_blocks_found=self._num_found,
            num_blocks_found_on_disk=self._num_found_on_disk,
            num_disk_blocks=len(self._on_disk),
            writing_bytes=self.writing_bytes,
            num_disk_reads=self.num_disk_reads,
            num_promotions=self.num_promotions,
            num_spill_dropped=self.num_spill_dropped,
        )

    # -- internals ----------------------------------------------------------------------------

    def _check_version(self, hash_scheme_version: int) -> None:
        if hash_scheme_version not in self.hash_scheme_versions:
            raise FailedPreconditionError(
                f"hash scheme version {hash_scheme_version} is not served "
                f"(this store serves {sorted(self.hash_scheme_versions)})"
            )

    def _open_put(self, put_id: str) -> OpenPut:
        put = self._puts.get(put_id)
        if put is not None and put.deadline <= self._clock():
            self._close_put(put)
            self.num_expired_puts += 1
            put = None
        if put is None:
            raise NotFoundError(f"no open put {put_id!r} (unknown, committed, aborted or expired)")
        return put

    def _close_put(self, put: OpenPut) -> None:
        del self._puts[put.put_id]
        self.reserved_bytes -= put.reserved_bytes
        state = self._models[put.model]
        state.num_open_puts -= 1
        self._forget_model_if_empty(put.model)

    def _forget_model_if_empty(self, model: str) -> None:
        state = self._models.get(model)
        if state is not None and not (state.num_blocks or state.num_open_puts or state.num_spilled):
            del self._models[model]

    def _touch_last_first(self, model: str, version: int, block_hashes: Sequence[int]) -> None:
        for block_hash in reversed(block_hashes):
            key = BlockKey(model, version, block_hash)
            if key in self._lru:
                self._lru.move_to_end(key)

    def _make_room(self, need: int, num_blocks: int) -> None:
        free = self.capacity_bytes - self.committed_bytes - self.reserved_bytes
        if free >= need:
            return
        if need > self.capacity_bytes:
            raise CapacityError(
                f"{num_blocks} blocks ({need} bytes) exceed the store's capacity "
                f"of {self.capacity_bytes} bytes"
            )
        evictable = self.committed_bytes - self.pinned_bytes
        if free + evictable < need:
            raise CapacityError(
                f"no room for {num_blocks} blocks ({need} bytes): {self.reserved_bytes} bytes are "
                f"reserved by open puts and {self.pinned_bytes} pinned by reads; retry later"
            )
        victims: list[StoredBlock] = []
        for block in self._lru.values():
            if free >= need:
                break
            if block.num_pins == 0:
                victims.append(block)
                free += len(block.data)
        removed: dict[str, list[int]] = {}
        for block in victims:
            del self._lru[block.key]
            block.resident = False
            self.committed_bytes -= len(block.data)
            self._models[block.key.model].num_blocks -= 1
            if self.disk is not None:
                if self._write_behind(block):
                    continue  # on disk, or kept readable until it is
                self.num_spill_dropped += 1
            removed.setdefault(block.key.model, []).append(block.key.block_hash)
        self.num_evictions += len(victims)
        for model in {block.key.model for block in victims}:
            self._forget_model_if_empty(model)
        self._report_removed(removed)

    def _report_removed(self, removed: dict[str, list[int]]) -> None:
        if self.listener is not None:
            for model, hashes in removed.items():
                self.listener.blocks_removed(model, hashes)


def _check_model(model: str) -> None:
    if not model:
        raise InvalidRequestError("model", "empty")
