"""GGUF tensors read as packed weights (common/models/quant/gguf.py), bit for bit.

# N = output features (rows), K = input features, d / m = a block's float16 scale / min

What is checked:
- every tensor of the shipped SmolLM2 file: our packed value, dequantized, equals the ``gguf``
  package's own dequantization of the raw tensor (with the Q/K rows reverse-permuted by
  transformers' code), and equals the float32 checkpoint transformers converted from the file;
- the Q4_1 -> torch int4pack mapping (scale d, zero m + 8d): exact for every block of the file;
- Q4_0 / Q8_0 / F16 / BF16 tensors of a tiny file written with ``gguf.GGUFWriter``;
- tensor types and names the engine cannot serve raise ``GgufError`` naming them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from common.models.quant.gguf import GgufCheckpoint, GgufError, GgufTensor, hf_name
from common.models.quant.weights import Q4Weight, Q8Weight
from kernels.cpu.quant import pack_q4_codes, unpack_q4_codes


def _float(tensor: GgufTensor) -> torch.Tensor:
    value = tensor.value
    return value if isinstance(value, torch.Tensor) else value.dequantize()


def _reverse_permuted(array: np.ndarray, gguf_name: str, heads: int, kv_heads: int) -> np.ndarray:
    """transformers' own undoing of llama.cpp's Q/K row permutation (the GGUF loader's)."""
    processor = LlamaTensorProcessor(
        config={"num_attention_heads": heads, "num_key_value_heads": kv_heads}
    )
    return np.array(processor.process(array, gguf_name).weights, copy=True, order="C")


# -- the shipped file -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped() -> GgufCheckpoint:
    from common.models.default_model import gguf_path

    return GgufCheckpoint(gguf_path())


@pytest.fixture(scope="module")
def shipped_tensors(shipped: GgufCheckpoint) -> list[GgufTensor]:
    return list(shipped.tensors())


@pytest.mark.slow
def test_shipped_file_is_what_the_engine_expects(
    shipped: GgufCheckpoint, shipped_tensors: list[GgufTensor]
) -> None:
    assert (shipped.architecture, shipped.num_heads, shipped.num_kv_heads) == ("llama", 9, 3)
    assert shipped.type_names == ["Q4_1", "F32", "Q8_0"]
    kinds: dict[str, int] = {}
    for t in shipped_tensors:
        kinds[t.type_name] = kinds.get(t.type_name, 0) + 1
    assert kinds == {"Q4_1": 210, "F32": 61, "Q8_0": 1}
    embed = next(t for t in shipped_tensors if t.name == "model.embed_tokens.weight")
    assert isinstance(embed.value, Q8Weight) and embed.value.shape == (49152, 576)
    assert embed.value.group_size == 32
    assert not any(t.name == "lm_head.weight" for t in shipped_tensors)  # tied embeddings
    for t in shipped_tensors:
        if t.type_name == "Q4_1":
            assert isinstance(t.value, Q4Weight) and t.value.group_size == 32, t.name
        elif t.type_name == "F32":
            assert isinstance(t.value, torch.Tensor) and t.value.dtype == torch.float32


@pytest.mark.slow
def test_every_shipped_tensor_equals_gguf_dequantization(
    shipped: GgufCheckpoint, shipped_tensors: list[GgufTensor]
) -> None:
    raw = {hf_name(t.name): t for t in shipped.reader.tensors}
    assert len(raw) == len(shipped_tensors) == 272
    for tensor in shipped_tensors:
        source = raw[tensor.name]
        expected = quants.dequantize(np.asarray(source.data), source.tensor_type)
        expected = _reverse_permuted(expected, source.name, shipped.num_heads, shipped.num_kv_heads)
        ours = _float(tensor)
        assert ours.dtype == torch.float32
        assert torch.equal(ours, torch.from_numpy(expected).view(ours.shape)), tensor.name


def test_rotary_row_order_interleaves_each_heads_halves() -> None:
    """For Q (9 heads) and K (3 kv heads) of head dim 64: within a head, the file's rows
    (2i, 2i + 1) become our rows (i, 32 + i)."""
    from common.models.quant.gguf import _rotary_row_order

    assert _rotary_row_order(576, 9)[:4].tolist() == [0, 2, 4, 6]
    assert _rotary_row_order(576, 9)[32:35].tolist() == [1, 3, 5]
    assert _rotary_row_order(576, 9)[64:66].tolist() == [64, 66]
    assert sorted(_rotary_row_order(192, 3).tolist()) == list(range(192))


@pytest.mark.slow
def test_every_shipped_tensor_equals_the_converted_checkpoint(
    shipped_tensors: list[GgufTensor], smollm_dir: Path
) -> None:
    """The float32 safetensors transformers wrote from the same file (538 MB)."""
    from safetensors import safe_open

    with safe_open(str(smollm_dir / "model.safetensors"), framework="pt") as converted:
        names = set(converted.keys())
        assert names == {t.name for t in shipped_tensors}
        for tensor in shipped_tensors:
            assert torch.equal(_float(tensor), converted.get_tensor(tensor.name)), tensor.name


# -- Q4_1 as torch's int4pack (scale, zero) -----------------------------------------------------


@pytest.mark.slow
def test_q4_1_blocks_map_exactly_onto_scale_and_zero(shipped_tensors: list[GgufTensor]) -> None:
    """torch's int4pack computes ``(q - 8) * scale + zero``; with scale = d, zero = m + 8d:

    - in float64 that is exactly q d + m for every block of the file (d, m float16, q 4 bits:
      every term and partial sum fits in 53 bits), so rounded to float32 it is gguf's
      float32 ``d * q + m`` (whose product q d is itself exact in float32);
    - m + 8d is exact in float32 too, for every one of the file's 3,317,760 blocks, so a
      float32 (scale, zero) table loses nothing."""
    num_blocks = 0
    for tensor in shipped_tensors:
        if tensor.type_name != "Q4_1":
            continue
        w = tensor.value
        assert isinstance(w, Q4Weight)
        d, m = w.scales.double(), w.mins.double()
        zero64 = m + 8 * d
        codes = unpack_q4_codes(w.qweight).double()
        scale_k, zero_k = d.repeat_interleave(32, dim=1), zero64.repeat_interleave(32, dim=1)
        assert torch.equal(((codes - 8) * scale_k + zero_k).float(), w.dequantize()), tensor.name
        zero32 = w.mins.float() + 8 * w.scales.float()
        assert torch.equal(zero32.double(), zero64), tensor.name
        num_blocks += d.numel()
    assert num_blocks == 3_317_760


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    spacing = torch.nextafter(expected.abs(), torch.tensor(float("inf"))) - expected.abs()
    return (actual - expected).abs() / spacing


@pytest.mark.slow
def test_torch_int4pack_float32_reproduces_the_weights(shipped_tensors: list[GgufTensor]) -> None:
    """``_weight_int4pack_mm_for_cpu`` with float32 x = I and float32 (d, m + 8d): x @ W.T
    is W.T, within 1 ulp of the dequantized weights (measured: exact, torch 2.13). Layer 0's
    seven projections (every shape in the file) and Q of the last layer."""
    chosen = [t for t in shipped_tensors if t.name.startswith("model.layers.0.")]
    chosen += [t for t in shipped_tensors if t.name == "model.layers.29.self_attn.q_proj.weight"]
    chosen = [t for t in chosen if t.type_name == "Q4_1"]
    assert len(chosen) == 8
    for tensor in chosen:
        w = tensor.value
        assert isinstance(w, Q4Weight)
        n, k = w.shape
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            unpack_q4_codes(w.qweight).to(torch.int32), 2
        )
        zeros = w.mins.float() + 8 * w.scales.float()
        scale_zeros = torch.stack([w.scales.float().t(), zeros.t()], dim=-1).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(torch.eye(k), packed, 32, scale_zeros)
        assert out.shape == (k, n) and out.dtype == torch.float32
        worst = _ulps(out.t(), w.dequantize()).max().item()
        assert worst <= 1.0, f"{tensor.name}: {worst} ulp"


