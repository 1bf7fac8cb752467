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
import time

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
