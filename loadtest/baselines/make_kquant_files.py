"""Makes the tiny GGUF K-quant files the tests read (issue 30): a random 2-layer llama in
float32, written with the gguf package, then quantized by llama.cpp's own llama-quantize to
each type the engine must read. Committed under tests/data/kquants/ (about 0.5-1 MB each);
this remakes them, byte for byte for the same llama.cpp:

    bash loadtest/baselines/build_llama_server.sh      # llama-quantize, once (25-40 min)
    .venv/bin/python -m loadtest.baselines.make_kquant_files

The model: hidden 256, 4 heads of 64 (2 KV heads), MLP 512, vocabulary 1024, an output head
of its own (so the file's head has the type the preset gives it, Q6_K in Q4_K_M); every K a
multiple of 256, so llama-quantize's presets apply as they do to real models. The
tokenizer is the default model's, cut to its first 1024 tokens and the merges among them,
so transformers and the engine read the files as they read a real one.

Beside the llama files, one Q4_K_M file each of qwen2 (q/k/v biases), qwen3 (q/k norms,
heads of 128) and qwen3moe (4 experts, 2 used; its expert tensors are 3-D, one per
projection), and the MoE model in Q4_0 too (``--archs`` picks which are made).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

OUT = Path(__file__).resolve().parents[2] / "tests" / "data" / "kquants"
# llama-quantize presets: K-quant mixes and the single types.
PRESETS = ("Q2_K", "Q3_K_M", "Q4_K_S", "Q4_K_M", "Q5_K_M", "Q6_K", "Q5_0", "Q5_1")

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 1024, 256, 4, 2, 64, 512, 2


def tokenizer_fields(reader: GGUFReader) -> dict[str, object]:
    """The default model's tokenizer, cut to the first VOCAB tokens."""

    def value(key: str) -> object:
        return reader.fields[key].contents()

    tokens = list(value("tokenizer.ggml.tokens"))[:VOCAB]  # type: ignore[call-overload]
    kept = set(tokens)
    merges = []
    for merge in value("tokenizer.ggml.merges"):  # type: ignore[attr-defined]
        left, right = merge.split(" ", 1)
        if left in kept and right in kept and left + right in kept:
            merges.append(merge)
    return {
        "tokens": tokens,
        "token_types": list(value("tokenizer.ggml.token_type"))[:VOCAB],  # type: ignore[call-overload]
        "merges": merges,
        "pre": value("tokenizer.ggml.pre"),
        "chat_template": value("tokenizer.chat_template"),
    }


@dataclass(frozen=True)
class Arch:
    """One tiny model: llama.cpp's architecture name and what sets it apart."""

    name: str
    head_dim: int = 64
    qkv_bias: bool = False  # qwen2
    qk_norm: bool = False  # qwen3
    experts: int = 0  # qwen3moe: sparse MLP in every layer
    experts_used: int = 0
    expert_ffn: int = 0


ARCHS = {
    "llama": Arch("llama"),
    "qwen2": Arch("qwen2", qkv_bias=True),
    # transformers' GGUF reader does not map key_length for qwen3: its default head_dim, 128.
    "qwen3": Arch("qwen3", head_dim=128, qk_norm=True),
    "qwen3moe": Arch("qwen3moe", qk_norm=True, experts=4, experts_used=2, expert_ffn=256),
}
# The presets made per architecture (the llama files cover every type; the others one mix,
# and for the MoE model a legacy type too, so 3-D expert tensors of both kinds are read).
ARCH_PRESETS = {"llama": PRESETS, "qwen2": ("Q4_K_M",), "qwen3": ("Q4_K_M",),
                "qwen3moe": ("Q4_K_M", "Q4_0")}  # fmt: skip


