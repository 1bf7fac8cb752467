"""GPTQ checkpoints made by gptqmodel (committed under tests/data/gptq/) and AWQ checkpoints
made by AutoAWQ in the test run (the ``awq_checkpoints`` fixture): every quantized tensor,
repacked into the KQx16 layout, dequantizes bit for bit to what the tool itself makes of the
file (its digests in each ``reference.json``); act order, zero points and bit widths land
where they should; what cannot be served is refused by name; each format has its own KV
identity.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch

from common.models.quant.compressed import UnsupportedQuantization
from common.models.quant.formats import resolve_weight_format
from common.models.quant.gptq import GptqAwqCheckpoint, awq_unpack, unpack_words
from common.models.quant.weights import Q4Weight, Q8Weight
from kernels.cpu.kquant import KQx16

GPTQ = Path(__file__).resolve().parents[1] / "data" / "gptq"
GPTQ_FILES = sorted(p.name for p in GPTQ.iterdir() if p.is_dir())
AWQ_FILES = ["llama-awq-w4-g128", "qwen2-awq-w4-g64", "qwen3_moe-awq-w4-g128"]


def check_against_tool(path: Path) -> int:
    reference = json.loads((path / "reference.json").read_text())["weights"]
    seen = 0
    for tensor in GptqAwqCheckpoint(path).tensors():
        if isinstance(tensor.value, torch.Tensor):
            continue
        module = tensor.name.removesuffix(".weight")
        ours = tensor.value.dequantize().to(torch.float16).contiguous()
        assert list(ours.shape) == reference[module]["shape"], module
        digest = hashlib.sha256(ours.numpy().tobytes()).hexdigest()
        assert digest == reference[module]["sha256"], (path.name, module)
        seen += 1
    # 7 projections x 2 layers; the MoE model: 4 attention + 4 experts x 3, x 2 layers.
    expected = 32 if path.name.startswith("qwen3_moe") else 14
    assert seen == len(reference) == expected, (seen, len(reference))
    return seen


def test_the_committed_gptq_files_are_all_there() -> None:
    assert GPTQ_FILES == [
        "llama-gptq-w4-g128", "llama-gptq-w4-g64-asym-actorder", "llama-gptq-w8-g128",
        "qwen2-gptq-w4-g128-actorder", "qwen3-gptq-w4-g128", "qwen3_moe-gptq-w4-g128",
    ]  # fmt: skip


@pytest.mark.parametrize("name", GPTQ_FILES)
def test_gptq_tensors_dequantize_as_gptqmodel_does(name: str) -> None:
    check_against_tool(GPTQ / name)


@pytest.mark.parametrize("name", AWQ_FILES)
def test_awq_tensors_dequantize_as_autoawq_does(awq_checkpoints: Path, name: str) -> None:
    check_against_tool(awq_checkpoints / name)


@pytest.mark.parametrize(
    ("name", "layout", "act_order", "zero_points"),
    [
        ("llama-gptq-w4-g128", "q4", False, False),  # float16 scales: exactly Q4
        ("llama-gptq-w4-g64-asym-actorder", "W4G64", True, True),
        ("llama-gptq-w8-g128", "q8", False, False),
        ("qwen2-gptq-w4-g128-actorder", "W4G128", True, False),
    ],
)
def test_gptq_layouts(name: str, layout: str, act_order: bool, zero_points: bool) -> None:
    weights = {t.name: t.value for t in GptqAwqCheckpoint(GPTQ / name).tensors()}
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert down.shape == (256, 512)
    if layout in ("q4", "q8"):
        assert isinstance(down, Q4Weight if layout == "q4" else Q8Weight), type(down)
        assert down.group_size == 128
        return
    assert isinstance(down, KQx16) and down.type_name == layout
    assert (down.perm is not None) == act_order
    assert (down.m is not None) == zero_points
    if name.startswith("qwen2"):
        assert weights["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


def test_v1_zero_points_are_restored_from_the_whole_word() -> None:
    """gptqmodel writes v1 zero points by subtracting 0x11111111 from each word (a zero
    point of 0 borrows from the next): adding it back restores every field, where adding 1
    per field would not."""
    zeros = torch.tensor([[0, 3, 15, 1, 0, 8, 2, 7]], dtype=torch.int64)
    word = sum(int(z) << (4 * i) for i, z in enumerate(zeros[0]))
    stored = (word - 0x11111111) % (1 << 32)
    as_int32 = torch.tensor([[stored - (1 << 32) if stored >= 1 << 31 else stored]], dtype=torch.int32)
    restored = (as_int32.to(torch.int64) + 0x11111111).remainder(1 << 32)
    assert unpack_words(restored, 4, dim=1).tolist() == zeros.tolist()
    per_field = (unpack_words(as_int32, 4, dim=1).to(torch.int64) + 1) & 15
    assert per_field.tolist() != zeros.tolist()


def test_awq_nibble_order() -> None:
    """AutoAWQ packs columns 0, 2, 4, 6, 1, 3, 5, 7 into nibbles 0..7 of a word."""
    columns = torch.arange(8)
    word = sum(int(c) << (4 * i) for i, c in enumerate([0, 2, 4, 6, 1, 3, 5, 7]))
    assert awq_unpack(torch.tensor([[word]], dtype=torch.int32)).tolist() == [columns.tolist()]


def test_identities_and_auto(awq_checkpoints: Path) -> None:
    seen = {}
    for path in [GPTQ / n for n in GPTQ_FILES] + [awq_checkpoints / n for n in AWQ_FILES]:
        fmt = resolve_weight_format("auto", 32, "auto", path)
        assert fmt.name == ("awq" if "awq" in path.name else "gptq"), fmt
        seen[path.name] = fmt.identity
    # One identity per format (the model is a key of its own): the three files of one GPTQ
    # format share it, as do the two of one AWQ format, and every other pair differs.
    assert seen["llama-gptq-w4-g128"] == seen["qwen3-gptq-w4-g128"] == "gptq-w4-g128/a16"
    assert seen["qwen3_moe-gptq-w4-g128"] == "gptq-w4-g128/a16"
    assert seen["llama-awq-w4-g128"] == seen["qwen3_moe-awq-w4-g128"] == "awq-w4-g128-asym/a16"
    assert len(set(seen.values())) == len(seen) - 3, seen
    with pytest.raises(ValueError, match="quant_method gptq"):
        resolve_weight_format("gptq", 32, "auto", awq_checkpoints / AWQ_FILES[0])


def _with_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_what_cannot_be_served_is_refused(awq_checkpoints: Path, tmp_path: Path) -> None:
    gemv = _with_config(awq_checkpoints / AWQ_FILES[0], tmp_path / "gemv", version="gemv")
    with pytest.raises(UnsupportedQuantization, match="AWQ version 'gemv'"):
        GptqAwqCheckpoint(gemv)
    three = _with_config(GPTQ / GPTQ_FILES[0], tmp_path / "three", bits=3)
    with pytest.raises(UnsupportedQuantization, match="3-bit"):
        GptqAwqCheckpoint(three)
    marlin = _with_config(GPTQ / GPTQ_FILES[0], tmp_path / "marlin", checkpoint_format="marlin")
    with pytest.raises(UnsupportedQuantization, match="checkpoint_format 'marlin'"):
        GptqAwqCheckpoint(marlin)
    other = _with_config(GPTQ / GPTQ_FILES[0], tmp_path / "bnb", quant_method="bitsandbytes")
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        resolve_weight_format("auto", 32, "auto", other)


def _truncated(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    return dst


def test_contradictions_and_damage_are_refused_by_name(awq_checkpoints: Path, tmp_path: Path) -> None:
    """A config that contradicts the tensors, or a damaged file: refused at load, naming
    the tensor and what does not fit, never served."""
    eight = _with_config(GPTQ / "llama-gptq-w4-g128", tmp_path / "eight", bits=8)
    with pytest.raises(UnsupportedQuantization, match=r"model.layers.0.*do not fit 8-bit codes"):
        list(GptqAwqCheckpoint(eight).tensors())
    group = _with_config(GPTQ / "llama-gptq-w4-g128", tmp_path / "group", group_size=32)
    with pytest.raises(UnsupportedQuantization, match=r"model.layers.0.*group_size 32"):
        list(GptqAwqCheckpoint(group).tensors())
    awq_group = _with_config(awq_checkpoints / AWQ_FILES[0], tmp_path / "awq-group", group_size=64)
    with pytest.raises(UnsupportedQuantization, match=r"model.layers.0.*group_size 64"):
        list(GptqAwqCheckpoint(awq_group).tensors())
    for src in (GPTQ / "llama-gptq-w4-g128", awq_checkpoints / AWQ_FILES[0]):
        damaged = _truncated(src, tmp_path / f"cut-{src.name}")
        with pytest.raises(UnsupportedQuantization, match="not a readable safetensors file"):
            list(GptqAwqCheckpoint(damaged).tensors())
