"""Makes tiny GPTQ and AWQ checkpoints with the tools themselves (issue 30): a random 2-layer
model per architecture, saved float16, quantized on the CPU by gptqmodel (GPTQ) or AutoAWQ
(AWQ, GEMM version) on random calibration tokens, and saved as the tool saves it. Beside
each, ``reference.json``: the sha256 of every quantized layer's weight as the tool itself
dequantizes it (float16 [N, K], row-major), so a test can check a reader bit for bit
without the tool.

Each tool runs in a venv of its own. AutoAWQ runs with transformers 4.51 and the CPU torch,
so the tests make the AWQ files themselves (scripts/quant_tools.sh makes that venv).
gptqmodel needs torch 2.14.1, whose build here is the CUDA one (6 GB), so the GPTQ files
are made once and committed under tests/data/gptq/ (about 1 MB each):

    python3 -m venv /tmp/gptqmodel && /tmp/gptqmodel/bin/pip install torch==2.14.1 gptqmodel==7.7.0
    GPTQMODEL_CPU_WORKERS=2 /tmp/gptqmodel/bin/python loadtest/baselines/make_gptq_awq_files.py \\
        --tool gptqmodel --out tests/data/gptq

The models: hidden 256, 4 heads of 64 (2 KV heads), MLP 512, vocabulary 512, weights drawn
with a standard deviation of 0.1 so that greedy output varies; no tokenizer (the tests
prompt with token ids).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 512, 256, 4, 2, 512, 2
ARCHS: dict[str, dict[str, Any]] = {
    "llama": {}, "qwen2": {}, "qwen3": {"head_dim": 64},
    # 4 experts of 256, 2 a token; the tools quantize each expert's three Linear layers.
    "qwen3_moe": {"head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 256, "norm_topk_prob": True},
}  # fmt: skip

# variant -> (architecture, settings)
GPTQ_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gptq-w4-g128": ("llama", {"bits": 4, "group_size": 128, "sym": True, "desc_act": False}),
    "llama-gptq-w4-g64-asym-actorder": (
        "llama", {"bits": 4, "group_size": 64, "sym": False, "desc_act": True},
    ),
    "llama-gptq-w8-g128": ("llama", {"bits": 8, "group_size": 128, "sym": True, "desc_act": False}),
    "qwen2-gptq-w4-g128-actorder": (
        "qwen2", {"bits": 4, "group_size": 128, "sym": True, "desc_act": True},
    ),
    "qwen3-gptq-w4-g128": ("qwen3", {"bits": 4, "group_size": 128, "sym": True, "desc_act": False}),
    "qwen3_moe-gptq-w4-g128": (
        "qwen3_moe", {"bits": 4, "group_size": 128, "sym": True, "desc_act": False},
    ),
}
AWQ_VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-awq-w4-g128": ("llama", {"w_bit": 4, "q_group_size": 128}),
    "qwen2-awq-w4-g64": ("qwen2", {"w_bit": 4, "q_group_size": 64}),
    # The router (mlp.gate, 4 rows) stays float: AutoAWQ's clip search takes rows in 64s.
    "qwen3_moe-awq-w4-g128": (
        "qwen3_moe", {"w_bit": 4, "q_group_size": 128, "modules_to_not_convert": ["mlp.gate"]},
    ),
}


def float_model(arch: str, path: Path, seed: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch, vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, **ARCHS[arch],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float16)
    if arch == "qwen2":  # transformers initializes biases to zero: give them values
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
    model.save_pretrained(path)
    return path


def calibration(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randint(3, VOCAB, (16, 64), generator=generator)


def digest(weight: torch.Tensor) -> str:
    return hashlib.sha256(weight.to(torch.float16).contiguous().numpy().tobytes()).hexdigest()


def write_reference(path: Path, weights: dict[str, torch.Tensor], tool: str) -> None:
    entries = {name: {"shape": list(w.shape), "sha256": digest(w)} for name, w in sorted(weights.items())}
    (path / "reference.json").write_text(json.dumps({"tool": tool, "weights": entries}, indent=1) + "\n")


def make_gptq(
    name: str, arch: str, settings: dict[str, Any], out: Path, seed: int, tokenizer: Path
) -> Path:
    from gptqmodel import GPTQModel, QuantizeConfig
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear
    from gptqmodel.utils.backend import BACKEND
    from transformers import PreTrainedTokenizerFast

    float_dir = float_model(arch, out / f".{name}-float", seed)
    # gptqmodel loads a tokenizer with the model (the files are left out of the output).
    PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer / "tokenizer.json"), eos_token="<|im_end|>"
    ).save_pretrained(float_dir)
    ids = calibration(seed)
    data = [{"input_ids": r.tolist(), "attention_mask": [1] * ids.shape[1]} for r in ids]
    model = GPTQModel.load(str(float_dir), QuantizeConfig(**settings), device="cpu")
    model.quantize(data, batch_size=4)
    path = out / name
    model.save(str(path))
    # As a user's run reads the file, on the tool's torch kernel in float16 (its AVX-512
    # kernel dequantizes to bfloat16, which the checkpoint's float16 scales do not ask for).
    loaded = GPTQModel.load(str(path), device="cpu", backend=BACKEND.TORCH, dtype=torch.float16)
    weights = {
        module: layer.dequantize_weight().t()
        for module, layer in loaded.model.named_modules()
        if isinstance(layer, BaseQuantLinear)
    }  # fmt: skip
    write_reference(path, weights, "gptqmodel")
    return path


def make_awq(
    name: str, arch: str, settings: dict[str, Any], out: Path, seed: int, tokenizer: Path
) -> Path:
    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors import safe_open

    float_dir = float_model(arch, out / f".{name}-float", seed)
    model = AutoAWQForCausalLM.from_pretrained(str(float_dir), device_map="cpu")
    config = {"zero_point": True, "version": "GEMM", **settings}
    model.quantize(
        None, quant_config=config, calib_data=calibration(seed).tolist(), max_calib_seq_len=64,
        n_parallel_calib_samples=4,
    )  # fmt: skip
    path = out / name
    model.save_quantized(str(path))
    weights = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118
            if key.endswith(".qweight"):
                module = key.removesuffix(".qweight")
                dense = dequantize_gemm(
                    f.get_tensor(key), f.get_tensor(f"{module}.qzeros"),
                    f.get_tensor(f"{module}.scales"), settings["w_bit"], settings["q_group_size"],
                )  # fmt: skip
                weights[module] = dense.t()
    write_reference(path, weights, "autoawq")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tool", choices=("gptqmodel", "autoawq"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer", type=Path, default=Path.home() / ".cache/pdserve/models/SmolLM2-135M-Instruct",
        help="a directory with a tokenizer.json (gptqmodel loads one with the model)",
    )  # fmt: skip
    parser.add_argument("--only", action="append", help="make these variants only")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    variants = GPTQ_VARIANTS if args.tool == "gptqmodel" else AWQ_VARIANTS
    make = make_gptq if args.tool == "gptqmodel" else make_awq
    for name, (arch, settings) in variants.items():
        if args.only and name not in args.only:
            continue
        start = time.perf_counter()
        path = make(name, arch, settings, args.out, args.seed, args.tokenizer)
        shutil.rmtree(args.out / f".{name}-float")
        for extra in ("quant_log.csv", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            (path / extra).unlink(missing_ok=True)
        print(f"{path.name}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
