"""Weight formats (``--quantization``, vLLM's flag name) and how one is chosen for a model.

- ``none``: float weights as the checkpoint (or the GGUF, dequantized) gives them.
- ``int8``: int8 per output channel, quantized at load (symmetric, scale = max|w| / 127).
- ``int4``: 4-bit codes per group of ``group_size`` along the input, with a float16 scale
  and min per group (GGUF Q4_1's arithmetic), quantized at load.
- ``gguf``: a GGUF file's Q4_0 / Q4_1 / Q8_0 tensors as stored.
- ``compressed-tensors``: a compressed-tensors checkpoint's quantized layers as stored
  (llm-compressor's W4A16, W8A8, FP8; common/models/quant/compressed.py).
- ``gptq`` / ``awq``: a GPTQ or AWQ checkpoint's quantized layers as stored
  (common/models/quant/gptq.py).
- ``auto``: on the CPU, ``compressed-tensors``, ``gptq`` or ``awq`` when the checkpoint's
  config says so,
  ``gguf`` when the model has a GGUF file, else ``none`` (the quantized formats run on
  CPUs only so far). ``none`` on a quantized checkpoint dequantizes it.

Every format but ``none`` keeps the output head in int8 as well (per channel for int8 and
int4, the file's own format for gguf); the MoE router and norms stay float. Embeddings are
quantized only when they are tied to the head (they share its table).

The format is part of the KV cache's identity: ``WeightFormat.identity`` goes into the block
hashes' extra keys, the KV handle and the worker registry, so KV computed under one format is
never reused, pulled or indexed as another's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.models.quant.linear import QuantCompute

# Imported by common/engine/config.py: this module imports no torch at its top.
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf", "compressed-tensors", "gptq", "awq")
QUANT_KERNELS = ("auto", "cpp", "torch")
# The quant_method of the checkpoints read as stored (config.json's quantization_config).
CHECKPOINT_METHODS = ("compressed-tensors", "gptq", "awq")
DEFAULT_GROUP_SIZE = 32


@dataclass(frozen=True)
class WeightFormat:
    name: str  # none | int8 | int4 | gguf | compressed-tensors | gptq | awq
    group_size: int = 0  # int4's group size (0 otherwise)
    # gguf: the file's type, e.g. MOSTLY_Q4_1; compressed-tensors: its schemes, e.g.
    # w4-group128-asym (common/models/quant/compressed.py's Scheme.describe); gptq / awq:
    # e.g. gptq-w4-g128-actorder (common/models/quant/gptq.py)
    file_type: str = ""
    kernel: str = ""  # cpp | torch: what multiplies quantized weights ("" for none)
    act_bits: int = 16  # cpp: the precision x is quantized to inside the kernel

    @property
    def quantized(self) -> bool:
        return self.name != "none"

    @property
    def compute(self) -> QuantCompute:
        from common.models.quant.linear import QuantCompute

        return QuantCompute(self.kernel or "cpp", self.act_bits)

    @property
    def identity(self) -> str | None:
        """The KV identity of this format; None for float weights (the hashes stay those of
        the scheme without it). The activations' precision inside the kernels is part of it:
        torch's take bfloat16, the C++ ones 16- or 8-bit codes."""
        if not self.quantized:
            return None
        text = {"int8": "int8", "int4": f"int4-g{self.group_size}"}.get(self.name)
        if self.name == "compressed-tensors":
            text = f"ct-{self.file_type or 'unknown'}"
        elif self.name in ("gptq", "awq"):
            text = self.file_type or self.name
        elif text is None:
            text = f"gguf-{self.file_type or 'unknown'}"
        return f"{text}/{self.activations}"

    @property
    def activations(self) -> str:
        return "bf16" if self.kernel == "torch" else f"a{self.act_bits}"

    def describe(self) -> str:
        if not self.quantized:
            return "none (float weights)"
        kernel = (
            f"C++, {self.act_bits}-bit activation codes"
            if self.kernel == "cpp"
            else "torch packed, bfloat16 activations"
        )
        return f"{self.identity} ({kernel})"


def resolve_weight_format(
    quantization: str,
    group_size: int,
    kernel: str,
    model: str | Path,
    act_bits: int = 16,
    device_type: str = "cpu",
) -> WeightFormat:
    """The format an engine serves ``model`` in; raises ValueError with what to do instead."""
    from common.models.quant.compressed import CtConfig, quantization_config
    from common.models.quant.gguf import find_gguf, open_checkpoint
    from common.models.quant.gptq import GptqAwqConfig

    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if kernel not in QUANT_KERNELS:
        raise ValueError(f"quantized kernel must be one of {', '.join(QUANT_KERNELS)}")
    gguf_file = find_gguf(model)
    declared = quantization_config(model)  # config.json's, read once
    method = None if declared is None else str(declared.get("quant_method", "")).lower()
    if declared is not None and method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"{model}: its config.json's quantization_config names quant_method "
            f"{declared.get('quant_method')!r}, which pdserve does not read (it reads "
            "compressed-tensors, gptq and awq checkpoints, and GGUF files)"
        )
    name = quantization
    if name == "auto":
        name = "none"
        if device_type == "cpu" and method is not None:
            name = method
        elif device_type == "cpu" and gguf_file is not None:
            name = "gguf"
    if name == "none":
        return WeightFormat("none")
    if name in CHECKPOINT_METHODS:
        if method != name or declared is None:
            raise ValueError(
                f"--quantization {name} needs a checkpoint whose config.json has a {name} "
                f"quantization_config (quant_method {name}): {model} has {method or 'none'}"
            )
        config = CtConfig.of(declared) if name == "compressed-tensors" else GptqAwqConfig.of(declared)
        return WeightFormat(
            name, file_type=config.describe(), kernel=_resolve_kernel(kernel), act_bits=16
        )
    if name == "gguf" and gguf_file is None:
        raise ValueError(
            f"--quantization gguf needs a .gguf file: {model} is not one and holds none"
        )
    chosen = _resolve_kernel(kernel)
    if name == "gguf":
        assert gguf_file is not None
        file_type = _file_type_name(open_checkpoint(gguf_file).file_type)
        return WeightFormat("gguf", file_type=file_type, kernel=chosen, act_bits=act_bits)
    if name == "int4":
        return WeightFormat("int4", group_size=group_size, kernel=chosen, act_bits=act_bits)
    return WeightFormat("int8", kernel=chosen, act_bits=act_bits)


def _resolve_kernel(kernel: str) -> str:
    if kernel != "auto":
        return kernel
    from kernels.cpu import available

    return "cpp" if available() else "torch"


def _file_type_name(file_type: int) -> str:
    try:
        from gguf import LlamaFileType

        return LlamaFileType(file_type).name
    except (ImportError, ValueError):
        return f"type{file_type}"
