"""The block store's disk tier: KV blocks in append-only, checksummed segment files under one
directory, indexed in memory, rebuilt from the files on start. The memory tier in front
(store.py) writes every committed block here behind its commit, keeps a block it evicts
readable until that write is done, and promotes what it reads back (tiering.py runs the I/O
off the event loop).

Layout. ``seg-<n>.pdkv`` files, each a run of records; a record is

    header  <4s B H H H Q I I I>  magic b"PDKV", format 1, len(model), len(layout), hash
                                  scheme version, block hash, len(data), crc32c(data),
                                  crc32c(header fields before it + model + layout)
    model   utf-8, len(model) bytes
    layout  the block's KvLayout message (common.v1), len(layout) bytes
    data    the block's wire bytes, len(data) bytes

all little-endian. Each record names its layout, so a store restarted on the directory
serves the blocks in the layout they were written in, whatever the workers now write. Only
the newest segment is appended to; it is closed at ``segment_bytes`` and a new one begun.

Atomicity. A record enters the index only once it is written whole and flushed (with
``fsync``, on the disk: the batch's records, then the file, then the directory when a
segment is new). On start every segment is read from its beginning: a record whose header
checksum fails, or that runs past the end of its file (a crash mid-write), ends that
segment's scan, and the newest segment is cut back to the last whole record, so nothing
half-written is ever indexed. A block's data checksum is checked again on every read: a
record that fails it is dropped from the index and never served.

Room. ``capacity_bytes`` bounds the segment files' total size. When an append would pass
it, the oldest segments are deleted whole, and the blocks whose newest copy lay in them are
reported evicted. Recency comes from the memory tier: a block it reads back is promoted to
memory and written again to the newest segment when memory evicts it after its disk copy
was dropped, so blocks in use stay young (the index always points at a block's newest copy).

Concurrency. Writes (``put_many``) come from one thread at a time (the spill thread); the
index takes a lock of its own, held only around dictionary updates, so reads from other
threads run beside a write and its fsync. Nothing here may run on the event loop.
"""

from __future__ import annotations

import os
import re
import struct
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.kv.layout import KvLayout, crc32c
from pdserve.common.v1 import common_pb2
from services.blockstore.store import BlockKey

MAGIC = b"PDKV"
FORMAT = 1
_HEADER = struct.Struct("<4sBHHHQIII")
_FIELDS = struct.Struct("<4sBHHHQII")  # the header before its checksum
_SEGMENT = re.compile(r"seg-(\d{8})\.pdkv")


@dataclass(frozen=True)
class DiskBlock:
    key: BlockKey
    layout: KvLayout
    data: bytes
    crc32c: int  # of data


@dataclass(frozen=True)
class _Location:
    segment: int
    offset: int  # of the data
    size: int
    crc32c: int
    layout: KvLayout


@dataclass(frozen=True)
class WriteResult:
    written: list[BlockKey]  # the batch's blocks, now indexed
    evicted: list[BlockKey]  # blocks no longer on disk (their segment was deleted)


@dataclass(frozen=True)
class DiskStats:
    capacity_bytes: int
    used_bytes: int  # segment files' total size
    num_blocks: int
    num_segments: int
    num_corrupt: int  # records dropped for a bad checksum or a torn write, since start


def _record_head(block: DiskBlock) -> bytes:
    model = block.key.model.encode()
    layout = block.layout.to_pb().SerializeToString()
    key = block.key
    fields = _FIELDS.pack(MAGIC, FORMAT, len(model), len(layout), key.hash_scheme_version,
                          key.block_hash, len(block.data), block.crc32c)  # fmt: skip
    return fields + struct.pack("<I", crc32c(fields + model + layout)) + model + layout