# -- a tiny file written here -------------------------------------------------------------------

HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 4, 2, 16, 64


def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py ``LlamaModel.permute`` (Hugging Face rows -> GGUF)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    shape = weights.shape
    return (
        weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:])
        .swapaxes(1, 2)
        .reshape(shape)
    )


def _write_tiny_gguf(
    path: Path, hf_tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]], arch: str
) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_embedding_length(HIDDEN)
    writer.add_file_type(2)  # MOSTLY_Q4_0
    for name, (array, qtype) in hf_tensors.items():
        stored = array
        if arch == "llama" and ".attn_q." in name:
            stored = _llama_cpp_permute(array, HEADS, HEADS)
        elif arch == "llama" and ".attn_k." in name:
            stored = _llama_cpp_permute(array, HEADS, KV_HEADS)
        data = quants.quantize(stored, qtype)
        raw = None if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) else qtype
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tiny_tensors(seed: int = 0) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    q = GGMLQuantizationType
    return {
        "token_embd.weight": (normal(96, HIDDEN), q.Q8_0),
        "blk.0.attn_norm.weight": (normal(HIDDEN), q.F32),
        "blk.0.ffn_norm.weight": (normal(HIDDEN), q.F16),
        "output_norm.weight": (normal(HIDDEN), q.BF16),
        "blk.0.attn_q.weight": (normal(HEADS * HEAD_DIM, HIDDEN), q.Q4_0),
        "blk.0.attn_k.weight": (normal(KV_HEADS * HEAD_DIM, HIDDEN), q.Q8_0),
        "blk.0.attn_v.weight": (normal(KV_HEADS * HEAD_DIM, HIDDEN), q.Q4_1),
        "blk.0.attn_output.weight": (normal(HIDDEN, HEADS * HEAD_DIM), q.Q4_0),
        "blk.0.ffn_gate.weight": (normal(128, HIDDEN), q.Q4_1),
        "blk.0.ffn_up.weight": (normal(128, HIDDEN), q.Q8_0),
        "blk.0.ffn_down.weight": (normal(HIDDEN, 128), q.Q4_0),
        "output.weight": (normal(96, HIDDEN), q.Q8_0),
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_file_tensors_equal_gguf_blocks_of_the_hf_rows(tmp_path: Path, arch: str) -> None:
    """Blocks are along K, so quantizing the Hugging Face rows and then permuting them is
    quantizing the permuted rows: what we read back for every tensor, Q and K included,
    is gguf's quantization of the Hugging Face tensor, codes and scales bit for bit. qwen2
    files keep Hugging Face's row order (llama.cpp permutes for llama only)."""
    tensors = _tiny_tensors()
    checkpoint = GgufCheckpoint(_write_tiny_gguf(tmp_path / "tiny.gguf", tensors, arch))
    assert (checkpoint.architecture, checkpoint.num_heads, checkpoint.num_kv_heads) == (
        arch, HEADS, KV_HEADS,
    )  # fmt: skip
    read = {t.name: t for t in checkpoint.tensors()}
    assert set(read) == {hf_name(name) for name in tensors}
    for name, (array, qtype) in tensors.items():
        tensor = read[str(hf_name(name))]
        assert tensor.type_name == qtype.name
        blocks = quants.quantize(array, qtype)
        expected = torch.from_numpy(quants.dequantize(blocks, qtype).astype(np.float32))
        assert torch.equal(_float(tensor), expected.view(array.shape)), name
        value = tensor.value
        rows = array.shape[0]
        if qtype == GGMLQuantizationType.Q8_0:
            assert isinstance(value, Q8Weight) and value.group_size == 32
            raw = torch.from_numpy(blocks.reshape(rows, -1, 34))
            assert torch.equal(value.scales.view(torch.uint8).view(rows, -1, 2), raw[..., :2])
            assert torch.equal(value.qweight.view(torch.uint8).view(rows, -1, 32), raw[..., 2:])
        elif qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1):
            assert isinstance(value, Q4Weight) and value.group_size == 32
            width = 18 if qtype == GGMLQuantizationType.Q4_0 else 20
            raw = torch.from_numpy(blocks.reshape(rows, -1, width))
            assert torch.equal(value.scales.view(torch.uint8).view(rows, -1, 2), raw[..., :2])
            assert torch.equal(value.qweight.view(rows, -1, 16), raw[..., width - 16 :])
            if qtype == GGMLQuantizationType.Q4_0:  # w = d (q - 8): min = -8 d, exact
                assert torch.equal(value.mins.float(), -8 * value.scales.float())
            else:
                assert torch.equal(value.mins.view(torch.uint8).view(rows, -1, 2), raw[..., 2:4])
        else:
            assert isinstance(value, torch.Tensor) and value.dtype == torch.float32


