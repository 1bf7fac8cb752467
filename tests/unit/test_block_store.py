"""The block store's memory tier: two-phase visibility, reservations, exact LRU eviction
order, put expiry, layout per model, and pinning during reads."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from common.errors import (
    CapacityError,
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
)
from common.kv.layout import KvLayout, crc32c
from services.blockstore.store import BeginPutResult, BlockKey, BlockStore
from tests.fake_clock import FakeClock

LAYOUT = KvLayout(num_layers=2, num_kv_heads=1, head_dim=4, block_size=2, dtype=torch.float32)
BLOCK = LAYOUT.bytes_per_block  # 128 bytes
MODEL = "tiny"
V1 = 1


class Events:
    """A StoreListener that records what it is told."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str, list[int]]] = []

    def blocks_stored(self, model: str, block_hashes: Sequence[int]) -> None:
        self.log.append(("stored", model, list(block_hashes)))

    def blocks_removed(self, model: str, block_hashes: Sequence[int]) -> None:
        self.log.append(("removed", model, list(block_hashes)))


def make_store(num_blocks: int, expiry_s: float = 30.0) -> tuple[BlockStore, FakeClock, Events]:
    clock, events = FakeClock(), Events()
    store = BlockStore(
        num_blocks * BLOCK, expiry_s, listener=events, clock=clock, wall_clock=lambda: 50.0
    )
    return store, clock, events


def block_bytes(block_hash: int, size: int = BLOCK) -> bytes:
    return bytes((block_hash * 7 + i) % 251 for i in range(size))


def receive(
    store: BlockStore,
    put: BeginPutResult,
    hashes: Sequence[int],
    only: Sequence[int] | None = None,
    size: int = BLOCK,
) -> None:
    for block_hash in put.missing_block_hashes:
        if only is not None and block_hash not in only:
            continue
        data = block_bytes(block_hash, size)
        store.receive_block(
            put.put_id, list(hashes).index(block_hash), block_hash, data, crc32c(data)
        )


def put_blocks(
    store: BlockStore, hashes: Sequence[int], model: str = MODEL, layout: KvLayout = LAYOUT
) -> int:
    put = store.begin_put(model, V1, layout, hashes)
    if not put.put_id:
        return 0
    receive(store, put, hashes, size=layout.bytes_per_block)
    return store.commit_put(put.put_id)


def lru(store: BlockStore) -> list[int]:
    return [key.block_hash for key in store.lru_order()]


# -- two-phase puts ---------------------------------------------------------------------------


def test_received_blocks_are_invisible_until_commit() -> None:
    store, _, events = make_store(8)
    put = store.begin_put(MODEL, V1, LAYOUT, [11, 12, 13])
    assert put.missing_block_hashes == [11, 12, 13]
    assert put.expiry_unix_ms == 80_000  # wall clock 50 s + 30 s expiry
    receive(store, put, [11, 12, 13])

    assert store.contains(MODEL, V1, [11, 12, 13]) == [False, False, False]
    with pytest.raises(NotFoundError):
        store.pin(MODEL, V1, [11])
    assert events.log == []

    assert store.commit_put(put.put_id) == 3
    assert store.contains(MODEL, V1, [11, 12, 13, 14]) == [True, True, True, False]
    layout, blocks = store.pin(MODEL, V1, [12, 11])
    assert layout == LAYOUT
    assert [b.data for b in blocks] == [block_bytes(12), block_bytes(11)]
    assert [b.crc32c for b in blocks] == [crc32c(block_bytes(12)), crc32c(block_bytes(11))]
    assert events.log == [("stored", MODEL, [11, 12, 13])]
    stats = store.stats()
    assert (stats.committed_bytes, stats.reserved_bytes, stats.num_blocks) == (3 * BLOCK, 0, 3)


def test_begin_put_lists_only_missing_blocks_once_and_opens_nothing_when_all_present() -> None:
    store, _, _ = make_store(8)
    put_blocks(store, [1, 2])
    put = store.begin_put(MODEL, V1, LAYOUT, [1, 3, 2, 3, 4])
    assert put.missing_block_hashes == [3, 4]
    assert store.stats().reserved_bytes == 2 * BLOCK
    store.abort_put(put.put_id)

    assert store.begin_put(MODEL, V1, LAYOUT, [2, 1]) == BeginPutResult("", [], 0)
    assert store.stats().num_open_puts == 0


