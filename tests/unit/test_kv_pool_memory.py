"""The CPU KV pool's memory: mapped as blocks are first written, or all at start when
prefaulted, zeroed either way, and alive as long as the tensor is."""

from __future__ import annotations

import gc

import psutil
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.model_runner import _zeroed

SIZE = 256 << 20


def rss() -> int:
    return int(psutil.Process().memory_info().rss)


@pytest.mark.parametrize("prefault", [False, True])
def test_the_pool_is_zeroed_and_held_by_its_tensor(prefault: bool) -> None:
    before = rss()
    pool = _zeroed((SIZE // 4 // 1024, 1024), torch.float32, torch.device("cpu"), prefault)
    grown = rss() - before
    if prefault:
        assert grown >= SIZE * 0.9, f"a prefaulted pool holds its memory: {grown >> 20} MiB"
    else:
        assert grown < SIZE // 4, f"a lazy pool maps pages as used: {grown >> 20} MiB at start"
    gc.collect()  # the mapping lives as long as the tensor, not a local of _zeroed
    assert pool.shape == (SIZE // 4 // 1024, 1024) and pool.dtype == torch.float32
    assert int(torch.count_nonzero(pool[:: 997])) == 0
    pool[5].fill_(2.5)
    view = pool[4:6].clone()
    assert view[1].eq(2.5).all() and view[0].eq(0).all()
    del pool
    gc.collect()


def test_prefault_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert EngineConfig(model="m").kv_prefault is False
    monkeypatch.setenv("PDSERVE_KV_PREFAULT", "1")
    assert EngineConfig.from_env("m").kv_prefault is True
    monkeypatch.setenv("PDSERVE_KV_PREFAULT", "0")
    assert EngineConfig.from_env("m").kv_prefault is False
    assert EngineConfig.from_env("m", kv_prefault=True).kv_prefault is True