def test_q4_0_nibbles_are_in_our_code_order(tmp_path: Path) -> None:
    """One block with known codes: byte j holds element j (low) and 16 + j (high), so the
    packed bytes are ``pack_q4_codes`` of the element-order codes."""
    d = 0.25
    codes = np.array([(3 * i) % 16 for i in range(32)], dtype=np.float32)
    row = ((codes - 8) * d).reshape(1, 32)
    row = np.tile(row, (HEADS * HEAD_DIM, 2))  # [64, 64]: two blocks per row
    row[:, 0] = -8 * d  # the block's largest |w| sets d = max / -8 = 0.25 exactly
    tensors = {"blk.0.attn_output.weight": (row, GGMLQuantizationType.Q4_0)}
    checkpoint = GgufCheckpoint(_write_tiny_gguf(tmp_path / "order.gguf", tensors, "llama"))
    (tensor,) = checkpoint.tensors()
    assert isinstance(tensor.value, Q4Weight)
    expected_codes = torch.from_numpy(np.rint(row / d + 8).astype(np.uint8))
    assert torch.equal(unpack_q4_codes(tensor.value.qweight), expected_codes)
    assert torch.equal(tensor.value.qweight, pack_q4_codes(expected_codes))
    assert torch.equal(tensor.value.scales.float(), torch.full((64, 2), d))
    assert torch.equal(tensor.value.dequantize(), torch.from_numpy(row))


