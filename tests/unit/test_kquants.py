"""GGUF K-quants and Q5_0 / Q5_1 read into the affine form: bit for bit the gguf package's
dequantization of the same bytes, for blocks of random bytes (every code, scale and min
pattern the formats can hold) with finite float16 fields."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from common.models.quant.kquants import KQUANT_TYPES, read_kquant

# Byte offsets of each type's float16 fields within its block.
FLOAT16_AT = {
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
}


def random_blocks(type_name: str, rows: int, k: int, seed: int) -> np.ndarray:
    per_block, block_bytes, _ = KQUANT_TYPES[type_name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * k // per_block, block_bytes), dtype=np.uint8)
    for at in FLOAT16_AT[type_name]:
        # Finite halves of both signs, from subnormal to large (no inf or NaN).
        values = rng.standard_normal(blocks.shape[0]) * 10.0 ** rng.integers(-6, 3, blocks.shape[0])
        blocks[:, at : at + 2] = values.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(KQUANT_TYPES))
def test_dequantized_bit_for_bit_as_the_gguf_package(type_name: str) -> None:
    rows, k = 6, 512
    raw = random_blocks(type_name, rows, k, seed=len(type_name) + ord(type_name[1]))
    ours = read_kquant(type_name, raw, rows, k)
    theirs = quants.dequantize(raw, GGMLQuantizationType[type_name])
    assert theirs.shape == (rows, k)
    expected = torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32))
    got = ours.dequantize()
    assert got.dtype == torch.float32 and got.shape == (rows, k)
    mismatched = (got.view(torch.int32) != expected.view(torch.int32)).sum().item()
    assert mismatched == 0, f"{type_name}: {mismatched} of {rows * k} weights differ in bits"
    # Rows select as the weight's rows.
    assert torch.equal(ours[2:4].dequantize().view(torch.int32), expected[2:4].view(torch.int32))


def test_codes_and_groups_are_where_the_format_puts_them() -> None:
    """One Q4_K block by hand: group 5's scale 37 and min 9 (split across the packed bytes),
    code 11 at its 3rd weight; everything else zero."""
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.array([0.5], dtype=np.float16).view(np.uint8)  # d
    block[2:4] = np.array([0.25], dtype=np.float16).view(np.uint8)  # dmin
    # Group 5 (>= 4): scale's low 4 bits in byte 5 + 4 = 9's low nibble, top 2 bits in the
    # top of byte 1; min's low 4 bits in byte 9's high nibble, top 2 in the top of byte 5.
    scales = block[4:16]
    scales[9] = (37 & 15) | ((9 & 15) << 4)
    scales[1] |= (37 >> 4) << 6
    scales[5] |= (9 >> 4) << 6
    # Group 5 is odd: high nibbles of bytes 32 * 2 .. +31 of the codes.
    block[16 + 64 + 2] = 11 << 4
    weights = read_kquant("Q4_K", block.reshape(1, -1), 1, 256)
    assert weights.scales[0, 5].item() == 0.5 * 37 and weights.offsets is not None
    assert weights.offsets[0, 5].item() == -(0.25 * 9)
    assert weights.codes[0, 5 * 32 + 2].item() == 11
    assert int(torch.count_nonzero(weights.codes)) == 1
    w = weights.dequantize()
    assert w[0, 5 * 32 + 2].item() == 0.5 * 37 * 11 - 0.25 * 9
    assert w[0, 5 * 32 + 3].item() == -0.25 * 9 and w[0, 0].item() == 0.0


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K", "Q5_0"])
def test_k_not_a_multiple_of_the_block_is_refused(type_name: str) -> None:
    per_block = KQUANT_TYPES[type_name][0]
    with pytest.raises(ValueError, match=f"multiple of {per_block}"):
        read_kquant(type_name, np.zeros((1, 10), dtype=np.uint8), 1, per_block + 16)
