"""gptqmodel on the CPU, for loadtest/bench_formats.py's GPTQ row: quantizes a checkpoint to
GPTQ 4-bit (group 64, symmetric, gptqmodel's own GPTQ on random calibration tokens, or on
``--calibration-text``) once,
then times gptqmodel's single-stream greedy decode of it (transformers' generate over its
CPU kernels), so both engines run the same file.

    GPTQMODEL_CPU_WORKERS=2 /tmp/gptqmodel/bin/python loadtest/baselines/gptqmodel_decode.py \\
        --model ~/.cache/pdserve/bench-quant/SmolLM2-135M-Instruct-bf16 \\
        --out ~/.cache/pdserve/bench-quant/SmolLM2-135M-Instruct-gptq-w4-g64

(the venv as loadtest/baselines/make_gptq_awq_files.py makes it).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument(
        "--calibration-text", type=Path,
        help="calibrate on 128 windows of 256 tokens of this text instead of random tokens",
    )  # fmt: skip
    args = parser.parse_args()
    from gptqmodel import GPTQModel, QuantizeConfig

    if not (args.out / "config.json").exists():
        if args.calibration_text is not None:
            from transformers import AutoTokenizer

            text = args.calibration_text.read_text(encoding="utf-8")
            tokens = AutoTokenizer.from_pretrained(str(args.model))(text, add_special_tokens=False)
            ids = torch.tensor(tokens.input_ids[: 128 * 256]).view(128, 256)
        else:
            generator = torch.Generator().manual_seed(1)
            ids = torch.randint(100, 49152, (64, 64), generator=generator)
        data = [{"input_ids": r.tolist(), "attention_mask": [1] * ids.shape[1]} for r in ids]
        config = QuantizeConfig(bits=4, group_size=64, sym=True, desc_act=False)
        model = GPTQModel.load(str(args.model), config, device="cpu")
        model.quantize(data, batch_size=8)
        model.save(str(args.out))
    model = GPTQModel.load(str(args.out), device="cpu")
    prompt = torch.randint(100, 49152, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False)  # warm-up
        best = 0.0
        for _ in range(3):
            start = time.perf_counter()
            out = model.generate(input_ids=prompt, max_new_tokens=args.tokens, min_new_tokens=args.tokens,
                                 do_sample=False)  # fmt: skip
            elapsed = time.perf_counter() - start
            best = max(best, (out.shape[1] - prompt.shape[1]) / elapsed)
    from gptqmodel.nn_modules.qlinear import BaseQuantLinear

    kernel = {type(m).__name__ for m in model.model.modules() if isinstance(m, BaseQuantLinear)}
    print(f"gptqmodel decode: {best:.1f} tok/s single stream (prefill included), kernels {kernel}")


if __name__ == "__main__":
    main()