def test_commit_with_a_block_not_received_fails_and_keeps_the_put_open() -> None:
    store, _, _ = make_store(8)
    put = store.begin_put(MODEL, V1, LAYOUT, [5, 6])
    receive(store, put, [5, 6], only=[5])
    with pytest.raises(FailedPreconditionError, match="1 of 2 blocks not received"):
        store.commit_put(put.put_id)
    assert store.contains(MODEL, V1, [5, 6]) == [False, False]
    receive(store, put, [5, 6], only=[6])
    assert store.commit_put(put.put_id) == 2
    with pytest.raises(NotFoundError):
        store.commit_put(put.put_id)


def test_two_open_puts_of_one_block_first_commit_wins() -> None:
    store, _, events = make_store(8)
    first = store.begin_put(MODEL, V1, LAYOUT, [7])
    second = store.begin_put(MODEL, V1, LAYOUT, [7, 8])
    assert second.missing_block_hashes == [7, 8]  # being written counts as missing
    store.receive_block(second.put_id, 0, 7, b"\x01" * BLOCK, crc32c(b"\x01" * BLOCK))
    store.receive_block(second.put_id, 1, 8, block_bytes(8), crc32c(block_bytes(8)))
    store.receive_block(first.put_id, 0, 7, block_bytes(7), crc32c(block_bytes(7)))
    assert store.commit_put(first.put_id) == 1
    assert store.commit_put(second.put_id) == 1  # only block 8 was new
    _, (block,) = store.pin(MODEL, V1, [7])
    assert block.data == block_bytes(7)
    assert events.log == [("stored", MODEL, [7]), ("stored", MODEL, [8])]
    stats = store.stats()
    assert (stats.committed_bytes, stats.reserved_bytes) == (2 * BLOCK, 0)


def test_abort_frees_the_reservation_and_is_idempotent() -> None:
    store, _, _ = make_store(4)
    put = store.begin_put(MODEL, V1, LAYOUT, [1, 2])
    receive(store, put, [1, 2])
    assert store.abort_put(put.put_id) is True
    assert store.abort_put(put.put_id) is False
    assert store.abort_put("never-opened") is False
    assert store.stats().reserved_bytes == 0
    assert store.contains(MODEL, V1, [1, 2]) == [False, False]
    with pytest.raises(NotFoundError):
        store.receive_block(put.put_id, 0, 1, block_bytes(1), crc32c(block_bytes(1)))


def test_check_block_rejects_blocks_the_put_does_not_expect() -> None:
    store, _, _ = make_store(8)
    put_blocks(store, [1])
    put = store.begin_put(MODEL, V1, LAYOUT, [1, 2])
    assert store.check_block(put.put_id, 1, 2) == LAYOUT
    with pytest.raises(InvalidRequestError, match="outside"):
        store.check_block(put.put_id, 2, 2)
    with pytest.raises(InvalidRequestError, match="has hash"):
        store.check_block(put.put_id, 1, 3)
    with pytest.raises(InvalidRequestError, match="not missing"):
        store.check_block(put.put_id, 0, 1)
    with pytest.raises(NotFoundError):
        store.check_block("nope", 1, 2)


@pytest.mark.parametrize(
    ("model", "hashes", "field"),
    [("", [1], "model"), (MODEL, [], "block_hashes"), (MODEL, [1, 0], "block_hashes")],
)
def test_begin_put_rejects_bad_requests(model: str, hashes: list[int], field: str) -> None:
    store, _, _ = make_store(4)
    with pytest.raises(InvalidRequestError) as info:
        store.begin_put(model, V1, LAYOUT, hashes)
    assert info.value.field == field


def test_unknown_hash_scheme_version_is_a_failed_precondition() -> None:
    store, _, _ = make_store(4)
    with pytest.raises(FailedPreconditionError, match="hash scheme version 2"):
        store.begin_put(MODEL, 2, LAYOUT, [1])
    with pytest.raises(FailedPreconditionError):
        store.contains(MODEL, 2, [1])
    with pytest.raises(FailedPreconditionError):
        store.pin(MODEL, 2, [1])


