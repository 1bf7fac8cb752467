"""The engine flags shared by every command that runs an engine, and their config."""

from __future__ import annotations

import argparse

from common.contract.eviction import DEFAULT_SNAPKV_WINDOW, KV_COMPRESSIONS
from common.engine.config import EngineConfig
from common.engine.eviction import KV_EVICTIONS
from common.engine.speculative.config import SpeculativeConfig, SpeculativeConfigError
from common.models.quant.formats import QUANT_KERNELS, QUANTIZATIONS

KV_DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16", "int8", "fp8"]


def speculative_config_arg(text: str) -> str:
    """argparse type of --speculative-config: the JSON, checked now (a bad one is a usage
    error naming the field, not a worker that fails to start)."""
    try:
        SpeculativeConfig.from_json(text)
    except SpeculativeConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="checkpoint directory (safetensors or a .gguf, config, tokenizer) or a .gguf "
        "file; default: SmolLM2-135M-Instruct, prepared in $PDSERVE_CACHE on first use",
    )
    group.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: auto)")
    group.add_argument("--block-size", type=int, default=None, help="tokens per KV block (16)")
    group.add_argument(
        "--kv-cache-memory",
        default=None,
        help="KV pool budget: bytes (2GiB, 512MiB) or a fraction of device memory (0.3)",
    )
    group.add_argument("--num-kv-blocks", type=int, default=None, help="exact KV pool size")
    group.add_argument("--max-num-seqs", type=int, default=None, help="running sequences cap")
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget of one step"
    )
    group.add_argument("--max-model-len", type=int, default=None, help="context limit")
    group.add_argument("--max-waiting", type=int, default=None, help="waiting queue bound")
    group.add_argument(
        "--attention-backend",
        default=None,
        choices=["auto", "torch", "triton", "cpp"],
        help="auto = triton on CUDA; on CPU cpp (fused C++ ops) for quantized weights, "
        "torch (transformers' exact numerics) for float ones (env PDSERVE_ATTENTION_BACKEND)",
    )
    group.add_argument(
        "--prefill-attention",
        default=None,
        choices=["auto", "kernel", "sdpa"],
        help="the cpp backend's prompt tokens: kernel (a decode query per token: a sequence's "
        "bits whatever its chunking), sdpa (torch's fused attention per chunk); auto = sdpa on "
        "CPUs without AVX-512, where it is the faster (env PDSERVE_PREFILL_ATTENTION)",
    )
    group.add_argument(
        "--kv-dtype",
        default=None,
        choices=KV_DTYPE_CHOICES,
        help="KV cache element type; auto = the model dtype, int8 / fp8 (e4m3) store codes "
        "with a scale per block and kv head (env PDSERVE_KV_DTYPE)",
    )
    group.add_argument(
        "--kv-prefault",
        action="store_true",
        default=None,
        help="CPU: write the whole KV pool at start, so that no request pays page faults for "
        "its blocks' first use (the pool's memory is held from start; env PDSERVE_KV_PREFAULT)",
    )
    group.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: one per core; env PDSERVE_NUM_THREADS); with "
        "several engines on one machine give each its share of the cores",
    )
    group.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    group.add_argument(
        "--quantization",
        default=None,
        choices=list(QUANTIZATIONS),
        help="weight format: auto (default) = gguf when the model has a .gguf file, else "
        "none (float); int8 / int4 quantize the checkpoint at load; gguf serves the file's "
        "Q4_0/Q4_1/Q8_0 tensors as stored (env PDSERVE_QUANTIZATION)",
    )
    group.add_argument(
        "--quant-group-size", type=int, default=None, help="int4: inputs per scale (32)"
    )
    group.add_argument(
        "--quant-kernel",
        default=None,
        choices=list(QUANT_KERNELS),
        help="what multiplies quantized weights: cpp (our AVX2 kernels; auto when they build) "
        "or torch (its packed kernels, bfloat16 activations) (env PDSERVE_QUANT_KERNEL)",
    )
    group.add_argument(
        "--quant-act-bits",
        type=int,
        default=None,
        choices=[16, 8],
        help="cpp kernels: bits x is quantized to per 32 inputs (default 16; 8 is faster, "
        "as llama.cpp; env PDSERVE_QUANT_ACT_BITS)",
    )
    group.add_argument(
        "--speculative-config",
        type=speculative_config_arg,
        default=None,
        help="speculative decoding, vLLM's JSON: e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}'; decode workers and "
        "generate --local speculate, prefill workers ignore it (env PDSERVE_SPECULATIVE_CONFIG)",
    )
    add_eviction_args(group)
    add_compression_args(group)


def add_compression_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    group.add_argument(
        "--kv-compression",
        default=None,
        choices=list(KV_COMPRESSIONS),
        help="snapkv: once a prompt is computed, keep only the KV blocks its last "
        "--snapkv-window-tokens attend to most (with the first block and the window's), at "
        "most --snapkv-budget-tokens, so decode imports and reads fewer blocks (prefill "
        "workers and --local runs; a request's sampling.kv_compression wins; default none)",
    )
    group.add_argument(
        "--snapkv-budget-tokens", type=int, default=None, help="snapkv: KV kept per prompt (1024)"
    )
    group.add_argument(
        "--snapkv-window-tokens", type=int, default=None,
        help=f"snapkv: the observation window ({DEFAULT_SNAPKV_WINDOW})",
    )  # fmt: skip


def add_eviction_args(group: argparse._ArgumentGroup | argparse.ArgumentParser) -> None:
    group.add_argument(
        "--kv-eviction",
        default=None,
        choices=list(KV_EVICTIONS),
        help="streaming: StreamingLLM for every request; it keeps --sink-tokens and a window "
        "of --window-tokens and frees the KV between, so a stream goes past the context in "
        "fixed memory (decode workers and --local runs; default none)",
    )
    group.add_argument("--sink-tokens", type=int, default=None, help="streaming: sinks (16)")
    group.add_argument(
        "--window-tokens", type=int, default=None, help="streaming: the window (1024)"
    )


def engine_config_from_args(args: argparse.Namespace, model_dir: str) -> EngineConfig:
    return EngineConfig.from_env(
        model_dir,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        max_waiting=args.max_waiting,
        attention_backend=args.attention_backend,
        prefill_attention=args.prefill_attention,
        kv_dtype=args.kv_dtype,
        kv_prefault=args.kv_prefault,
        num_threads=args.threads,
        enable_prefix_caching=False if args.no_prefix_caching else None,
        quantization=args.quantization,
        quant_group_size=args.quant_group_size,
        quant_kernel=args.quant_kernel,
        quant_act_bits=args.quant_act_bits,
        speculative_config=args.speculative_config,
        kv_eviction=args.kv_eviction,
        sink_tokens=args.sink_tokens,
        window_tokens=args.window_tokens,
        kv_compression=args.kv_compression,
        snapkv_budget_tokens=args.snapkv_budget_tokens,
        snapkv_window_tokens=args.snapkv_window_tokens,
    )
