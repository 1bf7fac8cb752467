"""Triton kernels of the engine, each beside a pure-torch reference with the same signature.

See kernels/README.md for shapes and how the parity tests run.
"""

from kernels.kv_pack import pack_kv, pack_kv_ref, unpack_kv, unpack_kv_ref
from kernels.kv_quant import QUANT_DTYPES, new_kv_scales
from kernels.kv_write import write_kv, write_kv_ref
from kernels.paged_decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_ref,
)
from kernels.paged_prefill_attention import paged_prefill_attention, paged_prefill_attention_ref
from kernels.rms_norm import rms_norm, rms_norm_ref
from kernels.rotary import apply_rotary, apply_rotary_ref

__all__ = [
    "QUANT_DTYPES",
    "apply_rotary",
    "apply_rotary_ref",
    "choose_num_splits",
    "new_kv_scales",
    "pack_kv",
    "pack_kv_ref",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "unpack_kv",
    "unpack_kv_ref",
    "write_kv",
    "write_kv_ref",
]
