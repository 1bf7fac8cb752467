"""The block store's disk tier (issue 18, first part): KV blocks in append-only,
checksummed segment files under one directory, indexed in memory, rebuilt from the files on
start. Not wired into the store yet: the memory tier will spill what it evicts here and
promote what it reads back.

Layout. ``seg-<n>.pdkv`` files, each a run of records; a record is

    header  <4s B H H Q I I I>  magic b"PDKV", format 1, len(model), hash scheme version,
                                block hash, len(data), crc32c(data), crc32c(header fields
                                before it + model)
    model   utf-8, len(model) bytes
    data    the block's wire bytes, len(data) bytes

all little-endian. Only the newest segment is appended to; it is closed at
``segment_bytes`` and a new one begun.

Atomicity. A record enters the index only once it is written whole and flushed (and, with
``fsync``, on the disk). On start every segment is read from its beginning: a record whose
header checksum fails, or that runs past the end of its file (a crash mid-write), ends that
segment's scan, and the newest segment is cut back to the last whole record, so nothing
half-written is ever indexed. A block's data checksum is checked again on every read: a
record that fails it is dropped from the index and never served.

Room. ``capacity_bytes`` bounds the segment files' total size. When an append would pass
it, the oldest segments are deleted whole, and the blocks whose newest copy lay in them are
reported evicted. The memory tier in front gives recency: a block read back is promoted to
memory, and spilled again to the newest segment when memory evicts it, so what is used
stays young (the index always points at a block's newest copy).

Concurrency: every method takes the tier's lock; callers run them on a thread of their own,
never on the event loop (disk I/O blocks).
"""

from __future__ import annotations

import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

from common.kv.layout import crc32c
from services.blockstore.store import BlockKey

MAGIC = b"PDKV"
FORMAT = 1
_HEADER = struct.Struct("<4sBHHQIII")
_SEGMENT = re.compile(r"seg-(\d{8})\.pdkv")


@dataclass(frozen=True)
class _Location:
    segment: int
    offset: int  # of the data
    size: int
    crc32c: int


@dataclass(frozen=True)
class DiskStats:
    capacity_bytes: int
    used_bytes: int  # segment files' total size
    num_blocks: int
    num_segments: int
    num_corrupt: int  # records dropped for a bad checksum or a torn write, since start


def _header(key: BlockKey, data_crc: int, size: int) -> bytes:
    model = key.model.encode()
    fields = struct.pack("<4sBHHQII", MAGIC, FORMAT, len(model), key.hash_scheme_version,
                         key.block_hash, size, data_crc)  # fmt: skip
    return fields + struct.pack("<I", crc32c(fields + model)) + model


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
        self._lock = threading.Lock()
        self._index: dict[BlockKey, _Location] = {}
        self._sizes: dict[int, int] = {}  # segment -> file size
        self._active: int | None = None  # the segment appended to
        self._last = -1  # the highest segment number used
        self._num_corrupt = 0

    def _path(self, segment: int) -> Path:
        return self.directory / f"seg-{segment:08d}.pdkv"

    # -- start --------------------------------------------------------------------------

    def open(self) -> list[BlockKey]:
        """Reads every segment into the index; returns the blocks held (to publish)."""
        with self._lock:
            self.directory.mkdir(parents=True, exist_ok=True)
            segments = sorted(
                int(m[1]) for p in self.directory.iterdir() if (m := _SEGMENT.fullmatch(p.name))
            )
            for segment in segments:
                self._scan(segment, newest=segment == segments[-1])
            self._active = segments[-1] if segments else None
            self._last = segments[-1] if segments else -1
            return list(self._index)

    def _scan(self, segment: int, newest: bool) -> None:
        path = self._path(segment)
        data = path.read_bytes()
        offset = 0
        while offset + _HEADER.size <= len(data):
            magic, fmt, model_len, version, block_hash, size, data_crc, header_crc = (
                _HEADER.unpack_from(data, offset)
            )
            model_start = offset + _HEADER.size
            end = model_start + model_len + size
            fields = data[offset : offset + _HEADER.size - 4]
            model = data[model_start : model_start + model_len]
            if magic != MAGIC or fmt != FORMAT or end > len(data) or (
                crc32c(fields + model) != header_crc
            ):
                self._num_corrupt += 1
                break  # a torn or damaged record: nothing after it is trusted
            key = BlockKey(model.decode(), version, block_hash)
            self._index[key] = _Location(segment, model_start + model_len, size, data_crc)
            offset = end
        if newest and offset < len(data):
            with open(path, "r+b") as f:  # cut the torn tail: appends go after whole records
                f.truncate(offset)
        self._sizes[segment] = offset if newest else len(data)

    # -- blocks -------------------------------------------------------------------------

    def put(self, key: BlockKey, data: bytes, data_crc: int) -> list[BlockKey]:
        """Appends a block (its newest copy from now on); returns the blocks evicted to
        make room."""
        header = _header(key, data_crc, len(data))
        size = len(header) + len(data)
        if size > self.segment_bytes:
            raise ValueError(f"a block of {size} bytes does not fit a segment")
        with self._lock:
            evicted = self._make_room(size)
            segment = self._active_segment(size)
            path = self._path(segment)
            offset = self._sizes[segment]
            with open(path, "ab") as f:
                f.write(header)
                f.write(data)
                f.flush()
                if self.fsync:
                    os.fsync(f.fileno())
            self._sizes[segment] = offset + size
            self._index[key] = _Location(segment, offset + len(header), len(data), data_crc)
            return evicted

    def get(self, key: BlockKey) -> bytes | None:
        """The block's data, checked against its checksum; None when absent or damaged."""
        with self._lock:
            where = self._index.get(key)
            if where is None:
                return None
            with open(self._path(where.segment), "rb") as f:
                f.seek(where.offset)
                data = f.read(where.size)
            if len(data) != where.size or crc32c(data) != where.crc32c:
                del self._index[key]
                self._num_corrupt += 1
                return None
            return data

    def __contains__(self, key: BlockKey) -> bool:
        with self._lock:
            return key in self._index

    def stats(self) -> DiskStats:
        with self._lock:
            return DiskStats(self.capacity_bytes, sum(self._sizes.values()), len(self._index),
                             len(self._sizes), self._num_corrupt)  # fmt: skip

    # -- room ---------------------------------------------------------------------------

    def _active_segment(self, size: int) -> int:
        if self._active is None or self._sizes[self._active] + size > self.segment_bytes:
            self._last += 1
            self._active = self._last
            self._path(self._active).touch()
            self._sizes[self._active] = 0
        return self._active

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
