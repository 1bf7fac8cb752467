"""Every Redis key pdserve uses, built here and nowhere else. All begin ``pdserve:v1:``.

| key | type | content | lifetime |
|---|---|---|---|
| ``pdserve:v1:{model}:block:{hash}`` | hash | location (worker id or ``store``) -> tier | TTL, refreshed on store |
| ``pdserve:v1:workers`` | set | worker ids ever registered (stale ones pruned on read) | permanent index |
| ``pdserve:v1:worker:{id}`` | hash | role, address, model, load figures | TTL, refreshed by heartbeat |
| ``pdserve:v1:{model}:expert_load:{layer}`` | hash | expert -> tokens routed | TTL, refreshed on write |
"""

from __future__ import annotations

PREFIX = "pdserve:v1:"
STORE_LOCATION = "store"  # the block store's entry in a block's location hash


def _model(model: str) -> str:
    if not model or any(c in model for c in " \n:{}"):
        raise ValueError(f"model name {model!r} cannot be part of a Redis key")
    return model


def block(model: str, block_hash: int) -> str:
    return f"{PREFIX}{_model(model)}:block:{block_hash:016x}"


def workers() -> str:
    return f"{PREFIX}workers"


def worker(worker_id: str) -> str:
    return f"{PREFIX}worker:{worker_id}"


def expert_load(model: str, layer: int) -> str:
    return f"{PREFIX}{_model(model)}:expert_load:{layer}"
