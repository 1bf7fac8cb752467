"""Makes tiny compressed-tensors checkpoints with llm-compressor itself (issue 30): a random
2-layer model per architecture, saved as safetensors, then quantized by ``oneshot`` with
the scheme's modifier (GPTQ for the integer weight-only schemes, round-to-nearest for W8A8
and FP8) on random calibration tokens, and saved compressed, as a user's run of the tool
writes it.

llm-compressor pins a transformers older than the engine's, so it runs in a venv of its own
(scripts/quant_tools.sh makes it); the tests call this module with that venv's Python:

    bash scripts/quant_tools.sh
    ~/.cache/pdserve/venvs/llmcompressor/bin/python loadtest/baselines/make_ct_checkpoints.py \\
        --out /tmp/ct --tokenizer ~/.cache/pdserve/models/SmolLM2-135M-Instruct

Each checkpoint lands in ``OUT/<arch>-<scheme>/`` (config, tokenizer, safetensors), the
float model it came from in ``OUT/<arch>-float/``. The models: hidden 256, 4 heads of 64
(2 KV heads), MLP 512, vocabulary 1024, float32 (so the scales are float32; llama_bf16 is
bfloat16), weights drawn with a standard deviation of 0.1 so that greedy output varies.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 1024, 256, 4, 2, 512, 2

ARCHS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},  # q/k/v biases
    "qwen3": {"head_dim": 64},  # q/k norms
    # Mixture of experts: 4 experts of 256, 2 per token, every layer sparse. llm-compressor
    # takes transformers 5's fused experts apart into one Linear per projection per expert
    # and saves them so; the router (mlp.gate) stays float, as the tool's MoE examples leave it.
    "qwen3_moe": {"head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 256, "norm_topk_prob": True},
}

# scheme -> (modifier, its arguments). GPTQ where the tool uses it for weight-only integer
# schemes; QuantizationModifier (round to nearest, observers on calibration data) else.
SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "w4a16": ("gptq", {"scheme": "W4A16"}),
    "w4a16-asym": ("gptq", {"scheme": "W4A16_ASYM"}),
    "w4a16-g32-actorder": ("gptq", {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": 32, "actorder": "weight",
            },
        }},
    }),
    # Group 64: the default model's 576-wide inputs do not split into groups of 128.
    "w4a16-g64": ("gptq", {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                "group_size": 64,
            },
        }},
    }),
    "w4a16-channel": ("gptq", {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"},
        }},
    }),
    "w8a16": ("gptq", {"scheme": "W8A16"}),
    "w8a8": ("rtn", {"scheme": "W8A8"}),
    "fp8": ("rtn", {"scheme": "FP8"}),
    "fp8-dynamic": ("rtn", {"scheme": "FP8_DYNAMIC"}),
}

# Which schemes each model gets: every scheme on llama, the common three elsewhere, and the
# symmetric weight-only ones on a bfloat16 llama (bfloat16 scales, as most checkpoints
# have: the engine holds those in its Q4 / Q8 layouts, exactly).
PLAN: dict[str, tuple[str, ...]] = {
    "llama": tuple(s for s in SCHEMES if s != "w4a16-g64"),
    "qwen2": ("w4a16", "w8a8", "fp8-dynamic"),
    "qwen3": ("w4a16", "w8a8", "fp8-dynamic"),
    "qwen3_moe": ("w4a16", "w8a8", "fp8-dynamic"),
    "llama_bf16": ("w4a16", "w8a16"),
}
DTYPES = {"llama_bf16": torch.bfloat16}
# Checkpoints transformers (5.24, the engine's) cannot load: it fails to fold the saved
# per-expert int8 / FP8 weights of an activation-quantized MoE back into its fused experts
# (W8A8: a conversion error; FP8: experts left at random values). For those, the tool's own
# in-memory model (its quantized forward, activations quantized as the scheme says) records
# the greedy reference (greedy_reference.py) beside the checkpoint, as tool_reference.pt.
TOOL_REFERENCE = {("qwen3_moe", "w8a8"), ("qwen3_moe", "fp8-dynamic")}


def float_model(arch: str, out: Path, tokenizer: Path, seed: int) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(
        arch.removesuffix("_bf16"), vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        max_position_embeddings=1024, initializer_range=0.1, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, **ARCHS[arch.removesuffix("_bf16")],
    )  # fmt: skip
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=DTYPES.get(arch, torch.float32))
    if arch == "qwen2":  # transformers initializes biases to zero: give them values
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
    path = out / f"{arch}-float"
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(tokenizer)).save_pretrained(path)
    return path


def quantize(
    float_dir: Path,
    scheme: str,
    out: Path,
    seed: int,
    name: str | None = None,
    samples: int = 16,
    record: bool = False,
    calibration: torch.Tensor | None = None,
) -> Path:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from transformers import AutoTokenizer

    kind, kwargs = SCHEMES[scheme]
    modifier = GPTQModifier if kind == "gptq" else QuantizationModifier
    recipe = modifier(targets="Linear", ignore=["lm_head", "re:.*mlp.gate$"], **kwargs)
    if calibration is not None:
        ids = calibration
    else:
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(3, VOCAB, (samples, 64), generator=generator)
    data = Dataset.from_dict(
        {"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()}
    )
    model = oneshot(
        model=str(float_dir), dataset=data, recipe=recipe, max_seq_length=ids.shape[1],
        num_calibration_samples=ids.shape[0],
    )  # fmt: skip
    arch = name or float_dir.name.removesuffix("-float")
    path = out / f"{arch}-{scheme}"
    reference = None
    if record or (arch, scheme) in TOOL_REFERENCE:
        try:
            from greedy_reference import greedy_reference  # run as a file (the tools' venvs)
        except ImportError:
            from loadtest.baselines.greedy_reference import greedy_reference
        with per_token_inputs(model):
            tokens, logits, moved = greedy_reference(model.eval())
        reference = {"tokens": tokens, "logits": logits, "moved": moved}
    model.save_pretrained(path, save_compressed=True)
    if reference is not None:
        torch.save(reference, path / "tool_reference.pt")
    AutoTokenizer.from_pretrained(str(float_dir)).save_pretrained(path)
    return path


@contextlib.contextmanager
def per_token_inputs(model: torch.nn.Module) -> Iterator[None]:
    """Within: each quantized Linear whose input is 2-D (the linearized experts' are: [n, H])
    is given it as [1, n, H]. compressed-tensors computes a dynamic per-token activation scale
    over every dimension but the first two, so on a 2-D input it takes one scale for the whole
    tensor; as [1, n, H] each token gets its own, as the scheme says and as it does for the
    dense layers (whose inputs are [batch, tokens, H])."""
    handles = []
    lifted: set[int] = set()  # the modules whose current call was given [1, n, H]

    def lift(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if args[0].dim() != 2:
            return None
        lifted.add(id(module))
        return (args[0].unsqueeze(0), *args[1:])

    def lower(module: torch.nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
        if id(module) not in lifted:
            return out
        lifted.discard(id(module))
        return out.squeeze(0)

    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if isinstance(module, torch.nn.Linear) and scheme is not None and scheme.input_activations:
            handles.append(module.register_forward_pre_hook(lift))
            handles.append(module.register_forward_hook(lower))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def text_calibration(tokenizer: Path, text: Path, samples: int, length: int) -> torch.Tensor:
    """``samples`` windows of ``length`` tokens of ``text``, consecutive from its start:
    real text, as a user calibrates (random tokens make GPTQ fit noise: the default model
    quantized so lost 65 % of its perplexity)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(tokenizer))(
        text.read_text(encoding="utf-8"), add_special_tokens=False
    ).input_ids
    if len(ids) < samples * length:
        raise ValueError(f"{text} has {len(ids)} tokens; {samples} x {length} are needed")
    return torch.tensor(ids[: samples * length]).view(samples, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, required=True, help="a local tokenizer dir")
    parser.add_argument("--arch", action="append", choices=sorted(PLAN), help="default: all")  # model
    parser.add_argument("--scheme", action="append", choices=sorted(SCHEMES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record-all", action="store_true",
                        help="record the tool's greedy reference for every checkpoint")  # fmt: skip
    parser.add_argument(
        "--model", type=Path,
        help="quantize this checkpoint (e.g. the default model's, for the benchmark) with "
        "--scheme instead of the tiny random ones",
    )  # fmt: skip
    parser.add_argument(
        "--calibration-text", type=Path,
        help="with --model: calibrate on 128 windows of 256 tokens of this text instead of "
        "random tokens",
    )  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.model is not None:
        calibration = None
        if args.calibration_text is not None:
            calibration = text_calibration(args.model, args.calibration_text, 128, 256)
        for scheme in args.scheme or ["w4a16-g64", "w8a8"]:
            start = time.perf_counter()
            path = quantize(
                args.model, scheme, args.out, args.seed, args.model.name, samples=64,
                calibration=calibration,
            )  # fmt: skip
            print(f"{path.name}: {time.perf_counter() - start:.1f} s", flush=True)
        return
    for arch in args.arch or list(PLAN):
        float_dir = float_model(arch, args.out, args.tokenizer, args.seed)
        for scheme in PLAN[arch]:
            if args.scheme and scheme not in args.scheme:
                continue
            start = time.perf_counter()
            path = quantize(float_dir, scheme, args.out, args.seed, record=args.record_all)
            print(f"{path.name}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
