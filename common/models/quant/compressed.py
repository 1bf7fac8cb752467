"""compressed-tensors checkpoints: what llm-compressor writes (and vLLM serves) for W4A16,
W8A8 and FP8, read as stored and repacked into the engine's layouts.

# N = output features, K = input features, G = quantization group along K

``config.json``'s ``quantization_config`` (``quant_method: compressed-tensors``) names a
format and one or more schemes, each for the Linear layers its ``targets`` select (a class
name, or ``re:`` and a pattern on the module's name), less those in ``ignore``:

- ``pack-quantized``: integer codes of 4 or 8 bits packed 32 // bits to an int32 along K
  (element i at bits ``bits * i``), stored with an offset of ``2^(bits-1)`` (so the stored
  field is the unsigned code u), ``weight_scale`` [N, K/G] (group) or [N, 1] (channel),
  an asymmetric weight's ``weight_zero_point`` packed the same way along N, and with
  ``actorder: group`` the column groups ``weight_g_idx`` [K]. A weight is
  ``(u - 2^(bits-1) - zero_point) * scale``: the Q4 / Q8 layouts where that is exact, else
  the KQx16 layout's integer-code types (common/models/quant/integer.py).
- ``int-quantized`` / ``naive-quantized``: int8 ``weight`` [N, K] and a scale per channel
  (or group): the same layout at 8 bits. With dynamic per-token int8 activations (W8A8),
  the kernel quantizes x to int8 per token as compressed-tensors does and multiplies codes
  by codes (``KQx16.int8_tokens``).
- ``float-quantized``: FP8 E4M3 ``weight`` [N, K], a scale per tensor or channel, FP8
  activations per token (dynamic) or per tensor (``input_scale``): ``Fp8Weight``.

Every other format, scheme or tensor is refused at load with the tensor's name and what it
holds. ``dequantize`` of each packed weight gives what compressed-tensors' own
decompression gives, bit for bit, once rounded to the scale's dtype (its arithmetic rounds
there; ours stays in float32): tests/unit/test_compressed_tensors.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from common.models.quant.fp8 import Fp8Weight
from common.models.quant.integer import integer_weight
from common.models.quant.weights import QuantWeight

QUANT_METHOD = "compressed-tensors"
PACKED_FORMATS = ("pack-quantized",)
INT_FORMATS = ("int-quantized", "naive-quantized")
FLOAT_FORMATS = ("float-quantized",)
_SUFFIXES = (
    "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
    "input_scale", "input_zero_point", "weight_global_scale", "input_global_scale",
)  # fmt: skip


class UnsupportedQuantization(ValueError):
    """A checkpoint's quantization the engine cannot run (the message says which tensor)."""


def quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    """config.json's ``quantization_config``, or None."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    quant = config.get("quantization_config")
    return quant if isinstance(quant, dict) else None


def is_compressed_tensors(model_dir: str | Path) -> bool:
    quant = quantization_config(model_dir)
    return quant is not None and quant.get("quant_method") == QUANT_METHOD


@dataclass(frozen=True)
class QuantArgs:
    """One side (weights or input activations) of a scheme."""

    num_bits: int
    type: str  # int | float
    symmetric: bool
    strategy: str  # tensor | channel | group | token | block
    group_size: int | None
    dynamic: bool
    actorder: str | None

    @classmethod
    def of(cls, raw: dict[str, Any] | None) -> QuantArgs | None:
        if not raw:
            return None
        return cls(
            int(raw.get("num_bits", 8)), str(raw.get("type", "int")),
            bool(raw.get("symmetric", True)), str(raw.get("strategy", "tensor")),
            raw.get("group_size"), bool(raw.get("dynamic", False)), raw.get("actorder"),
        )  # fmt: skip


@dataclass(frozen=True)
class Scheme:
    name: str
    targets: tuple[str, ...]
    format: str
    weights: QuantArgs | None
    inputs: QuantArgs | None

    def matches(self, module: str) -> bool:
        return any(_selects(t, module) for t in self.targets)

    def describe(self) -> str:
        w, a = self.weights, self.inputs
        if w is None:
            return "dense"
        text = f"w{w.num_bits}" + ("fp" if w.type == "float" else "")
        text += f"-{w.strategy}" + (f"{w.group_size}" if w.strategy == "group" else "")
        text += "" if w.symmetric else "-asym"
        if a is not None:
            text += f"-a{a.num_bits}" + ("fp" if a.type == "float" else "") + f"-{a.strategy}"
        return text


def _selects(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    # A class name selects every layer of that class: the checkpoint's quantized layers are
    # Linear (those with quantized tensors are the ones the file holds as such).
    return target in ("Linear", module) or module.endswith("." + target)


@dataclass
class CtConfig:
    format: str
    schemes: list[Scheme]
    ignore: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, quant: dict[str, Any]) -> CtConfig:
        fmt = str(quant.get("format") or "dense")
        schemes = []
        for name, group in (quant.get("config_groups") or {}).items():
            schemes.append(Scheme(
                name, tuple(group.get("targets") or ()), str(group.get("format") or fmt),
                QuantArgs.of(group.get("weights")), QuantArgs.of(group.get("input_activations")),
            ))  # fmt: skip
        if (quant.get("sparsity_config") or {}).get("format") not in (None, "dense"):
            raise UnsupportedQuantization(
                "sparse compressed-tensors checkpoints (sparsity_config) are not served"
            )
        return cls(fmt, schemes, list(quant.get("ignore") or ()))

    def scheme_for(self, module: str) -> Scheme | None:
        if any(_selects(t, module) for t in self.ignore):
            return None
        for scheme in self.schemes:
            if scheme.matches(module):
                return scheme
        return None

    def describe(self) -> str:
        """The checkpoint's scheme(s), for the weight format's identity."""
        return "+".join(sorted({s.describe() for s in self.schemes})) or "dense"


@dataclass
class CtTensor:
    name: str  # the Hugging Face name
    value: QuantWeight | torch.Tensor


class CtCheckpoint:
    """A compressed-tensors checkpoint directory: its tensors by Hugging Face name, the
    quantized layers' weights repacked (``tensors``)."""

    def __init__(self, model_dir: str | Path) -> None:
        self.path = Path(model_dir)
        quant = quantization_config(self.path)
        if quant is None or quant.get("quant_method") != QUANT_METHOD:
            raise UnsupportedQuantization(f"{self.path} is not a compressed-tensors checkpoint")
        self.config = CtConfig.of(quant)
        self.files = sorted(self.path.glob("*.safetensors"))
        if not self.files:
            raise FileNotFoundError(f"{self.path} holds no *.safetensors weights")

    def _index(self) -> dict[str, Path]:
        where: dict[str, Path] = {}
        for path in self.files:
            try:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        where[name] = path
            except Exception as e:  # safetensors' own errors: a truncated or corrupt file
                raise UnsupportedQuantization(f"{path}: not a readable safetensors file ({e})") from e
        return where

    def tensors(self) -> Iterator[CtTensor]:
        where = self._index()
        modules: dict[str, dict[str, str]] = {}  # module -> suffix -> tensor name
        for name in where:
            module, _, suffix = name.rpartition(".")
            if suffix in _SUFFIXES or suffix == "weight":
                modules.setdefault(module, {})[suffix] = name
        quantized = {
            m for m, parts in modules.items()
            if "weight_scale" in parts or "weight_packed" in parts
        }  # fmt: skip
        with ExitStack() as stack:
            handles = {p: stack.enter_context(safe_open(str(p), framework="pt")) for p in self.files}

            def read(name: str) -> torch.Tensor:
                return handles[where[name]].get_tensor(name)

            for name in where:
                module, _, suffix = name.rpartition(".")
                if module in quantized and (suffix in _SUFFIXES or suffix == "weight"):
                    if suffix in ("weight", "weight_packed"):
                        parts = {s: read(n) for s, n in modules[module].items()}
                        yield CtTensor(module + ".weight", self._weight(module, parts))
                    continue
                yield CtTensor(name, read(name))  # float tensors in their own dtype

    def _weight(self, module: str, parts: dict[str, torch.Tensor]) -> QuantWeight:
        scheme = self.config.scheme_for(module)
        what = f"{self.path.name}: {module}"
        if scheme is None or scheme.weights is None:
            raise UnsupportedQuantization(
                f"{what} holds quantized tensors but no scheme of the config selects it"
            )
        args = scheme.weights
        if "weight_global_scale" in parts or "input_global_scale" in parts:
            raise UnsupportedQuantization(f"{what}: FP4 / tensor-group schemes are not served")
        if scheme.format in FLOAT_FORMATS or args.type == "float":
            return _fp8_weight(what, scheme, parts)
        if args.num_bits not in (4, 8):
            raise UnsupportedQuantization(
                f"{what}: {args.num_bits}-bit integer weights are not served (4 and 8 are)"
            )
        if scheme.format in PACKED_FORMATS:
            if "weight_shape" not in parts:
                raise UnsupportedQuantization(f"{what}: pack-quantized without its weight_shape")
            shape = tuple(int(v) for v in parts["weight_shape"].tolist())
            packed = parts["weight_packed"]
            per = 32 // args.num_bits
            if len(shape) != 2 or packed.shape != (shape[0], -(-shape[1] // per)):
                raise UnsupportedQuantization(
                    f"{what}: weight_packed {tuple(packed.shape)} does not hold a "
                    f"{list(shape)} weight of {args.num_bits}-bit codes ({per} to an int32): "
                    "the config's num_bits or the tensor is wrong"
                )
            codes = unpack_int32(packed, args.num_bits, shape[1])
        elif scheme.format in INT_FORMATS:
            weight = parts["weight"]
            if weight.dtype != torch.int8:
                raise UnsupportedQuantization(f"{what}: {scheme.format} weight of {weight.dtype}")
            codes = (weight.to(torch.int16) + 128).to(torch.uint8)
        else:
            raise UnsupportedQuantization(f"{what}: format {scheme.format!r} is not served")
        return _integer_weight(what, scheme, codes, parts)


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int = 1) -> torch.Tensor:
    """uint8 codes from int32 words holding 32 // bits each along ``dim`` (element i at bits
    ``bits * i``), ``length`` of them along that dim."""
    if 32 % bits:
        raise UnsupportedQuantization(f"{bits}-bit codes split across int32 words")
    words = packed if dim == 1 else packed.t()
    per = 32 // bits
    shifts = torch.arange(per, dtype=torch.int32) * bits
    fields = (words.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    codes = fields.reshape(words.shape[0], -1)[:, :length].to(torch.uint8)
    return codes if dim == 1 else codes.t().contiguous()


def _integer_weight(
    what: str, scheme: Scheme, codes: torch.Tensor, parts: dict[str, torch.Tensor]
) -> QuantWeight:
    args = scheme.weights
    assert args is not None
    n, k = codes.shape
    if n % 16:
        raise UnsupportedQuantization(f"{what}: {n} output features are not a multiple of 16")
    scale = parts["weight_scale"]
    if scale.dim() == 1:
        scale = scale.view(-1, 1)
    if scale.shape[0] == 1 and n > 1:  # per tensor
        scale = scale.expand(n, scale.shape[1])
    if scale.dim() != 2 or scale.shape[0] != n:
        raise UnsupportedQuantization(
            f"{what}: weight_scale {tuple(parts['weight_scale'].shape)} does not fit a weight "
            f"of {n} rows"
        )
    groups = scale.shape[1]
    expected = {"channel": 1, "tensor": 1}.get(args.strategy)
    if args.strategy == "group" and args.group_size:
        expected = k // args.group_size
    if expected is not None and groups != expected:
        raise UnsupportedQuantization(
            f"{what}: weight_scale has {groups} groups per row where the config's "
            f"{args.strategy} strategy (group_size {args.group_size}) gives {expected}"
        )
    if k % groups or (k // groups) % 32:
        raise UnsupportedQuantization(
            f"{what}: {k} input features in {groups} groups (the kernels need groups of a "
            "multiple of 32)"
        )
    group = k // groups
    zero = None
    if "weight_zero_point" in parts and not args.symmetric:
        zp = parts["weight_zero_point"]
        if zp.dtype == torch.int32 and scheme.format in PACKED_FORMATS:
            zp = unpack_int32(zp, args.num_bits, n, dim=0).to(torch.int16) - (1 << (args.num_bits - 1))
        zero = zp.to(torch.int16).reshape(n, groups)
        if int(zero.abs().max()) > 127:
            raise UnsupportedQuantization(f"{what}: zero points beyond int8")
    perm = _act_order(what, parts.get("weight_g_idx"), k, group)
    if perm is not None:
        codes = codes[:, perm]
    inputs = scheme.inputs
    int8_tokens = False
    if inputs is not None:
        if not (
            inputs.type == "int" and inputs.num_bits == 8 and inputs.symmetric
            and inputs.dynamic and inputs.strategy == "token"
        ):  # fmt: skip
            raise UnsupportedQuantization(
                f"{what}: input activations {inputs} are not served (dynamic symmetric int8 "
                "per token is)"
            )
        int8_tokens = True
    return integer_weight(args.num_bits, group, codes, scale, zero, perm, int8_tokens)


def _act_order(what: str, g_idx: torch.Tensor | None, k: int, group: int) -> torch.Tensor | None:
    """The column permutation that makes ``g_idx``'s groups contiguous, or None where they
    already are."""
    if g_idx is None:
        return None
    g_idx = g_idx.to(torch.int64)
    natural = torch.arange(k) // group
    if torch.equal(g_idx, natural):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], natural):
        raise UnsupportedQuantization(f"{what}: weight_g_idx has groups of other than {group}")
    return perm


def _fp8_weight(what: str, scheme: Scheme, parts: dict[str, torch.Tensor]) -> Fp8Weight:
    args = scheme.weights
    assert args is not None
    weight = parts["weight"]
    if weight.dtype != torch.float8_e4m3fn or args.num_bits != 8:
        raise UnsupportedQuantization(f"{what}: float weights of {weight.dtype} are not served")
    n, _ = weight.shape
    scale = parts["weight_scale"]
    if scale.numel() not in (1, n):
        raise UnsupportedQuantization(
            f"{what}: FP8 scales of shape {tuple(scale.shape)} (per tensor or channel are served)"
        )
    activations, input_scale = "none", None
    inputs = scheme.inputs
    if inputs is not None:
        if inputs.type != "float" or inputs.num_bits != 8:
            raise UnsupportedQuantization(f"{what}: FP8 weights with input activations {inputs}")
        if inputs.dynamic and inputs.strategy == "token":
            activations = "token"
        elif not inputs.dynamic and inputs.strategy == "tensor" and "input_scale" in parts:
            activations, input_scale = "tensor", parts["input_scale"].float().view(1, 1)
        else:
            raise UnsupportedQuantization(f"{what}: FP8 input activations {inputs} are not served")
    return Fp8Weight.of(
        weight.view(torch.uint8).contiguous(), scale.float().view(-1, 1).contiguous(),
        scale.dtype, activations, input_scale,
    )  # fmt: skip