# -- layout per model -------------------------------------------------------------------------


def test_layout_is_fixed_per_model_by_the_first_put() -> None:
    store, _, _ = make_store(64)
    other = KvLayout(2, 1, 4, 2, torch.bfloat16)
    put_blocks(store, [1])
    with pytest.raises(FailedPreconditionError, match="differs"):
        store.begin_put(MODEL, V1, other, [2])
    assert put_blocks(store, [1], model="other-model", layout=other) == 1  # another model
    assert store.layout_of("other-model") == other
    assert store.layout_of(MODEL) == LAYOUT


def test_an_open_put_fixes_the_layout_and_an_empty_model_releases_it() -> None:
    store, _, _ = make_store(4)
    other = KvLayout(1, 1, 4, 2, torch.float32)  # 64 bytes a block
    put = store.begin_put(MODEL, V1, LAYOUT, [1])
    with pytest.raises(FailedPreconditionError):
        store.begin_put(MODEL, V1, other, [2])
    store.abort_put(put.put_id)
    assert store.layout_of(MODEL) is None
    assert put_blocks(store, [2], layout=other) == 1
    assert store.layout_of(MODEL) == other


# -- reservations and eviction ----------------------------------------------------------------


def test_reservations_count_against_capacity_and_fail_without_side_effects() -> None:
    store, _, events = make_store(4)
    held = store.begin_put(MODEL, V1, LAYOUT, [1, 2, 3])
    with pytest.raises(CapacityError, match="reserved by open puts"):
        store.begin_put(MODEL, V1, LAYOUT, [4, 5])
    assert store.stats().reserved_bytes == 3 * BLOCK
    assert store.stats().num_open_puts == 1
    store.abort_put(held.put_id)
    put = store.begin_put(MODEL, V1, LAYOUT, [4, 5])
    assert put.missing_block_hashes == [4, 5]
    assert events.log == []


def test_a_put_larger_than_the_store_never_fits() -> None:
    store, _, _ = make_store(2)
    with pytest.raises(CapacityError, match="exceed the store's capacity"):
        store.begin_put(MODEL, V1, LAYOUT, [1, 2, 3])


def test_lru_eviction_order_is_exact_and_evicts_a_prompt_tail_first() -> None:
    store, _, events = make_store(4)
    put_blocks(store, [1, 2])  # committed last-first: 2 is older than 1
    assert lru(store) == [2, 1]
    put_blocks(store, [3])
    assert lru(store) == [2, 1, 3]
    _, pinned = store.pin(MODEL, V1, [1])  # a read touches
    store.unpin(pinned)
    assert lru(store) == [2, 3, 1]

    put_blocks(store, [4, 5])  # 1 free, needs 2: evicts exactly the LRU block 2
    assert lru(store) == [3, 1, 5, 4]
    assert events.log[-2] == ("removed", MODEL, [2])

    put_blocks(store, [6, 7])  # evicts 3, then 1
    assert lru(store) == [5, 4, 7, 6]
    assert events.log[-2] == ("removed", MODEL, [3, 1])
    assert store.stats().num_evictions == 3
    assert store.stats().committed_bytes == 4 * BLOCK


def test_a_put_that_finds_its_prefix_present_touches_it_before_evicting() -> None:
    store, _, events = make_store(3)
    put_blocks(store, [1])
    put_blocks(store, [2, 3])
    assert lru(store) == [1, 3, 2]
    put_blocks(store, [1, 9])  # 1 is the LRU block but this prompt's own head: 3 goes
    assert lru(store) == [2, 9, 1]
    assert events.log[-2] == ("removed", MODEL, [3])


