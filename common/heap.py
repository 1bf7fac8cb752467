"""The garbage collector and the C allocator, tuned for a long-lived service process.

A worker's start-up leaves about 365,000 objects that live as long as the process (torch,
transformers, the model's modules, gRPC, protobuf). Python's full (generation 2)
collection walks every one of them: about 330 ms on this project's 2-core CPU machine,
with the GIL held, so every thread of the process (the engine's included) stops for it.
Such a collection can come whenever enough new objects outlive the younger generations,
and one more comes when the interpreter exits. Freezing the heap once start-up is over
moves those objects out of the collector's sight: later collections cost only what was
allocated since, and an idle worker exits in under 0.5 s after SIGTERM instead of 3.6 s.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import platform
import threading
import time
from typing import Any

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collects what start-up left as garbage, then freezes the rest (``gc.freeze``);
    returns the number of objects frozen. Call once, when the process starts serving."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info(
        "froze the start-up heap: %d objects out of the collector's sight (%.0f ms)",
        frozen,
        (time.perf_counter() - start) * 1000,
    )
    return frozen


# glibc mallopt parameters (malloc.h) and pdserve's values for them.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 64 << 20  # above the largest gRPC message (16 MiB)
TRIM_THRESHOLD_BYTES = 256 << 20


def tune_malloc() -> bool:
    """Keeps glibc from handing large buffers back to the kernel after each use.

    KV transfers move messages of up to a few MiB: each one a fresh bytes object when it is
    built, serialized, parsed and read. By default glibc serves an allocation that large
    with its own mmap (or trims the heap top after a free), so every message pays page
    faults on memory the kernel must zero first. Raising the mmap and trim thresholds keeps
    that memory in the heap for the next message: KvTransferService.PullBlocks ran about 2x
    faster here (loadtest/bench_stack.py measures both). The price is freed memory kept
    for reuse, up to the trim threshold: after the same 40-request load a decode worker
    held 2002 MiB RSS against 1846 without the tuning. Skipped where the user set
    ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``, with
    ``PDSERVE_MALLOC_TUNING=0``, and off glibc; returns whether it applied.
    """
    if os.environ.get("PDSERVE_MALLOC_TUNING", "1") == "0" or any(
        name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    ):
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )


# Free memory (in every arena together) the process may keep for reuse before HeapTrimmer
# hands it back; checked every TRIM_EVERY_S.
KEEP_FREE_BYTES = 64 << 20  # a few of the largest KV messages (16 MiB) for reuse
TRIM_EVERY_S = 30.0


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost",
    )]  # fmt: skip


class HeapTrimmer:
    """Bounds the freed memory glibc keeps: every ``every_s``, when the free chunks of all
    arenas together (``mallinfo2().fordblks``) pass ``keep_bytes``, ``malloc_trim(0)``
    hands their pages back to the kernel (the chunks stay free for reuse; a later
    allocation in them faults its pages in again).

    Why: with the raised thresholds (``tune_malloc``), memory a burst of requests freed
    stays resident in whichever arena freed it. Under a 13-minute load (624 requests, 4
    clients) a decode worker's Python heap grew by about 1 MiB while glibc kept 230-330 MiB
    free across its 16 arenas, and one malloc_trim returned 137 MiB of RSS (200 on the
    prefill worker): RSS that moved with that free memory, not with anything a request
    keeps. With the trimmer, the same driver (752 requests; both runs on a busy 2-core
    Zen 3 VM): decode RSS 1192-1314 MiB, 1193 idle after, against 1307-1401 and 1396
    without; prefill 1099-1192 and 1099, against 1215-1311 and 1305. The trim runs in its
    own thread (ctypes releases the GIL for it); glibc locks one arena at a time while it
    gives pages back (80 ms for 199 MiB here), so a thread allocating in that arena waits."""

    def __init__(self, libc: Any, keep_bytes: int = KEEP_FREE_BYTES,
                 every_s: float = TRIM_EVERY_S) -> None:  # fmt: skip
        self.libc = libc
        self.keep_bytes = keep_bytes
        self.every_s = every_s
        self.trims = 0
        self._stop = threading.Event()

    @classmethod
    def for_this_process(cls, **kwargs: Any) -> HeapTrimmer | None:
        """On glibc with mallinfo2 (2.33 and later); None elsewhere."""
        if platform.libc_ver()[0] != "glibc":
            return None
        try:
            libc = ctypes.CDLL(None)
            libc.mallinfo2.restype = _MallInfo2
            libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            return None
        return cls(libc, **kwargs)

    def free_bytes(self) -> int:
        return int(self.libc.mallinfo2().fordblks)

    def check(self) -> bool:
        """Trims when the free memory kept passes the bound; whether it did."""
        free = self.free_bytes()
        if free <= self.keep_bytes:
            return False
        start = time.perf_counter()
        self.libc.malloc_trim(0)
        self.trims += 1
        log.debug("malloc_trim: %d MiB free in the heaps, %.1f ms", free >> 20,
                  (time.perf_counter() - start) * 1000)  # fmt: skip
        return True

    def start(self) -> HeapTrimmer:
        threading.Thread(target=self._run, name="heap-trimmer", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self.check()
            except Exception as exc:  # never the process's end
                log.debug("heap trimmer: %s", exc)
                return