def _one_tensor_file(path: Path, qtype: GGMLQuantizationType, blocks: np.ndarray) -> GgufCheckpoint:
    writer = GGUFWriter(str(path), "llama")
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_tensor("blk.0.attn_q.weight", blocks, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GgufCheckpoint(path)


def test_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    """An i-quant (IQ4_NL: 18-byte blocks of 32) is refused when read, with its name and
    the types that are served."""
    blocks = np.random.default_rng(0).integers(0, 255, (16, 18 * 8), dtype=np.uint8)
    checkpoint = _one_tensor_file(tmp_path / "iq4.gguf", GGMLQuantizationType.IQ4_NL, blocks)
    assert checkpoint.type_names == ["IQ4_NL"]
    with pytest.raises(
        GgufError, match=r"'blk\.0\.attn_q\.weight' is IQ4_NL.*Q4_0, Q4_1, Q8_0.*Q4_K"
    ):
        list(checkpoint.tensors())


def test_a_k_quant_the_kernel_cannot_take_is_named(tmp_path: Path) -> None:
    """A K-quant tensor of 8 rows (the KQx16 kernel takes rows in sixteens) is refused with
    its name and why."""
    blocks = np.random.default_rng(0).integers(0, 255, (8, 144), dtype=np.uint8)
    checkpoint = _one_tensor_file(tmp_path / "q4k.gguf", GGMLQuantizationType.Q4_K, blocks)
    with pytest.raises(GgufError, match=r"'blk\.0\.attn_q\.weight' is Q4_K.*rows in sixteens \(8"):
        list(checkpoint.tensors())


def test_unknown_tensor_names_are_refused() -> None:
    with pytest.raises(GgufError, match=r"blk\.0\.ssm_conv1d\.weight.*no counterpart"):
        hf_name("blk.0.ssm_conv1d.weight")
    assert hf_name("blk.2.ffn_up_exps.weight") == "model.layers.2.mlp.experts.{}.up_proj.weight"
    assert hf_name("blk.0.ffn_gate_inp.weight") == "model.layers.0.mlp.gate.weight"
    assert (
        hf_name("blk.1.ffn_down_shexp.weight")
        == "model.layers.1.mlp.shared_expert.down_proj.weight"
    )
    assert hf_name("rope_freqs.weight") is None
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_name("output.weight") == "lm_head.weight"


def test_a_dangling_link_to_the_file_says_how_to_mend_it(tmp_path: Path) -> None:
    """A checkpoint directory links to its GGUF; when the environment that held the file is
    removed, the engine names the link and the command that rebuilds it (not an OSError)."""
    from common.models.quant.gguf import find_gguf

    gone = tmp_path / "removed-venv" / "model.gguf"
    (tmp_path / "model.gguf").symlink_to(gone)
    with pytest.raises(GgufError, match=r"model\.gguf links to .*removed-venv.*pdserve convert"):
        find_gguf(tmp_path)
    gone.parent.mkdir()
    gone.write_bytes(b"")
    assert find_gguf(tmp_path) == tmp_path / "model.gguf"