def test_pinned_blocks_are_skipped_by_eviction() -> None:
    store, _, events = make_store(3)
    put_blocks(store, [1, 2, 3])
    assert lru(store) == [3, 2, 1]
    _, pinned = store.pin(MODEL, V1, [3])
    assert lru(store) == [2, 1, 3]  # touched by the read, still the first to go were it not pinned
    _, pinned_again = store.pin(MODEL, V1, [2])
    assert lru(store) == [1, 3, 2]
    put_blocks(store, [4])
    assert lru(store) == [3, 2, 4]
    assert events.log[-2] == ("removed", MODEL, [1])

    with pytest.raises(CapacityError, match="pinned by reads"):
        store.begin_put(MODEL, V1, LAYOUT, [5, 6])  # only block 4 is evictable
    assert lru(store) == [3, 2, 4]

    store.unpin(pinned)
    store.unpin(pinned_again)
    assert store.stats().pinned_bytes == 0
    put_blocks(store, [5, 6])
    assert lru(store) == [4, 6, 5]
    assert events.log[-2] == ("removed", MODEL, [3, 2])


def test_pin_is_all_or_nothing_and_counts_repeats() -> None:
    store, _, _ = make_store(4)
    put_blocks(store, [1, 2])
    with pytest.raises(NotFoundError, match="0x3"):
        store.pin(MODEL, V1, [1, 3])
    assert store.stats().pinned_bytes == 0
    _, first = store.pin(MODEL, V1, [1, 1])
    assert first[0].num_pins == 2
    assert store.stats().pinned_bytes == BLOCK
    _, second = store.pin(MODEL, V1, [1])
    store.unpin(first)
    assert store.stats().pinned_bytes == BLOCK
    store.unpin(second)
    assert store.stats().pinned_bytes == 0


def test_evicting_every_block_of_a_model_releases_its_layout() -> None:
    store, _, events = make_store(2)
    put_blocks(store, [1, 2], model="a")
    put_blocks(store, [3, 4], model="b")
    assert store.layout_of("a") is None
    assert events.log[-2] == ("removed", "a", [2, 1])
    assert store.committed_hashes() == {"b": [4, 3]}


# -- expiry -----------------------------------------------------------------------------------


def test_expired_puts_are_aborted_and_their_room_returned() -> None:
    store, clock, _ = make_store(4, expiry_s=10.0)
    put = store.begin_put(MODEL, V1, LAYOUT, [1, 2])
    receive(store, put, [1, 2], only=[1])
    clock.now += 9.9
    receive(store, put, [1, 2], only=[2])
    clock.now += 0.1
    with pytest.raises(NotFoundError, match="expired"):
        store.commit_put(put.put_id)
    assert store.stats().reserved_bytes == 0
    assert store.stats().num_expired_puts == 1
    assert store.contains(MODEL, V1, [1, 2]) == [False, False]
    assert store.abort_put(put.put_id) is False


def test_expire_puts_sweeps_only_puts_past_their_deadline() -> None:
    store, clock, _ = make_store(4, expiry_s=10.0)
    old = store.begin_put(MODEL, V1, LAYOUT, [1])
    clock.now += 5
    young = store.begin_put(MODEL, V1, LAYOUT, [2])
    clock.now += 5
    assert store.expire_puts() == 1
    assert store.abort_put(old.put_id) is False
    assert store.abort_put(young.put_id) is True


def test_begin_put_reclaims_room_from_expired_puts() -> None:
    store, clock, _ = make_store(2, expiry_s=10.0)
    store.begin_put(MODEL, V1, LAYOUT, [1, 2])
    with pytest.raises(CapacityError):
        store.begin_put(MODEL, V1, LAYOUT, [3])
    clock.now += 10
    assert store.begin_put(MODEL, V1, LAYOUT, [3]).missing_block_hashes == [3]
    assert store.stats().num_expired_puts == 1


def test_block_keys_separate_models_and_hash_versions() -> None:
    store = BlockStore(8 * BLOCK, 30.0, hash_scheme_versions=(1, 2))
    put = store.begin_put(MODEL, 2, LAYOUT, [1])
    store.receive_block(put.put_id, 0, 1, block_bytes(1), crc32c(block_bytes(1)))
    store.commit_put(put.put_id)
    assert store.contains(MODEL, 2, [1]) == [True]
    assert store.contains(MODEL, 1, [1]) == [False]
    assert store.contains("other", 2, [1]) == [False]
    assert store.lru_order() == [BlockKey(MODEL, 2, 1)]
