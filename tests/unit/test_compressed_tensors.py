"""compressed-tensors checkpoints made by llm-compressor itself (the ``ct_checkpoints``
fixture): every quantized tensor, repacked into the engine's layouts, dequantizes bit for bit
to what compressed-tensors' own decompression makes of it; the int8-per-token activations of
W8A8 are the library's; what cannot be served is refused with the tensor's name; and each
scheme has a KV identity of its own.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.models.quant.compressed import (
    CtCheckpoint,
    UnsupportedQuantization,
    quantization_config,
    unpack_int32,
)
from common.models.quant.formats import resolve_weight_format
from common.models.quant.fp8 import Fp8Weight
from common.models.quant.weights import Q4Weight, Q8Weight
from kernels.cpu import available
from kernels.cpu import quant as cpu_quant
from kernels.cpu.kquant import KQx16, affine_type, kq_available, kq_x16_matmul

SCHEMES = [
    "llama-w4a16", "llama-w4a16-asym", "llama-w4a16-g32-actorder", "llama-w4a16-channel",
    "llama-w8a16", "llama-w8a8", "llama-fp8", "llama-fp8-dynamic",
    "qwen2-w4a16", "qwen2-w8a8", "qwen2-fp8-dynamic",
    "qwen3-w4a16", "qwen3-w8a8", "qwen3-fp8-dynamic",
    "qwen3_moe-w4a16", "qwen3_moe-w8a8", "qwen3_moe-fp8-dynamic",
    "llama_bf16-w4a16", "llama_bf16-w8a16",
]  # fmt: skip

needs_kq = pytest.mark.skipif(
    not available() or not kq_available(),
    reason="no KQx16 kernels here (AVX2, or AVX-512 VNNI)",
)


def reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """Each quantized module's weight as compressed-tensors decompresses it, by module."""
    from compressed_tensors.compressors.base import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    config = quantization_config(path)
    assert config is not None
    groups = list(config["config_groups"].values())
    assert len(groups) == 1, "the test checkpoints have one scheme"
    group = groups[0]
    scheme = QuantizationScheme(
        targets=group["targets"], weights=group["weights"],
        input_activations=group["input_activations"],
    )  # fmt: skip
    compressor = BaseCompressor.load_from_registry(group.get("format") or config["format"])
    modules: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118
            module, _, suffix = name.rpartition(".")
            modules.setdefault(module, {})[suffix] = f.get_tensor(name)
    out = {}
    for module, parts in modules.items():
        if "weight_scale" not in parts:
            continue
        out[module] = compressor.decompress(parts, scheme)["weight"]
    return out


@pytest.mark.parametrize("name", SCHEMES)
def test_every_tensor_dequantizes_as_compressed_tensors_does(ct_checkpoints: Path, name: str) -> None:
    path = ct_checkpoints / name
    refs = reference_weights(path)
    seen = 0
    for tensor in CtCheckpoint(path).tensors():
        if isinstance(tensor.value, torch.Tensor):
            # Float tensors: norms, embeddings, the head, biases (of quantized layers too).
            assert tensor.name.endswith(".bias") or tensor.name.rpartition(".")[0] not in refs
            continue
        module = tensor.name.rpartition(".")[0]
        ref = refs[module]
        # Ours is float32 and exact where the library rounds to the scale's dtype.
        ours = tensor.value.dequantize().to(ref.dtype)
        assert torch.equal(ours, ref), (name, module, (ours.float() - ref.float()).abs().max())
        seen += 1
    # 7 projections x 2 layers; the MoE model: 4 attention + 4 experts x 3, x 2 layers.
    assert seen == len(refs) == (32 if name.startswith("qwen3_moe") else 14), (seen, len(refs))


