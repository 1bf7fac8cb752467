"""The tiny K-quant files llama.cpp's llama-quantize made (tests/data/kquants/, remade by
loadtest/baselines/make_kquant_files.py): each preset's mix of types is what llama.cpp
writes, and every quantized tensor of every file reads into the affine form bit for bit as
the gguf package dequantizes it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from common.models.quant.kquants import KQUANT_TYPES, read_kquant

FILES = Path(__file__).resolve().parents[1] / "data" / "kquants"
PRESETS = ("Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1")


def types_in(path: Path) -> dict[str, set[str]]:
    kinds: dict[str, set[str]] = {}
    for tensor in GGUFReader(path).tensors:
        kinds.setdefault(tensor.tensor_type.name, set()).add(tensor.name)
    return kinds


def test_every_preset_is_there_and_mixes_as_llama_cpp_does() -> None:
    for preset in PRESETS:
        assert (FILES / f"tiny-llama-{preset}.gguf").is_file(), preset
    q4_k_m = types_in(FILES / "tiny-llama-Q4_K_M.gguf")
    # Q4_K_M: Q4_K in most matrices, Q6_K for the output head and some V and down ones.
    assert "Q4_K" in q4_k_m and "Q6_K" in q4_k_m
    assert "output.weight" in q4_k_m["Q6_K"]
    assert set(types_in(FILES / "tiny-llama-Q6_K.gguf")) >= {"Q6_K", "F32"}
    assert "Q3_K" in types_in(FILES / "tiny-llama-Q3_K_M.gguf")
    assert "Q2_K" in types_in(FILES / "tiny-llama-Q2_K.gguf")
    assert "Q5_K" in types_in(FILES / "tiny-llama-Q5_K_M.gguf")
    assert "Q5_0" in types_in(FILES / "tiny-llama-Q5_0.gguf")
    assert "Q5_1" in types_in(FILES / "tiny-llama-Q5_1.gguf")


@pytest.mark.parametrize("preset", PRESETS)
def test_every_tensor_reads_bit_for_bit(preset: str) -> None:
    seen = 0
    for tensor in GGUFReader(FILES / f"tiny-llama-{preset}.gguf").tensors:
        type_name = tensor.tensor_type.name
        if type_name not in KQUANT_TYPES:
            assert type_name in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1"), (tensor.name, type_name)
            continue
        rows, k = int(tensor.shape[1]), int(tensor.shape[0])
        raw = np.asarray(tensor.data)
        ours = read_kquant(type_name, raw, rows, k).dequantize()
        theirs = quants.dequantize(raw, GGMLQuantizationType[type_name])
        expected = torch.from_numpy(np.ascontiguousarray(theirs, dtype=np.float32)).view(rows, k)
        assert torch.equal(ours.view(torch.int32), expected.view(torch.int32)), tensor.name
        seen += 1
    assert seen > 0


def test_the_engine_reads_every_quantized_tensor_packed() -> None:
    """Never through a float copy: each K-quant tensor becomes a KQx16 weight of its type
    (where the kernel runs: AVX-512 VNNI)."""
    from common.models.quant.gguf import GgufCheckpoint
    from common.models.quant.linear import x16_available
    from kernels.cpu.kquant import KQx16

    if not x16_available():
        pytest.skip("the KQx16 kernel needs AVX-512 VNNI")
    for preset in PRESETS:
        path = FILES / f"tiny-llama-{preset}.gguf"
        for tensor in GgufCheckpoint(path).tensors():
            if tensor.type_name in KQUANT_TYPES:
                assert isinstance(tensor.value, KQx16), (preset, tensor.name)
                assert tensor.value.type_name == tensor.type_name
            else:
                assert isinstance(tensor.value, torch.Tensor), (preset, tensor.name)
