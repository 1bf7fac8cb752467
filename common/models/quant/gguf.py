"""GGUF checkpoints: tensors read as they are stored (Q4_0, Q4_1, Q8_0, F32/F16/BF16).

# N = output features (rows), K = input features, H = hidden size

A GGUF file's quantized tensors become ``Q4Weight`` / ``Q8Weight`` without passing through
float: a Q4_1 block (float16 d, float16 m, 16 bytes of nibbles) is exactly our Q4 sub-block
(``scale = d``, ``min = m``, the same nibble order), Q4_0 is ``min = -8 d``, and a Q8_0 block
(float16 d, 32 int8) is our Q8 at group size 32. tests/unit/test_gguf.py checks every tensor
of the shipped file against the ``gguf`` package's own dequantization, bit for bit.

llama.cpp's converter permutes the rows of Q and K for the ``llama`` architecture (to its
rotary layout); rows are whole quantized blocks, so the permutation transformers undoes on
float arrays is undone here on the packed rows.

Config and tokenizer come from the file's metadata through transformers (about 13 s here),
so ``prepare_checkpoint_dir`` writes them once into ``$PDSERVE_CACHE/gguf/`` beside a link to
the file; that directory then serves as the checkpoint directory everywhere.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from common.models.quant.kquants import KQUANT_TYPES, read_kq_x16
from common.models.quant.weights import Q4Weight, Q8Weight, QuantWeight
from kernels.cpu.kquant import KQx16

log = logging.getLogger(__name__)

SUFFIX = ".gguf"
# GGUF tensor types read as they are; anything else is refused with its name.
QUANTIZED_TYPES = ("Q4_0", "Q4_1", "Q8_0")
FLOAT_TYPES = ("F32", "F16", "BF16")

# GGUF tensor name -> Hugging Face name, for the llama family (llama, mistral, qwen2, qwen3).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_LAYER_PARTS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture-of-experts layers (qwen2moe, qwen3moe, and llama's Mixtral): the router, the
    # shared expert and its gate. The experts themselves are 3-D tensors (_EXPERT_PARTS).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# One tensor [E, N, K] holds a projection of every expert; it is read expert by expert, under
# the Hugging Face name of each expert's own weight.
_EXPERT_PARTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_IGNORED = ("rope_freqs.weight",)  # llama3 rope factors: computed from the config instead


class GgufError(ValueError):
    """A GGUF file this engine cannot serve as it is (tensor type, architecture, name)."""


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file a model path names: the path itself, or the one .gguf in a directory."""
    path = Path(model)
    if path.is_file() and path.suffix == SUFFIX:
        return path
    if path.is_dir():
        files = sorted(path.glob(f"*{SUFFIX}"))
        if len(files) > 1:
            raise GgufError(f"{path} holds several GGUF files ({', '.join(f.name for f in files)})")
        if not files:
            return None
        if not files[0].exists():
            raise GgufError(
                f"{files[0]} links to {files[0].readlink()}, which is gone (the environment "
                "that held it was removed); run `pdserve convert` or pass --model FILE.gguf"
            )
        return files[0]
    return None