@pytest.mark.parametrize(
    ("name", "layout"),
    [("llama-w4a16", "W4G128"), ("llama-w4a16-channel", "W4G256"), ("llama-w4a16-g32-actorder", "W4G32"),
     ("llama-w8a16", "W8G128"), ("llama-w8a8", "W8G256"), ("llama-fp8", "fp8"),
     ("llama_bf16-w4a16", "q4"), ("llama_bf16-w8a16", "q8")],
)  # fmt: skip
def test_layouts_and_activation_schemes(ct_checkpoints: Path, name: str, layout: str) -> None:
    """q_proj (K = 256) of each scheme: the packed type, and how x is quantized for it."""
    weights = {t.name: t.value for t in CtCheckpoint(ct_checkpoints / name).tensors()}
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    if layout == "fp8":
        assert isinstance(q, Fp8Weight) and q.activations == "tensor"
        assert q.input_scale is not None and q.scale.shape == (1, 1)
        return
    if layout in ("q4", "q8"):  # bfloat16 scales: exactly the Q4 / Q8 layouts
        assert isinstance(q, Q4Weight if layout == "q4" else Q8Weight), type(q)
        assert q.group_size == 128
        return
    assert isinstance(q, KQx16) and q.type_name == layout
    assert q.int8_tokens == (name == "llama-w8a8")
    assert (q.m is not None) == name.endswith("asym")


