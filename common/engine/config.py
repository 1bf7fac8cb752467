"""EngineConfig: one frozen, validated description of an engine, built once from flags/env."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.contract.eviction import DEFAULT_SNAPKV_WINDOW, KV_COMPRESSIONS, KvCompression
from common.engine.eviction import KV_EVICTIONS, KvEviction
from common.engine.speculative.config import SpeculativeConfig
from common.models.quant.formats import QUANT_KERNELS, QUANTIZATIONS

if TYPE_CHECKING:  # torch is imported when a config is turned into torch objects, so that
    import torch  # the CLI (pdserve health, a probe run every few seconds) starts fast

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip

DTYPES = ("float32", "bfloat16", "float16")
PREFILL_ATTENTION = ("auto", "kernel", "sdpa")

# KV cache element types: the float dtypes, or int8 / fp8 (e4m3fn) codes with block scales.
KV_DTYPES = (*DTYPES, "int8", "fp8")
_TORCH_NAMES = {"fp8": "float8_e4m3fn"}


def torch_dtype_of(name: str) -> torch.dtype:
    """The torch dtype of a name of DTYPES or KV_DTYPES."""
    import torch

    dtype: torch.dtype = getattr(torch, _TORCH_NAMES.get(name, name))
    return dtype


def parse_memory_budget(text: str, total_bytes: int) -> int:
    """``"2GiB"``, ``"512MB"``, ``"1e9"`` are bytes; a bare number <= 1 is a fraction of total."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"cannot read memory budget {text!r}; use e.g. 2GiB, 512MiB or 0.2")
    value, unit = float(match.group(1)), match.group(2)
    if unit is None and value <= 1.0:
        if value <= 0:
            raise ValueError(f"memory fraction must be in (0, 1], got {text!r}")
        return int(value * total_bytes)
    return int(value * _UNITS[(unit or "B").lower()])


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # auto = float32 on CPU (bf16 matmuls are slow there), bfloat16 on CUDA
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: str = "1GiB"  # bytes ("2GiB") or a fraction of device memory ("0.3")
    num_kv_blocks: int | None = None  # overrides kv_cache_memory when set
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    max_waiting: int = 512
    enable_prefix_caching: bool = True
    # auto = triton on CUDA; on CPU cpp (fused C++ ops) for quantized weights, else torch
    attention_backend: str = "auto"
    # The cpp backend's prompt rows: "kernel" (its decode kernel, a row per prompt token),
    # "sdpa" (torch's scaled_dot_product_attention per chunk), "auto" = sdpa where the
    # kernel has no AVX-512 path (cpp_backend.py says why).
    prefill_attention: str = "auto"
    kv_dtype: str = "auto"  # auto = the model dtype; int8 / fp8 quantize the KV cache
    # CPU: write the whole KV pool at start, so that no request pays the page faults of its
    # blocks' first use (the pool's memory is held from start); off = mapped as first used.
    kv_prefault: bool = False
    hash_seed: str = ""
    # torch's CPU threads for this process; None = torch's default (one per core). Several
    # engines on one machine should share its cores out: more threads than cores make
    # every parallel region wait on a thread that is not running (pdserve up does this).
    num_threads: int | None = None
    # Weight format (common/models/quant/formats.py): auto = gguf when the model has a GGUF
    # file, else none (float). int4 groups quant_group_size inputs per scale; quant_kernel
    # picks what multiplies quantized weights (auto = the C++ kernels when they build).
    quantization: str = "auto"
    quant_group_size: int = 32
    quant_kernel: str = "auto"
    # Bits x is quantized to inside the C++ kernels (per 32 elements): 16 near-exact, 8
    # llama.cpp's activations, faster; see loadtest/bench_quant.py and pdserve perplexity.
    quant_act_bits: int = 16
    # Decode-only steps of dense models with quantized weights in one C++ call
    # (common/models/quant/fused_decode.py); off = the Python path, the same arithmetic.
    fused_decode: bool = True
    # Speculative decoding, vLLM's --speculative-config JSON
    # (common/engine/speculative/config.py); None = off.
    speculative_config: str | None = None
    # StreamingLLM eviction for every request (common/engine/eviction.py): none keeps all
    # KV; streaming keeps sink_tokens and a window of window_tokens, so streams go past
    # the context in fixed memory.
    kv_eviction: str = "none"
    sink_tokens: int = 16
    window_tokens: int = 1024
    # SnapKV prompt compression for every request (common/engine/compression.py): none
    # keeps all KV; snapkv keeps at most snapkv_budget_tokens of each prompt's KV, the
    # blocks its last snapkv_window_tokens attend to most.
    kv_compression: str = "none"
    snapkv_budget_tokens: int = 1024
    snapkv_window_tokens: int = DEFAULT_SNAPKV_WINDOW

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_waiting"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.attention_backend not in ("auto", "torch", "triton", "cpp"):
            raise ValueError(
                "attention_backend must be auto, torch, triton or cpp, got "
                f"{self.attention_backend!r}"
            )
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ValueError(
                f"prefill_attention must be one of {', '.join(PREFILL_ATTENTION)}, "
                f"got {self.prefill_attention!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
                f"got {self.quantization!r}"
            )
        if self.quant_kernel not in QUANT_KERNELS:
            raise ValueError(
                f"quant_kernel must be one of {', '.join(QUANT_KERNELS)}, got {self.quant_kernel!r}"
            )
        if self.quant_act_bits not in (8, 16):
            raise ValueError(f"quant_act_bits must be 8 or 16, got {self.quant_act_bits}")
        group = self.quant_group_size
        if group < 32 or group & (group - 1):
            raise ValueError(f"quant_group_size must be a power of two >= 32, got {group}")
        if self.kv_dtype != "auto" and self.kv_dtype not in KV_DTYPES:
            raise ValueError(
                f"kv_dtype must be auto or one of {sorted(KV_DTYPES)}, got {self.kv_dtype!r}"
            )
        self.speculative  # noqa: B018 (parses and checks it)
        if self.kv_eviction not in KV_EVICTIONS:
            raise ValueError(
                f"kv_eviction must be one of {', '.join(KV_EVICTIONS)}, got {self.kv_eviction!r}"
            )
        if self.sink_tokens < 0 or self.window_tokens < self.block_size:
            raise ValueError(
                f"sink_tokens must be >= 0 and window_tokens at least a block ({self.block_size})"
                f", got {self.sink_tokens} and {self.window_tokens}"
            )
        if self.kv_compression not in KV_COMPRESSIONS:
            raise ValueError(
                f"kv_compression must be one of {', '.join(KV_COMPRESSIONS)}, "
                f"got {self.kv_compression!r}"
            )
        if self.compression is not None:
            self.compression.check(self.block_size)  # an InvalidRequestError is a ValueError

    @property
    def compression(self) -> KvCompression | None:
        if self.kv_compression == "none":
            return None
        return KvCompression(self.snapkv_budget_tokens, self.snapkv_window_tokens)

    @property
    def eviction(self) -> KvEviction | None:
        if self.kv_eviction == "none":
            return None
        return KvEviction(self.sink_tokens, self.window_tokens)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if not self.speculative_config:
            return None
        return SpeculativeConfig.from_json(self.speculative_config)

    @classmethod
    def from_env(cls, model: str, **overrides: object) -> EngineConfig:
        """Flags win over ``PDSERVE_*`` environment variables, which win over defaults."""
        env = {
            "attention_backend": os.environ.get("PDSERVE_ATTENTION_BACKEND"),
            "prefill_attention": os.environ.get("PDSERVE_PREFILL_ATTENTION"),
            "kv_cache_memory": os.environ.get("PDSERVE_KV_CACHE_MEMORY"),
            "device": os.environ.get("PDSERVE_DEVICE"),
            "kv_dtype": os.environ.get("PDSERVE_KV_DTYPE"),
            "num_threads": os.environ.get("PDSERVE_NUM_THREADS"),
            "quantization": os.environ.get("PDSERVE_QUANTIZATION"),
            "quant_kernel": os.environ.get("PDSERVE_QUANT_KERNEL"),
            "quant_act_bits": os.environ.get("PDSERVE_QUANT_ACT_BITS"),
            "fused_decode": os.environ.get("PDSERVE_FUSED_DECODE"),
            "kv_prefault": os.environ.get("PDSERVE_KV_PREFAULT"),
            "speculative_config": os.environ.get("PDSERVE_SPECULATIVE_CONFIG"),
        }
        values: dict[str, object] = {k: v for k, v in env.items() if v}
        for name in ("num_threads", "quant_act_bits"):
            if name in values:
                values[name] = int(str(values[name]))
        for name in ("fused_decode", "kv_prefault"):
            if name in values:
                values[name] = str(values[name]).lower() not in ("0", "false", "no")
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(model=model, **values)  # type: ignore[arg-type]

    @property
    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch_dtype_of("bfloat16" if self.torch_device.type == "cuda" else "float32")
        return torch_dtype_of(self.dtype)

    @property
    def torch_kv_dtype(self) -> torch.dtype:
        if self.kv_dtype == "auto":
            return self.torch_dtype
        return torch_dtype_of(self.kv_dtype)
