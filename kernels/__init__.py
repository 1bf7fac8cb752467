"""The engine's kernels, each beside a pure-torch reference with the same signature: Triton
kernels in this package's modules, C++ CPU kernels in ``kernels.cpu``.

See kernels/README.md for shapes and how the parity tests run. Names are imported on first
use, so a CPU engine that never touches a Triton kernel never imports triton.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "QUANT_DTYPES": "kernels.kv_quant",
    "new_kv_scales": "kernels.kv_quant",
    "pack_kv": "kernels.kv_pack",
    "pack_kv_ref": "kernels.kv_pack",
    "unpack_kv": "kernels.kv_pack",
    "unpack_kv_ref": "kernels.kv_pack",
    "write_kv": "kernels.kv_write",
    "write_kv_ref": "kernels.kv_write",
    "choose_num_splits": "kernels.paged_decode_attention",
    "paged_decode_attention": "kernels.paged_decode_attention",
    "paged_decode_attention_ref": "kernels.paged_decode_attention",
    "paged_prefill_attention": "kernels.paged_prefill_attention",
    "paged_prefill_attention_ref": "kernels.paged_prefill_attention",
    "rms_norm": "kernels.rms_norm",
    "rms_norm_ref": "kernels.rms_norm",
    "apply_rotary": "kernels.rotary",
    "apply_rotary_ref": "kernels.rotary",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
