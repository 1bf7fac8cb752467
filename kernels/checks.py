"""Argument checks shared by the kernel wrappers.

Every wrapper validates its inputs before a launch and raises ValueError with a
message naming the argument, because a Triton kernel given a wrong stride or
dtype does not fail: it silently returns a wrong answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from kernels.kv_quant import QUANT_DTYPES

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
) -> torch.Tensor:
    """Check that `t` is a contiguous tensor of rank `ndim`, one of `dtypes`, on `device`."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} dtype must be one of ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()})")
    return t


def check_shape(name: str, t: torch.Tensor, expected: Sequence[int]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_launchable(device: torch.device) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and triton.knobs.runtime.interpret:
        return
    raise ValueError(
        f"Triton kernels need CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
        f"triton is imported); got a tensor on {device}. Use the *_ref function instead."
    )


def check_scales(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Validate the quantization arguments of a paged KV cache; return whether it is quantized.

    k_cache, v_cache: [N, S, Hkv, D]; k_scale, v_scale: [N, Hkv] float32 or both None.
    """
    quantized = k_cache.dtype in QUANT_DTYPES
    if (k_scale is None) != (v_scale is None):
        raise ValueError("k_scale and v_scale must be given together")
    if quantized and k_scale is None:
        raise ValueError(f"a {k_cache.dtype} KV cache needs k_scale and v_scale")
    if not quantized and k_scale is not None:
        raise ValueError(f"k_scale/v_scale given but the KV cache dtype is {k_cache.dtype}")
    if k_scale is not None and v_scale is not None:
        num_blocks, _, num_kv_heads, _ = k_cache.shape
        for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
            check_tensor(name, s, ndim=2, dtypes=(torch.float32,), device=k_cache.device)
            check_shape(name, s, (num_blocks, num_kv_heads))
    return quantized


def check_paged_cache(
    k_cache: object, v_cache: object, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """k_cache, v_cache: [N, S, Hkv, D], same shape and dtype, float or quantized."""
    dtypes = (*FLOAT_DTYPES, *QUANT_DTYPES)
    k = check_tensor("k_cache", k_cache, ndim=4, dtypes=dtypes, device=device)
    v = check_tensor("v_cache", v_cache, ndim=4, dtypes=dtypes, device=device)
    if k.shape != v.shape or k.dtype != v.dtype:
        raise ValueError(
            f"k_cache and v_cache must match: {tuple(k.shape)} {k.dtype} vs "
            f"{tuple(v.shape)} {v.dtype}"
        )
    return k, v


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, triton.next_power_of_2(n))


def check_attention_args(
    q: torch.Tensor,  # [B or T, Hq, D], already checked
    k_cache: object,  # [N, S, Hkv, D]
    v_cache: object,
    block_tables: object,  # [B, M]
    seq_lens: object,  # [B]
    scale: object,
    sliding_window: object,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> bool:
    """Checks shared by the paged attention wrappers; returns whether the cache is quantized."""
    kc, vc = check_paged_cache(k_cache, v_cache, q.device)
    _, num_q_heads, head_dim = q.shape
    num_kv_heads = kc.shape[2]
    if kc.shape[3] != head_dim:
        raise ValueError(f"q head dim {head_dim} differs from the cache's {kc.shape[3]}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})"
        )
    tables = check_tensor(
        "block_tables", block_tables, ndim=2, dtypes=INDEX_DTYPES, device=q.device
    )
    lens = check_tensor("seq_lens", seq_lens, ndim=1, dtypes=INDEX_DTYPES, device=q.device)
    check_shape("seq_lens", lens, (tables.shape[0],))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float, got {type(scale).__name__}")
    if sliding_window is not None and (
        isinstance(sliding_window, bool)
        or not isinstance(sliding_window, int)
        or sliding_window < 1
    ):
        raise ValueError(f"sliding_window must be None or a positive int, got {sliding_window!r}")
    quantized = check_scales(kc, vc, k_scale, v_scale)
    if not quantized and kc.dtype != q.dtype:
        raise ValueError(f"cache dtype {kc.dtype} differs from q dtype {q.dtype}")
    return quantized


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: float32 inputs get full IEEE products (TF32 would cost ~1e-3)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_paged_metadata(
    block_tables: torch.Tensor,  # [B, M]
    seq_lens: torch.Tensor,  # [B]
    num_blocks: int,  # N
    block_size: int,  # S
    query_start_loc: torch.Tensor | None = None,  # [B + 1], prefill only
    num_tokens: int | None = None,  # T, prefill only
) -> None:
    """Value checks the attention wrappers skip because they need a device sync: lengths fit
    the block tables, the blocks a sequence uses exist, and query_start_loc partitions T.
    Meant for tests and debug builds; raises ValueError."""
    lens = seq_lens.long().cpu()
    tables = block_tables.long().cpu()
    max_blocks = tables.shape[1]
    if bool((lens < 0).any()) or bool((lens > max_blocks * block_size).any()):
        raise ValueError(f"seq_lens must lie in [0, {max_blocks * block_size}]: {lens.tolist()}")
    for b, seq_len in enumerate(lens.tolist()):
        used = tables[b, : -(-seq_len // block_size)]
        if bool((used < 0).any()) or bool((used >= num_blocks).any()):
            raise ValueError(
                f"sequence {b} uses block ids outside [0, {num_blocks}): {used.tolist()}"
            )
    if query_start_loc is None:
        return
    starts = query_start_loc.long().cpu()
    q_lens = starts[1:] - starts[:-1]
    if int(starts[0]) != 0 or int(starts[-1]) != num_tokens or bool((q_lens < 0).any()):
        raise ValueError(f"query_start_loc must rise from 0 to {num_tokens}: {starts.tolist()}")
    if bool((q_lens > lens).any()):
        raise ValueError("a sequence has more queries than tokens (q_len > seq_len)")
