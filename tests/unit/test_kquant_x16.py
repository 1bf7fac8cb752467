"""The KQx16 layout (kernels/cpu/kquant.py): bit planes that round-trip, a 4-bit plane laid
as the Q4x16 codes are, and every quantized tensor of the tiny K-quant files packed and
dequantized bit for bit as the gguf package dequantizes the file, Q5_0 / Q5_1 in as many
bytes as their files take."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from common.models.quant.kquants import KQUANT_TYPES, read_kq_x16
from kernels.cpu.kquant import KQx16, pack_plane, unpack_plane
from kernels.cpu.quant import pack_q4_codes, pack_q4_x16

FILES = Path(__file__).resolve().parents[1] / "data" / "kquants"


@pytest.mark.parametrize("width", [1, 2, 4])
def test_planes_round_trip(width: int) -> None:
    values = torch.randint(0, 1 << width, (48, 96), dtype=torch.uint8)
    packed = pack_plane(values, width)
    assert packed.shape == (3, 3, width, 64) and packed.dtype == torch.uint8
    assert torch.equal(unpack_plane(packed, width), values)


def test_a_four_bit_plane_is_the_q4x16_code_layout() -> None:
    codes = torch.randint(0, 16, (32, 128), dtype=torch.uint8)
    ones = torch.ones(32, 4, dtype=torch.float16)
    q4x16, _, _ = pack_q4_x16(pack_q4_codes(codes), ones, ones)
    assert torch.equal(pack_plane(codes, 4), q4x16)


def test_bits_land_where_the_layout_says() -> None:
    """u[16j + i, 32b + (32 / w) c + 2t + h] sits in bits w t of word 2i + h of chunk c."""
    values = torch.zeros(32, 64, dtype=torch.uint8)
    j, i, b, c, t, h, width = 1, 5, 1, 1, 3, 1, 2
    values[16 * j + i, 32 * b + (32 // width) * c + 2 * t + h] = 3
    packed = pack_plane(values, width)
    word = packed[j, b, c].view(torch.int16)[2 * i + h].item()
    assert word == 3 << (width * t)
    assert int(torch.count_nonzero(packed)) == 1


@pytest.mark.parametrize("preset", ["Q2_K", "Q3_K_M", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1"])
def test_file_tensors_pack_and_dequantize_bit_for_bit(preset: str) -> None:
    seen: set[str] = set()
    for tensor in GGUFReader(FILES / f"tiny-llama-{preset}.gguf").tensors:
        type_name = tensor.tensor_type.name
        if type_name not in KQUANT_TYPES:
            continue
        rows, k = int(tensor.shape[1]), int(tensor.shape[0])
        raw = np.asarray(tensor.data)
        packed = read_kq_x16(type_name, raw, rows, k)
        assert packed.shape == (rows, k)
        theirs = quants.dequantize(raw, GGMLQuantizationType[type_name])
        expected = torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)).view(rows, k)
        got = packed.dequantize()
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), tensor.name
        seen.add(type_name)
    assert seen


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q4_K"])
def test_one_float_per_group_is_held_as_the_files_float16(type_name: str) -> None:
    from tests.unit.test_kquants import random_blocks

    n, k = 32, 256
    w = read_kq_x16(type_name, random_blocks(type_name, n, k, seed=3), n, k)
    if type_name == "Q4_K":  # a float per 256 and a 6-bit scale per 32: float32, as before
        assert w.d.dtype == torch.float32 and w.sc is not None
        return
    assert w.d.dtype == torch.float16 and w.sc is None and w.m is None
    assert (w.dmin is not None) == (type_name == "Q5_1")
    assert w.num_bytes == n * k // 32 * {"Q5_0": 22, "Q5_1": 24}[type_name]  # the file's size
    halves = KQx16.cat([w.blocks(slice(0, 1)), w.blocks(slice(1, 2))])
    assert halves.d.dtype == torch.float16
    assert torch.equal(halves.dequantize(), w.dequantize())
