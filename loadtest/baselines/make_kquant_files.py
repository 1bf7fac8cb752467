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
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
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


def write_float_model(path: Path, seed: int = 0) -> Path:
    from common.models.default_model import gguf_path

    tok = tokenizer_fields(GGUFReader(gguf_path()))
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + rng.standard_normal(HIDDEN) * 0.1).astype(np.float32)

    writer = GGUFWriter(str(path), "llama")
    writer.add_name("pdserve tiny llama (random)")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HEAD_DIM)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_file_type(0)  # ALL_F32
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(str(tok["pre"]))
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
        writer.add_tensor(f"{b}.attn_q.weight", normal(HEADS * HEAD_DIM, HIDDEN), raw_dtype=f32)
        writer.add_tensor(f"{b}.attn_k.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN), raw_dtype=f32)
        writer.add_tensor(f"{b}.attn_v.weight", normal(KV_HEADS * HEAD_DIM, HIDDEN), raw_dtype=f32)
        writer.add_tensor(f"{b}.attn_output.weight", normal(HIDDEN, HEADS * HEAD_DIM), raw_dtype=f32)
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
    parser.add_argument("--presets", default=",".join(PRESETS))
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    source = write_float_model(out / "tiny-llama-F32.gguf.tmp")
    for preset in args.presets.split(","):
        target = out / f"tiny-llama-{preset}.gguf"
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