class DiskTier:
    def __init__(
        self, directory: str | Path, capacity_bytes: int, segment_bytes: int = 64 << 20,
        fsync: bool = True,
    ) -> None:  # fmt: skip
        if segment_bytes > capacity_bytes:
            raise ValueError(
                f"segment_bytes ({segment_bytes}) must not exceed capacity ({capacity_bytes})"
            )
        self.directory = Path(directory)
        self.capacity_bytes = capacity_bytes
        self.segment_bytes = segment_bytes
        self.fsync = fsync
        self._lock = threading.Lock()  # the index and the sizes
        self._write_lock = threading.Lock()  # one put_many at a time
        self._index: dict[BlockKey, _Location] = {}
        self._sizes: dict[int, int] = {}  # segment -> file size
        self._active: int | None = None  # the segment appended to
        self._last = -1  # the highest segment number used
        self._num_corrupt = 0
        self._layouts: dict[bytes, KvLayout] = {}  # serialized -> parsed, read at open

    def _path(self, segment: int) -> Path:
        return self.directory / f"seg-{segment:08d}.pdkv"

    # -- start --------------------------------------------------------------------------

    def open(self) -> list[tuple[BlockKey, KvLayout]]:
        """Reads every segment into the index, deleting the oldest while the files exceed
        the bound; returns the blocks held (to publish)."""
        with self._write_lock, self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            segments = sorted(
                int(m[1]) for p in self.directory.iterdir() if (m := _SEGMENT.fullmatch(p.name))
            )
            for segment in segments:
                self._scan(segment, newest=segment == segments[-1])
            self._active = segments[-1] if segments else None
            self._last = segments[-1] if segments else -1
            self._make_room(0)  # a smaller bound than the files were written under
            return [(key, where.layout) for key, where in self._index.items()]

    def _scan(self, segment: int, newest: bool) -> None:
        """Indexes one segment from its records' headers (data is checked when read)."""
        path = self._path(segment)
        offset = 0
        with open(path, "rb") as f:
            length = os.fstat(f.fileno()).st_size
            while offset + _HEADER.size <= length:
                head = os.pread(f.fileno(), _HEADER.size, offset)
                magic, fmt, model_len, layout_len, version, block_hash, size, data_crc, crc = (
                    _HEADER.unpack(head)
                )
                start = offset + _HEADER.size
                end = start + model_len + layout_len + size
                names = os.pread(f.fileno(), model_len + layout_len, start)
                layout = None
                if (
                    magic == MAGIC
                    and fmt == FORMAT
                    and end <= length
                    and (crc32c(head[: _FIELDS.size] + names) == crc)
                ):
                    layout = self._layout(names[model_len:])
                if layout is None:
                    self._num_corrupt += 1
                    break  # a torn or damaged record: nothing after it is trusted
                key = BlockKey(names[:model_len].decode(), version, block_hash)
                self._index[key] = _Location(segment, end - size, size, data_crc, layout)
                offset = end
        if newest and offset < length:
            with open(path, "r+b") as f:  # cut the torn tail: appends go after whole records
                f.truncate(offset)
        self._sizes[segment] = offset if newest else length

    def _layout(self, raw: bytes) -> KvLayout | None:
        layout = self._layouts.get(raw)
        if layout is None:
            try:
                layout = KvLayout.from_pb(common_pb2.KvLayout.FromString(raw))
            except Exception:
                return None
            self._layouts[raw] = layout
        return layout

    # -- blocks -------------------------------------------------------------------------

    def put(self, key: BlockKey, layout: KvLayout, data: bytes, data_crc: int) -> WriteResult:
        return self.put_many([DiskBlock(key, layout, data, data_crc)])

    def put_many(self, blocks: Sequence[DiskBlock]) -> WriteResult:
        """Appends the blocks (each one's newest copy from now on) and makes them durable
        together; returns what is now indexed and what was evicted to make room."""
        records = [(block, _record_head(block)) for block in blocks]
        for block, head in records:
            if len(head) + len(block.data) > self.segment_bytes:
                raise ValueError(
                    f"a block of {len(head) + len(block.data)} bytes does not fit a segment"
                )
        evicted: dict[BlockKey, None] = {}
        written: dict[BlockKey, None] = {}
        with self._write_lock:
            i = 0
            while i < len(records):  # one segment's worth of records per pass
                with self._lock:
                    size = len(records[i][1]) + len(records[i][0].data)
                    evicted.update(dict.fromkeys(self._make_room(size)))
                    segment, new = self._active_segment(size)
                    offset = self._sizes[segment]
                    room = self.capacity_bytes - sum(self._sizes.values())
                batch: list[tuple[DiskBlock, int]] = []  # block, offset of its data
                end = offset
                with open(self._path(segment), "ab") as f:
                    while i < len(records):
                        block, head = records[i]
                        size = len(head) + len(block.data)
                        full = end + size > self.segment_bytes or end - offset + size > room
                        if batch and full:
                            break
                        f.write(head)
                        f.write(block.data)
                        batch.append((block, end + len(head)))
                        end += size
                        i += 1
                    f.flush()
                    if self.fsync:
                        os.fsync(f.fileno())
                if new and self.fsync:
                    _fsync_directory(self.directory)
                with self._lock:
                    self._sizes[segment] = end
                    for block, at in batch:
                        self._index[block.key] = _Location(
                            segment, at, len(block.data), block.crc32c, block.layout
                        )
                        written[block.key] = None
                        evicted.pop(block.key, None)
        with self._lock:
            return WriteResult(
                [k for k in written if k in self._index],
                [k for k in evicted if k not in self._index],
            )

    def get(self, key: BlockKey) -> DiskBlock | None:
        """The block, checked against its checksum; None when absent, evicted or damaged."""
        with self._lock:
            where = self._index.get(key)
        if where is None:
            return None
        try:
            with open(self._path(where.segment), "rb") as f:
                data = os.pread(f.fileno(), where.size, where.offset)
        except FileNotFoundError:
            return None  # its segment was deleted since: evicted
        if len(data) != where.size or crc32c(data) != where.crc32c:
            with self._lock:
                if self._index.get(key) == where:
                    del self._index[key]
                    self._num_corrupt += 1
            return None
        return DiskBlock(key, where.layout, data, where.crc32c)

    def __contains__(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._index

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(self.capacity_bytes, sum(self._sizes.values()), len(self._index),
                             len(self._sizes), self._num_corrupt)  # fmt: skip

    # -- room (the index lock held) -----------------------------------------------------

    def _active_segment(self, size: int) -> tuple[int, bool]:
        if self._active is None or self._sizes[self._active] + size > self.segment_bytes:
            self._last += 1
            self._active = self._last
            self._path(self._active).touch()
            self._sizes[self._active] = 0
            return self._active, True
        return self._active, False

    def _make_room(self, size: int) -> list[BlockKey]:
        evicted: list[BlockKey] = []
        while self._sizes and sum(self._sizes.values()) + size > self.capacity_bytes:
            oldest = min(self._sizes)
            gone = [k for k, where in self._index.items() if where.segment == oldest]
            for key in gone:
                del self._index[key]
            evicted += gone
            del self._sizes[oldest]
            self._path(oldest).unlink(missing_ok=True)
            if self._active == oldest:
                self._active = None
        return evicted


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
