"""The tiny K-quant files llama.cpp's llama-quantize made (tests/data/kquants/, remade by
loadtest/baselines/make_kquant_files.py): each preset's mix of types is what llama.cpp
writes, and every quantized tensor of every file (llama's presets; qwen2, qwen3 and the
qwen3moe MoE model's, whose experts are 3-D tensors) reads into the affine form, and into
the engine's packed weights expert by expert, bit for bit as the gguf package dequantizes
it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader, quants

from common.models.quant.kquants import KQUANT_TYPES, read_kquant

FILES = Path(__file__).resolve().parents[1] / "data" / "kquants"
PRESETS = ("Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1")
OTHER_ARCHS = ("qwen2-Q4_K_M", "qwen3-Q4_K_M", "qwen3moe-Q4_K_M", "qwen3moe-Q4_0")
NAMES = [f"llama-{p}" for p in PRESETS] + list(OTHER_ARCHS)


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
    for name in OTHER_ARCHS:
        assert (FILES / f"tiny-{name}.gguf").is_file(), name
    moe = types_in(FILES / "tiny-qwen3moe-Q4_K_M.gguf")
    assert "blk.0.ffn_gate_exps.weight" in moe["Q4_K"]
    assert any(n.endswith("ffn_down_exps.weight") for n in moe["Q6_K"]), moe["Q6_K"]
    assert "blk.1.ffn_up_exps.weight" in types_in(FILES / "tiny-qwen3moe-Q4_0.gguf")["Q4_0"]


def dequantized(tensor: object) -> torch.Tensor:
    """The gguf package's float32 dequantization of a file's tensor, [..., N, K]."""
    theirs = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)  # type: ignore[attr-defined]
    shape = [int(n) for n in reversed(tensor.shape.tolist())]  # type: ignore[attr-defined]
    return torch.from_numpy(np.array(theirs, dtype=np.float32)).view(shape)


@pytest.mark.parametrize("name", NAMES)
def test_every_tensor_reads_bit_for_bit(name: str) -> None:
    seen = 0
    for tensor in GGUFReader(FILES / f"tiny-{name}.gguf").tensors:
        type_name = tensor.tensor_type.name
        if type_name not in KQUANT_TYPES:
            assert type_name in ("F32", "F16", "Q8_0", "Q4_0", "Q4_1"), (tensor.name, type_name)
            continue
        # All but the last dimension are rows (an expert tensor's experts too).
        k = int(tensor.shape[0])
        rows = int(np.prod([int(n) for n in tensor.shape[1:]]))
        raw = np.asarray(tensor.data)
        ours = read_kquant(type_name, raw.reshape(rows, -1), rows, k).dequantize()
        expected = dequantized(tensor).reshape(rows, k)
        assert torch.equal(ours.view(torch.int32), expected.view(torch.int32)), tensor.name
        seen += 1
    assert seen > 0


@pytest.mark.parametrize("name", ["qwen3moe-Q4_K_M", "qwen3moe-Q4_0"])
def test_expert_tensors_are_read_expert_by_expert(name: str) -> None:
    """A 3-D expert tensor [E, N, K] becomes one packed weight per expert, under that
    expert's Hugging Face name, each dequantizing bit for bit to the gguf package's slice."""
    from common.models.quant.gguf import GgufCheckpoint
    from kernels.cpu.kquant import kq_available

    if not kq_available():
        pytest.skip("no KQx16 kernel here (AVX2 or AVX-512 VNNI)")
    path = FILES / f"tiny-{name}.gguf"
    reference = {t.name: dequantized(t) for t in GGUFReader(path).tensors}
    parts = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    experts = 0
    for tensor in GgufCheckpoint(path).tensors():
        if ".mlp.experts." not in tensor.name:
            continue
        layer, expert, part = (
            tensor.name.split(".")[2],
            tensor.name.split(".")[5],
            tensor.name.split(".")[6],
        )
        expected = reference[f"blk.{layer}.{parts[part]}.weight"][int(expert)]
        ours = tensor.value.dequantize()  # type: ignore[union-attr]
        # Equal as numbers (for finite floats, the same bits but for the sign of zero: Q4_0,
        # held as q d + (-8 d), makes +0 where gguf's d (q - 8) makes -0 for negative d).
        assert torch.equal(ours, expected), tensor.name
        experts += 1
    assert experts == 2 * 4 * 3  # layers x experts x projections


def test_the_engine_reads_every_quantized_tensor_packed() -> None:
    """Never through a float copy: each K-quant tensor becomes a KQx16 weight of its type
    (where the kernel runs: AVX2, or AVX-512 VNNI)."""
    from common.models.quant.gguf import GgufCheckpoint
    from common.models.quant.weights import Q4Weight, Q8Weight
    from kernels.cpu.kquant import KQx16, kq_available

    if not kq_available():
        pytest.skip("no KQx16 kernel here (AVX2 or AVX-512 VNNI)")
    for preset in NAMES:
        path = FILES / f"tiny-{preset}.gguf"
        for tensor in GgufCheckpoint(path).tensors():
            if tensor.type_name in KQUANT_TYPES:
                assert isinstance(tensor.value, KQx16), (preset, tensor.name)
                assert tensor.value.type_name == tensor.type_name
            elif tensor.type_name in ("Q4_0", "Q4_1", "Q8_0"):
                assert isinstance(tensor.value, Q4Weight | Q8Weight), (preset, tensor.name)
            else:
                assert isinstance(tensor.value, torch.Tensor), (preset, tensor.name)
