"""common/heap.py's malloc tuning: applied on glibc unless the user chose otherwise; the
trimmer that bounds the freed memory the heaps keep."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from common.heap import HeapTrimmer, tune_malloc


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_malloc_tuning_applies_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("PDSERVE_MALLOC_TUNING", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)
    assert tune_malloc() is True


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("PDSERVE_MALLOC_TUNING", "0"),
        ("MALLOC_MMAP_THRESHOLD_", "131072"),  # the user's own glibc settings win
        ("MALLOC_TRIM_THRESHOLD_", "131072"),
    ],
)
def test_malloc_tuning_gives_way(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    assert tune_malloc() is False


class FakeLibc:
    def __init__(self, free: int) -> None:
        self.free = free
        self.trimmed = 0

    def mallinfo2(self) -> object:
        return type("Info", (), {"fordblks": self.free})()

    def malloc_trim(self, pad: int) -> int:
        self.trimmed += 1
        return 1


def test_the_trimmer_trims_only_past_its_bound() -> None:
    libc = FakeLibc(free=100 << 20)
    trimmer = HeapTrimmer(libc, keep_bytes=256 << 20)
    assert trimmer.check() is False and libc.trimmed == 0
    libc.free = 300 << 20
    assert trimmer.check() is True and libc.trimmed == 1 and trimmer.trims == 1


TRIM_SCRIPT = r"""
import ctypes, json, sys
from common.heap import HeapTrimmer, tune_malloc

def rss_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20

assert tune_malloc()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = []
for _ in range(200):  # 200 MiB in 1 MiB chunks, each page touched
    p = libc.malloc(1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    blocks.append(p)
keep = blocks.pop()  # the heap's top stays in use: no trim from free() itself
for p in reversed(blocks):
    libc.free(p)
trimmer = HeapTrimmer.for_this_process(keep_bytes=64 << 20)
before = rss_mib()
free_mib = trimmer.free_bytes() / 2**20
trimmed = trimmer.check()
print(json.dumps({"before": before, "after": rss_mib(), "free": free_mib, "trimmed": trimmed}))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_the_trimmer_hands_freed_heap_memory_back_to_the_kernel() -> None:
    """With the tuning, 199 MiB freed stay resident (the trim threshold keeps them); the
    trimmer's check returns them."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PDSERVE_MALLOC_TUNING", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")}  # fmt: skip
    ran = subprocess.run([sys.executable, "-c", TRIM_SCRIPT], capture_output=True, text=True,
                         env=env, timeout=60, check=False)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    seen = json.loads(ran.stdout)
    assert seen["free"] > 150 and seen["trimmed"] is True
    assert seen["before"] - seen["after"] > 150, seen
