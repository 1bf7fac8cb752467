"""common/heap.py's malloc tuning: applied on glibc unless the user chose otherwise."""

from __future__ import annotations

import platform

import pytest

from common.heap import tune_malloc


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