def hf_name(name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for tensors the engine does not load."""
    if name in _IGNORED:
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER_NAME.fullmatch(name)
    if match and match.group(2) in _LAYER_PARTS:
        layer, part, param = match.groups()
        return f"model.layers.{layer}.{_LAYER_PARTS[part]}.{param}"
    if match and match.group(2) in _EXPERT_PARTS and match.group(3) == "weight":
        layer, part, _ = match.groups()
        return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_PARTS[part]}.weight"
    raise GgufError(
        f"GGUF tensor {name!r} has no counterpart here (the llama, mistral, qwen2, qwen3 and "
        "their mixture-of-experts tensors are served)"
    )


def _rotary_row_order(num_rows: int, num_heads: int) -> torch.Tensor:
    """Row indices that undo llama.cpp's Q/K permutation (transformers'
    ``_reverse_permute_weights``): within each head, rows (i, j) -> (j, i), j in {0, 1}."""
    half = num_rows // num_heads // 2
    return torch.arange(num_rows).view(num_heads, half, 2).transpose(1, 2).reshape(-1)


@dataclass
class GgufTensor:
    name: str  # the Hugging Face name
    type_name: str  # GGUF's tensor type, e.g. Q4_1
    value: QuantWeight | torch.Tensor  # packed weight, or a float tensor (float32)


class GgufCheckpoint:
    """One GGUF file, memory-mapped; ``tensors()`` yields each tensor once, permuted rows
    already undone, quantized ones packed, float ones as float32."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        self.architecture = self._text("general.architecture")
        self.file_type = self._int("general.file_type")
        self.num_heads = self._int(f"{self.architecture}.attention.head_count")
        self.num_kv_heads = self._int(f"{self.architecture}.attention.head_count_kv")

    def _text(self, key: str) -> str:
        field = self.reader.fields.get(key)
        if field is None:
            raise GgufError(f"{self.path.name}: metadata {key!r} is missing")
        return bytes(field.parts[field.data[0]]).decode()

    def _int(self, key: str) -> int:
        field = self.reader.fields.get(key)
        if field is None:
            return 0
        return int(field.parts[field.data[0]][0])

    @property
    def type_names(self) -> list[str]:
        """The tensor types in the file, most common first."""
        counts: dict[str, int] = {}
        for t in self.reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return sorted(counts, key=lambda k: -counts[k])

    def tensors(self) -> Iterator[GgufTensor]:
        for t in self.reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            type_name = t.tensor_type.name
            shape = [int(n) for n in reversed(t.shape.tolist())]
            if "{}" in name:  # the experts' 3-D tensor: one 2-D weight per expert
                if len(shape) != 3:
                    raise GgufError(f"{self.path.name}: tensor {t.name!r} has shape {shape}; "
                                    "expert tensors are [experts, rows, columns]")  # fmt: skip
                data = np.asarray(t.data).reshape(shape[0], shape[1], -1)
                for e in range(shape[0]):
                    yield self._tensor(t.name, name.format(e), type_name, data[e], shape[1:])
                continue
            if len(shape) > 2:
                raise GgufError(f"{self.path.name}: tensor {t.name!r} has shape {shape}; "
                                "only experts' tensors have three dimensions")  # fmt: skip
            yield self._tensor(t.name, name, type_name, np.asarray(t.data), shape)

    def _tensor(
        self, gguf_name: str, name: str, type_name: str, data: np.ndarray, shape: list[int]
    ) -> GgufTensor:
        """One tensor (or one expert's slice of a 3-D one) as the engine holds it."""
        if type_name in KQUANT_TYPES:
            return GgufTensor(
                name, type_name, self._read_kquant(gguf_name, data, shape, name, type_name)
            )
        value = self._read(gguf_name, data, shape, type_name)
        if name.endswith("shared_expert_gate.weight") and isinstance(value, torch.Tensor):
            value = value.reshape(1, -1)  # [H] in the file, [1, H] in the model
        order = self._row_order(name, value.shape[0])
        if order is not None:
            value = value[order]
        return GgufTensor(name, type_name, value)

    def _read_kquant(
        self, gguf_name: str, data: np.ndarray, shape: list[int], name: str, type_name: str
    ) -> KQx16:
        """A K-quant (or Q5_0 / Q5_1) tensor packed for the KQx16 kernel, rows permuted
        back first (packing interleaves rows in sixteens)."""
        from kernels.cpu.kquant import kq_available

        where = f"{self.path.name}: tensor {gguf_name!r} is {type_name}"
        if len(shape) != 2:
            raise GgufError(f"{where} of {len(shape)} dimensions; only 2-D ones are served")
        rows, k = shape
        if rows % 16 or not kq_available():
            raise GgufError(
                f"{where}; its kernel needs rows in sixteens ({rows} rows) and AVX2 or "
                "AVX-512 VNNI (--quantization none reads it as float)"
            )
        raw = data.reshape(rows, -1)
        order = self._row_order(name, rows)
        if order is not None:
            raw = raw[order.numpy()]
        try:
            return read_kq_x16(type_name, raw, rows, k)
        except ValueError as exc:
            raise GgufError(f"{where}: {exc}") from exc

    def _row_order(self, name: str, num_rows: int) -> torch.Tensor | None:
        if self.architecture != "llama":
            return None
        if ".self_attn.q_proj." in name:
            return _rotary_row_order(num_rows, self.num_heads)
        if ".self_attn.k_proj." in name:
            return _rotary_row_order(num_rows, self.num_kv_heads or self.num_heads)
        return None

    def _read(
        self, gguf_name: str, data: np.ndarray, shape: list[int], type_name: str
    ) -> QuantWeight | torch.Tensor:
        if type_name in FLOAT_TYPES:
            if type_name == "BF16":
                words = torch.from_numpy(data.view(np.int16).copy())
                return words.view(torch.bfloat16).float().reshape(shape)
            return torch.from_numpy(data.astype(np.float32)).reshape(shape)
        if type_name not in QUANTIZED_TYPES:
            raise GgufError(
                f"{self.path.name}: tensor {gguf_name!r} is {type_name}; tensors are "
                f"served as stored in {', '.join(QUANTIZED_TYPES + tuple(KQUANT_TYPES) + FLOAT_TYPES)} only "
                "(convert the file with llama-quantize, or pass --quantization none)"
            )
        rows, k = shape[0], shape[-1]
        blocks = torch.from_numpy(data.reshape(rows, k // 32, -1).copy())  # [N, K/32, bytes]
        if type_name == "Q8_0":
            scales = blocks[..., :2].contiguous().view(torch.float16).view(rows, k // 32)
            codes = blocks[..., 2:].contiguous().view(torch.int8).view(rows, k)
            return Q8Weight(codes, scales, 32)
        d = blocks[..., :2].contiguous().view(torch.float16).view(rows, k // 32)
        if type_name == "Q4_1":
            m = blocks[..., 2:4].contiguous().view(torch.float16).view(rows, k // 32)
            qs = blocks[..., 4:]
        else:  # Q4_0: w = d * (q - 8) = q * d + (-8 d); -8 d is exact in float16
            m32 = d.float() * -8
            if bool((m32.abs() > 65504).any()):
                raise GgufError(
                    f"{self.path.name}: tensor {gguf_name!r} has Q4_0 scales above 8188, "
                    "whose -8 * scale does not fit float16 (--quantization none reads it)"
                )
            m = m32.to(torch.float16)
            qs = blocks[..., 2:]
        return Q4Weight(qs.contiguous().view(rows, k // 2), d.contiguous(), m.contiguous(), 32)


@functools.lru_cache(maxsize=4)
def _open_cached(path: Path, size: int, mtime_ns: int) -> GgufCheckpoint:
    return GgufCheckpoint(path)


def open_checkpoint(path: str | Path) -> GgufCheckpoint:
    """The file's reader, parsed once per process (gguf's reader takes seconds on a file
    with a large vocabulary: it builds every metadata array)."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _open_cached(resolved, stat.st_size, stat.st_mtime_ns)


def release_checkpoints() -> None:
    """Drops the cached readers (and with them the files' memory mappings)."""
    _open_cached.cache_clear()
