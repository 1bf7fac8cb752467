"""GPTQ and AWQ checkpoints as their tools write them (``quantization_config`` with
``quant_method`` gptq or awq in config.json), repacked into the engine's layouts
(common/models/quant/integer.py says which).

# N = output features, K = input features, G = group size (K for -1), P = 32 // bits

Both store, per quantized Linear, ``qweight`` and ``qzeros`` as int32 words of P codes (code
i at bits ``bits * i``) and ``scales`` float16 [K/G, N]; a weight is
``(q - z) * scale`` of its group.

- GPTQ (gptqmodel, AutoGPTQ; 2, 4 or 8 bits, symmetric or not): ``qweight`` [K/P, N] packs
  along K, ``qzeros`` [K/G, N/P] along N, ``g_idx`` [K] names each column's group
  (``desc_act`` scatters them: the columns are permuted so groups are contiguous and the
  kernel reads x in that order). ``checkpoint_format: gptq`` (v1) stores each zero point
  minus one, subtracted from the whole word (gptqmodel's writer): the word plus 0x11111111
  (4 bits; 0x01010101 for 8) restores it exactly, as gptqmodel's reader does.
- AWQ (AutoAWQ's GEMM version, 4 bits, zero points): ``qweight`` [K, N/8] and ``qzeros``
  [K/G, N/8] both pack along N, in the order 0, 2, 4, 6, 1, 3, 5, 7 within a word.

Embeddings, norms and the head stay float (both tools leave them so). A format, bit width or
layout not listed is refused at load with the tensor's name. tests/unit/test_gptq_awq.py
checks every tensor against the tools' own dequantization.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.models.quant.compressed import UnsupportedQuantization, quantization_config
from common.models.quant.integer import integer_weight
from common.models.quant.weights import QuantWeight

METHODS = ("gptq", "awq")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # column of each nibble within an AWQ word
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def gptq_awq_method(model_dir: str | Path) -> str | None:
    """``gptq`` or ``awq`` where config.json says so, else None."""
    quant = quantization_config(model_dir)
    if quant is None:
        return None
    method = str(quant.get("quant_method", "")).lower()
    return method if method in METHODS else None


@dataclass(frozen=True)
class GptqAwqConfig:
    method: str  # gptq | awq
    bits: int
    group_size: int  # -1: one group per row
    sym: bool
    desc_act: bool
    v1_zeros: bool  # gptq v1: zero points stored minus one
    version: str  # awq: gemm

    @classmethod
    def of(cls, quant: dict[str, Any]) -> GptqAwqConfig:
        method = str(quant.get("quant_method", "")).lower()
        if method == "awq":
            return cls(
                "awq", int(quant.get("bits", quant.get("w_bit", 4))),
                int(quant.get("group_size", quant.get("q_group_size", 128))),
                not bool(quant.get("zero_point", True)), False, False,
                str(quant.get("version", "gemm")).lower(),
            )  # fmt: skip
        fmt = str(quant.get("checkpoint_format", quant.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise UnsupportedQuantization(f"GPTQ checkpoint_format {fmt!r} is not served")
        return cls(
            "gptq", int(quant.get("bits", 4)), int(quant.get("group_size", 128)),
            bool(quant.get("sym", True)), bool(quant.get("desc_act", False)), fmt == "gptq", "",
        )  # fmt: skip

    def describe(self) -> str:
        group = "channel" if self.group_size <= 0 else f"g{self.group_size}"
        text = f"{self.method}-w{self.bits}-{group}" + ("" if self.sym else "-asym")
        return text + ("-actorder" if self.desc_act else "")


@dataclass
class GptqTensor:
    name: str  # the Hugging Face name
    value: QuantWeight | torch.Tensor


class GptqAwqCheckpoint:
    """A GPTQ or AWQ checkpoint directory: its tensors by Hugging Face name, each quantized
    Linear's (``<module>.weight``) repacked."""

    def __init__(self, model_dir: str | Path) -> None:
        self.path = Path(model_dir)
        quant = quantization_config(self.path)
        if quant is None or gptq_awq_method(self.path) is None:
            raise UnsupportedQuantization(f"{self.path} is not a GPTQ or AWQ checkpoint")
        self.config = GptqAwqConfig.of(quant)
        if self.config.method == "awq" and self.config.version != "gemm":
            raise UnsupportedQuantization(
                f"{self.path.name}: AWQ version {self.config.version!r} is not served (gemm is)"
            )
        if self.config.bits not in (4, 8) or (self.config.method == "awq" and self.config.bits != 4):
            raise UnsupportedQuantization(
                f"{self.path.name}: {self.config.method} with {self.config.bits}-bit codes is not "
                "served (4 and 8 bits for GPTQ, 4 for AWQ)"
            )
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{self.path} holds no *.safetensors weights")

    def tensors(self) -> Iterator[GptqTensor]:
        for path in self.files:
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors' own errors: a truncated or corrupt file
                raise UnsupportedQuantization(f"{path}: not a readable safetensors file ({e})") from e
            with handle as f:
                names = list(f.keys())
                modules: dict[str, dict[str, str]] = {}
                for name in names:
                    module, _, suffix = name.rpartition(".")
                    if suffix in _PARTS:
                        modules.setdefault(module, {})[suffix] = name
                for name in names:
                    module, _, suffix = name.rpartition(".")
                    if suffix in _PARTS:
                        if suffix == "qweight":
                            parts = {s: f.get_tensor(n) for s, n in modules[module].items()}
                            yield GptqTensor(f"{module}.weight", self._weight(module, parts))
                        continue
                    yield GptqTensor(name, f.get_tensor(name))  # float ones in their own dtype

    def _weight(self, module: str, parts: dict[str, torch.Tensor]) -> QuantWeight:
        what = f"{self.path.name}: {module}"
        for needed in ("qweight", "qzeros", "scales"):
            if needed not in parts:
                raise UnsupportedQuantization(f"{what} lacks {needed}")
        cfg = self.config
        scales = parts["scales"]  # [K/G, N]
        qweight, qzeros = parts["qweight"], parts["qzeros"]
        per = 32 // cfg.bits
        if scales.dim() != 2 or qweight.dim() != 2 or qzeros.dim() != 2:
            raise UnsupportedQuantization(f"{what}: qweight, qzeros and scales must be 2-D")
        groups, n = scales.shape
        if cfg.method == "awq":
            k, fits = qweight.shape[0], qweight.shape[1] * 8 == n and qzeros.shape == (groups, n // 8)
        else:
            k = qweight.shape[0] * per
            fits = qweight.shape[1] == n and qzeros.shape == (groups, -(-n // per))
        if not fits:
            raise UnsupportedQuantization(
                f"{what}: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)} and scales "
                f"{tuple(scales.shape)} do not fit {cfg.bits}-bit codes: the config's bits or the "
                "tensors are wrong"
            )
        if cfg.group_size > 0 and groups * cfg.group_size != k:
            raise UnsupportedQuantization(
                f"{what}: {groups} groups of the config's group_size {cfg.group_size} do not "
                f"cover {k} input features"
            )
        g_idx = parts.get("g_idx")
        if g_idx is not None and g_idx.numel() != k:
            raise UnsupportedQuantization(f"{what}: g_idx has {g_idx.numel()} entries for {k} columns")
        if cfg.method == "awq":
            codes = awq_unpack(parts["qweight"]).t()  # [N, K]
            zeros = awq_unpack(parts["qzeros"]).t()  # [N, K/G]
        else:
            codes = unpack_words(parts["qweight"], cfg.bits, dim=0).t()  # [N, K]
            qzeros = parts["qzeros"]
            if cfg.v1_zeros:
                step = sum(1 << (cfg.bits * i) for i in range(32 // cfg.bits))
                qzeros = (qzeros.to(torch.int64) + step).remainder(1 << 32)
            zeros = unpack_words(qzeros, cfg.bits, dim=1).t()[: scales.shape[1]]  # [N, K/G]
        if k % groups or (k // groups) % 32:
            raise UnsupportedQuantization(
                f"{what}: {k} input features in {groups} groups (the kernels need groups of a "
                "multiple of 32)"
            )
        if n % 16:
            raise UnsupportedQuantization(f"{what}: {n} output features are not a multiple of 16")
        group = k // groups
        perm = None
        g_idx = parts.get("g_idx")
        if g_idx is not None:
            g_idx = g_idx.to(torch.int64)
            natural = torch.arange(k) // group
            if not torch.equal(g_idx, natural):
                perm = torch.argsort(g_idx, stable=True)
                if not torch.equal(g_idx[perm], natural):
                    raise UnsupportedQuantization(f"{what}: g_idx has groups of other than {group}")
                codes = codes[:, perm]
        signed = zeros.to(torch.int16) - (1 << (cfg.bits - 1))  # relative to the middle code
        return integer_weight(cfg.bits, group, codes, scales.t(), signed, perm)


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 codes of int32 ``words`` holding 32 // bits each along ``dim`` (code i at bits
    ``bits * i``)."""
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int64) * bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    if dim == 0:  # [K/P, N] -> [K, N]
        fields = (w[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)
        return fields.reshape(-1, words.shape[1]).to(torch.uint8)
    fields = (w[..., None] >> shifts) & ((1 << bits) - 1)  # [R, C/P, P] -> [R, C]
    return fields.reshape(words.shape[0], -1).to(torch.uint8)


def awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """uint8 [R, 8 C] of AWQ int32 words [R, C] (4-bit codes in AWQ's order)."""
    fields = unpack_words(words, 4, dim=1).view(words.shape[0], -1, 8)
    out = torch.empty_like(fields)
    out[..., list(AWQ_ORDER)] = fields
    return out.view(words.shape[0], -1)
