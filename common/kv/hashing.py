"""Block hashing, scheme v1: the one place that turns token ids into block hashes.

A block hash chains over the prompt: ``h_i = H(h_{i-1}, tokens_i, extra_keys)`` where
``tokens_i`` are the ``block_size`` token ids of block ``i`` and ``H`` is the lower 64 bits
of SHA-256 over the canonical CBOR encoding of ``[parent, [token ids...], extra_keys]``.
The root parent is the lower 64 bits of SHA-256 over the CBOR encoding of the hash seed
(a string). This follows vLLM / llm-d (``sha256_cbor`` with integer block hashes), so an
index built by either can be read by the other given the same seed and block size.

``extra_keys`` is ``None`` for an unsalted request on float weights; otherwise a list whose
first element is the tenant's cache salt ("" for none) and whose second, when the engine
serves quantized weights, is ``"weights:<identity>"`` (common/models/quant/formats.py): two
requests with different salts, or computed under different weight formats, never share a
block. Float weights add nothing, so their hashes are those of vLLM's scheme.

The scheme version travels in every ``KvHandle``; bump ``HASH_SCHEME_VERSION`` if any byte
of this encoding changes. tests/unit/test_hashing.py pins it with test vectors.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NewType

import cbor2

HASH_SCHEME_VERSION = 1
DEFAULT_HASH_SEED = ""

BlockHash = NewType("BlockHash", int)
"""An unsigned 64-bit chained block hash."""


def _lower64(payload: object) -> int:
    digest = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
    return int.from_bytes(digest[24:], "big")


def root_hash(seed: str = DEFAULT_HASH_SEED) -> BlockHash:
    """The parent of a prompt's first block."""
    return BlockHash(_lower64(seed))


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[object] | None = None
) -> BlockHash:
    """Hash of one full block, chained to its parent."""
    extra = None if extra_keys is None else list(extra_keys)
    return BlockHash(_lower64([int(parent), [int(t) for t in token_ids], extra]))


def extra_keys_for(cache_salt: str | None, weights: str | None = None) -> list[object] | None:
    """The extra keys of every block of a request: its cache salt and its weight format."""
    if weights:
        return [cache_salt or "", f"weights:{weights}"]
    return [cache_salt] if cache_salt else None


def hash_prompt_blocks(
    token_ids: Sequence[int],
    block_size: int,
    cache_salt: str | None = None,
    seed: str = DEFAULT_HASH_SEED,
    parent: BlockHash | None = None,
    start_block: int = 0,
    weights: str | None = None,
) -> list[BlockHash]:
    """Hashes of every *full* block of ``token_ids``; a trailing partial block has none.

    ``parent``/``start_block`` continue a chain already hashed up to ``start_block`` blocks;
    ``weights`` is the weight format's identity (None for float weights).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    extra = extra_keys_for(cache_salt, weights)
    h = root_hash(seed) if parent is None else parent
    hashes: list[BlockHash] = []
    for start in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        h = hash_block(h, token_ids[start : start + block_size], extra)
        hashes.append(h)
    return hashes
