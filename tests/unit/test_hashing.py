"""Hash scheme v1, pinned: test vectors plus an encoding built by hand (no cbor2)."""

from __future__ import annotations

import hashlib
import struct

from common.kv.hashing import (
    HASH_SCHEME_VERSION,
    BlockHash,
    hash_block,
    hash_prompt_blocks,
    root_hash,
)


def _lower64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


def test_scheme_version_is_one() -> None:
    assert HASH_SCHEME_VERSION == 1


def test_root_hash_is_sha256_of_cbor_text_string() -> None:
    assert root_hash("") == _lower64(b"\x60")  # CBOR text string of length 0
    assert root_hash("42") == _lower64(b"\x62" + b"42")


def test_block_hash_matches_hand_encoded_cbor() -> None:
    parent = root_hash("")
    # [uint64 parent, [1, 2, 3, 4], null]: array(3), uint64 (0x1b + 8 bytes), array(4) of
    # small ints, null (0xf6). Canonical CBOR uses the shortest form for each integer.
    encoded = b"\x83\x1b" + struct.pack(">Q", parent) + b"\x84\x01\x02\x03\x04\xf6"
    assert hash_block(parent, [1, 2, 3, 4]) == _lower64(encoded)
    # With a salt: extra_keys = ["ab"] -> array(1) of text(2).
    salted = b"\x83\x1b" + struct.pack(">Q", parent) + b"\x84\x01\x02\x03\x04\x81\x62ab"
    assert hash_block(parent, [1, 2, 3, 4], ["ab"]) == _lower64(salted)
    # Token ids above 23 take a one-byte (0x18) or two-byte (0x19) argument.
    wide = b"\x83\x00\x82\x18\x18\x19\x01\x00\xf6"
    assert hash_block(BlockHash(0), [24, 256]) == _lower64(wide)


def test_vectors() -> None:
    assert root_hash("") == 780114917913990099
    assert root_hash("42") == 12056132650316601216
    assert hash_prompt_blocks(list(range(32)), 16) == [11338012631650408282, 3427227388231036566]
    assert hash_prompt_blocks(list(range(32)), 16, cache_salt="tenant-a") == [
        8799651259176035217,
        16866406559453633596,
    ]
    assert hash_block(BlockHash(0), [1, 2, 3, 4]) == 4753154868225975876


def test_partial_blocks_have_no_hash_and_chains_continue() -> None:
    tokens = list(range(40))
    full = hash_prompt_blocks(tokens, 16)
    assert len(full) == 2
    assert hash_prompt_blocks(tokens[:31], 16) == full[:1]
    assert hash_prompt_blocks(tokens, 16, parent=full[0], start_block=1) == full[1:]


def test_salts_and_seeds_separate_chains() -> None:
    tokens = list(range(16))
    plain = hash_prompt_blocks(tokens, 16)
    assert hash_prompt_blocks(tokens, 16, cache_salt="a") != plain
    assert hash_prompt_blocks(tokens, 16, cache_salt="a") != hash_prompt_blocks(
        tokens, 16, cache_salt="b"
    )
    assert hash_prompt_blocks(tokens, 16, seed="1") != plain
    # Same tokens, different parents: a block's hash depends on everything before it.
    assert (
        hash_prompt_blocks(list(range(16, 32)), 16)
        != hash_prompt_blocks(tokens + list(range(16, 32)), 16)[1:]
    )