def test_asymmetric_zero_points_are_the_packed_ones(ct_checkpoints: Path) -> None:
    path = ct_checkpoints / "llama-w4a16-asym"
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        packed = f.get_tensor("model.layers.0.mlp.down_proj.weight_zero_point")
    zeros = unpack_int32(packed, 4, 256, dim=0).to(torch.int16) - 8  # [N, K/G] signed
    weights = {t.name: t.value for t in CtCheckpoint(path).tensors()}
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, KQx16) and down.m is not None
    from kernels.cpu.kquant import rows

    held = rows(down.m)[:, :: 128 // 32].to(torch.int16)  # one per group of 128
    assert torch.equal(held, zeros)
    assert zeros.abs().sum() > 0


def test_act_order_columns_are_permuted_and_restored() -> None:
    """A g_idx that scatters the groups (GPTQ's act order as older compressed-tensors wrote
    it): packed in sorted order, dequantized back in the checkpoint's, products exact."""
    torch.manual_seed(0)
    n, k, group = 32, 128, 32
    g_idx = torch.arange(k) // group
    g_idx = g_idx[torch.randperm(k)]
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scale = torch.rand(n, k // group) * 0.01 + 0.001
    from common.models.quant.compressed import _act_order

    perm = _act_order("t", g_idx, k, group)
    assert perm is not None
    w = KQx16.pack(affine_type(4, group), codes[:, perm], scale, torch.ones(n, k // 32), None,
                   None, 8, -1.0, perm)  # fmt: skip
    expected = (codes.float() - 8) * scale[:, g_idx]
    assert torch.equal(w.dequantize(), expected)
    if available() and cpu_quant.has_x16():
        x = torch.randn(3, k)
        ref = x.double() @ expected.double().t()
        out = kq_x16_matmul(x, w).double()
        assert (out - ref).abs().max() < 1e-3 * ref.abs().max()
    bad = torch.arange(k) % 5  # groups of other sizes
    with pytest.raises(UnsupportedQuantization, match="groups of other than 32"):
        _act_order("t", bad, k, group)


@needs_kq
def test_w8a8_activations_are_int8_per_token_as_the_library_makes_them() -> None:
    """The kernel's int8 codes per token are compressed-tensors' (scale max|x| / 127.5,
    round half to even): its output is the integer product of those codes, scaled."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    torch.manual_seed(1)
    n, k = 48, 256
    q = torch.randint(-127, 128, (n, k), dtype=torch.int16)
    scale = torch.rand(n, 1) * 0.01
    w = KQx16.pack(affine_type(8, k), (q + 128).to(torch.uint8), scale, torch.ones(n, k // 32),
                   None, None, 128, -1.0, None, True)  # fmt: skip
    x = torch.randn(5, k) * torch.tensor([0.1, 1.0, 10.0, 3.0, 0.5])[:, None]
    x[3, 7] = 40.0  # one large element: the others' codes shrink
    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    # [batch, tokens, hidden], as a model's layers see it (its token strategy keeps dims 0, 1)
    sx, zx = compute_dynamic_scales_and_zp(x[None], args, module=torch.nn.Module())
    assert sx.shape == (1, 5, 1)
    x_fq = fake_quantize(x[None], sx, zx, args)[0]
    ref = (x_fq.double() @ (q.double() * scale.double()).t())
    out = kq_x16_matmul(x, w).double()
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()
    # With int16 codes instead, the result is another (closer to float x) product.
    w16 = KQx16.pack(affine_type(8, k), (q + 128).to(torch.uint8), scale, torch.ones(n, k // 32),
                     None, None, 128, -1.0)  # fmt: skip
    assert (kq_x16_matmul(x, w16).double() - ref).abs().max() > 1e-3 * ref.abs().max()


def test_each_scheme_has_its_own_kv_identity(ct_checkpoints: Path) -> None:
    identities = {}
    for name in ("llama-w4a16", "llama-w4a16-asym", "llama-w8a16", "llama-w8a8", "llama-fp8"):
        fmt = resolve_weight_format("auto", 32, "auto", ct_checkpoints / name)
        assert fmt.name == "compressed-tensors", (name, fmt)
        identities[name] = fmt.identity
    assert len(set(identities.values())) == len(identities), identities
    assert None not in identities.values()
    none = resolve_weight_format("none", 32, "auto", ct_checkpoints / "llama-w4a16")
    assert none.identity is None  # dequantized floats: the float scheme's hashes
    with pytest.raises(ValueError, match="compressed-tensors quantization_config"):
        resolve_weight_format("compressed-tensors", 32, "auto", ct_checkpoints / "llama-float")


def _edited(src: Path, dst: Path, edit: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    for key, value in edit.items():
        section, _, field = key.partition(".")
        if field:
            group[section][field] = value
        else:
            config["quantization_config"][key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_what_cannot_be_served_is_refused_by_name(ct_checkpoints: Path, tmp_path: Path) -> None:
    src = ct_checkpoints / "llama-w4a16"
    cases = [
        ({"format": "marlin-24"}, "format 'marlin-24' is not served"),
        ({"weights.num_bits": 3}, "3-bit"),
        ({"input_activations": None}, None),  # (no input scheme is served: the control case)
    ]
    for i, (edit, message) in enumerate(cases):
        path = _edited(src, tmp_path / f"c{i}", {} if "input_activations" in edit else edit)
        if "format" in edit:  # the group's own format names it too
            config = json.loads((path / "config.json").read_text())
            config["quantization_config"]["config_groups"]["group_0"]["format"] = "marlin-24"
            (path / "config.json").write_text(json.dumps(config))
        tensors = CtCheckpoint(path).tensors()
        if message is None:
            assert sum(not isinstance(t.value, torch.Tensor) for t in tensors) == 14
            continue
        with pytest.raises(UnsupportedQuantization, match=message) as raised:
            list(tensors)
        assert "model.layers.0." in str(raised.value)  # the tensor's module, by name
    # Integer activations other than dynamic int8 per token.
    static = _edited(ct_checkpoints / "llama-w8a8", tmp_path / "static", {"input_activations.dynamic": False})
    with pytest.raises(UnsupportedQuantization, match="input activations"):
        list(CtCheckpoint(static).tensors())


def test_contradictions_and_damage_are_refused_by_name(ct_checkpoints: Path, tmp_path: Path) -> None:
    eight = _edited(ct_checkpoints / "llama-w4a16", tmp_path / "eight", {"weights.num_bits": 8})
    with pytest.raises(UnsupportedQuantization, match=r"model.layers.0.*8-bit codes.*num_bits"):
        list(CtCheckpoint(eight).tensors())
    group = _edited(ct_checkpoints / "llama-w4a16", tmp_path / "group", {"weights.group_size": 64})
    with pytest.raises(UnsupportedQuantization, match=r"model.layers.0.*group_size 64"):
        list(CtCheckpoint(group).tensors())
    cut = tmp_path / "cut"
    shutil.copytree(ct_checkpoints / "llama-w4a16", cut)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UnsupportedQuantization, match="not a readable safetensors file"):
        list(CtCheckpoint(cut).tensors())