def write_float_model(path: Path, arch: Arch = ARCHS["llama"], seed: int = 0) -> Path:
    from common.models.default_model import gguf_path

    tok = tokenizer_fields(GGUFReader(gguf_path()))
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm(size: int = HIDDEN) -> np.ndarray:
        return (1.0 + rng.standard_normal(size) * 0.1).astype(np.float32)

    q_rows, kv_rows = HEADS * arch.head_dim, KV_HEADS * arch.head_dim
    writer = GGUFWriter(str(path), arch.name)
    writer.add_name(f"pdserve tiny {arch.name} (random)")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(arch.head_dim)
    if arch.name != "llama":  # (the llama files predate these keys: kept byte for byte)
        writer.add_key_length(arch.head_dim)
        writer.add_value_length(arch.head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    if arch.experts:
        writer.add_expert_count(arch.experts)
        writer.add_expert_used_count(arch.experts_used)
        writer.add_expert_feed_forward_length(arch.expert_ffn)
    writer.add_file_type(0)  # ALL_F32
    writer.add_tokenizer_model("gpt2")
    # The qwen files say "qwen2": transformers reads a qwen GGUF's tokenizer with Qwen2's
    # pre-tokenizer whatever the file says, and llama.cpp then splits text the same way.
    writer.add_tokenizer_pre(str(tok["pre"]) if arch.name == "llama" else "qwen2")
    writer.add_token_list(tok["tokens"])  # type: ignore[arg-type]
    writer.add_token_types(tok["token_types"])  # type: ignore[arg-type]
    writer.add_token_merges(tok["merges"])  # type: ignore[arg-type]
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(str(tok["chat_template"]))
    writer.add_key_value("general.quantization_version", 2, GGUFValueType.UINT32)
    f32 = GGMLQuantizationType.F32
    writer.add_tensor("token_embd.weight", normal(VOCAB, HIDDEN, std=0.5), raw_dtype=f32)
    writer.add_tensor("output_norm.weight", norm(), raw_dtype=f32)
    writer.add_tensor("output.weight", normal(VOCAB, HIDDEN), raw_dtype=f32)
    for i in range(LAYERS):
        b = f"blk.{i}"
        writer.add_tensor(f"{b}.attn_norm.weight", norm(), raw_dtype=f32)
        writer.add_tensor(f"{b}.ffn_norm.weight", norm(), raw_dtype=f32)
        writer.add_tensor(f"{b}.attn_q.weight", normal(q_rows, HIDDEN), raw_dtype=f32)
        writer.add_tensor(f"{b}.attn_k.weight", normal(kv_rows, HIDDEN), raw_dtype=f32)
        writer.add_tensor(f"{b}.attn_v.weight", normal(kv_rows, HIDDEN), raw_dtype=f32)
        if arch.qkv_bias:
            writer.add_tensor(f"{b}.attn_q.bias", normal(q_rows, std=0.2), raw_dtype=f32)
            writer.add_tensor(f"{b}.attn_k.bias", normal(kv_rows, std=0.2), raw_dtype=f32)
            writer.add_tensor(f"{b}.attn_v.bias", normal(kv_rows, std=0.2), raw_dtype=f32)
        if arch.qk_norm:
            writer.add_tensor(f"{b}.attn_q_norm.weight", norm(arch.head_dim), raw_dtype=f32)
            writer.add_tensor(f"{b}.attn_k_norm.weight", norm(arch.head_dim), raw_dtype=f32)
        writer.add_tensor(f"{b}.attn_output.weight", normal(HIDDEN, q_rows), raw_dtype=f32)
        if arch.experts:
            e, ffn = arch.experts, arch.expert_ffn
            # The router's logits spread a few units, so that top-k choices are not near-ties.
            writer.add_tensor(f"{b}.ffn_gate_inp.weight", normal(e, HIDDEN, std=0.3), raw_dtype=f32)
            writer.add_tensor(f"{b}.ffn_gate_exps.weight", normal(e, ffn, HIDDEN), raw_dtype=f32)
            writer.add_tensor(f"{b}.ffn_up_exps.weight", normal(e, ffn, HIDDEN), raw_dtype=f32)
            writer.add_tensor(f"{b}.ffn_down_exps.weight", normal(e, HIDDEN, ffn), raw_dtype=f32)
        else:
            writer.add_tensor(f"{b}.ffn_gate.weight", normal(FFN, HIDDEN), raw_dtype=f32)
            writer.add_tensor(f"{b}.ffn_up.weight", normal(FFN, HIDDEN), raw_dtype=f32)
            writer.add_tensor(f"{b}.ffn_down.weight", normal(HIDDEN, FFN), raw_dtype=f32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cache = Path(os.environ.get("LLAMA_CPP_CACHE", Path.home() / ".cache/pdserve/llama.cpp"))
    parser.add_argument("--quantize", default=str(cache / "bin" / "llama-quantize"))
    parser.add_argument("--out", default=str(OUT))
    parser.add_argument("--archs", default=",".join(ARCHS))
    parser.add_argument("--presets", help="these presets for every architecture")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for arch_name in args.archs.split(","):
        arch = ARCHS[arch_name]
        source = write_float_model(out / f"tiny-{arch.name}-F32.gguf.tmp", arch)
        presets = args.presets.split(",") if args.presets else ARCH_PRESETS[arch.name]
        for preset in presets:
            target = out / f"tiny-{arch.name}-{preset}.gguf"
            done = subprocess.run(
                [args.quantize, str(source), str(target), preset, "1"], capture_output=True,
                text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
                return 1
            print(f"{target.name}: {target.stat().st_size} bytes")
        source.unlink()
    build = cache / "bin" / "VERSION"
    (out / "VERSION").write_text(
        (build.read_text() if build.exists() else "llama.cpp (unknown build)\n")
        + "remake: python -m loadtest.baselines.make_kquant_files\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
