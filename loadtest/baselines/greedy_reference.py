"""A model's greedy tokens and logits on the parity prompts, and how far its logits move
under a tiny perturbation of its input embeddings: the reference the quantized-checkpoint
parity tests compare the engine with (tests/quant_parity.py). Only torch and a transformers
model: it runs in the quantization tools' own venvs too (make_ct_checkpoints.py records
llm-compressor's in-memory model with it where transformers cannot load the saved file).
"""

from __future__ import annotations

from typing import Any

import torch

PROMPTS = [[5, 77, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], list(range(40, 140)), [401] * 7]
NEW_TOKENS = 24
# Relative, of the input embeddings, three draws: float32 rounding's size times 100, so that
# a scheme whose activations are rounded to a static grid (FP8 with a calibrated scale) shows
# its jumps (at 1e-6 its logits of these sequences did not move at all, while the engine's
# differed from transformers' by 0.01-0.05 at a few positions: whole FP8 steps of a few
# activations). A smooth model moves by about 5e-4 at this size.
PERTURBATION = 1e-5
DRAWS = 3


def greedy_reference(
    model: Any, prompts: list[list[int]] | None = None, draws: int = DRAWS
) -> tuple[list[list[int]], list[torch.Tensor], float]:
    """(tokens per prompt, logits per prompt [NEW_TOKENS, V], largest logit movement over
    ``draws`` perturbations; 0 draws measure none) for ``prompts`` (default PROMPTS)."""
    model.generation_config.eos_token_id = None
    tokens, logits, moved = [], [], 0.0
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for prompt in PROMPTS if prompts is None else prompts:
            out = model.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            tokens.append(out.sequences[0, len(prompt) :].tolist())
            logits.append(torch.cat(out.logits).float())
            if not draws:
                continue
            embeds = model.get_input_embeddings()(out.sequences)
            steady = model(inputs_embeds=embeds).logits
            for _ in range(draws):
                noise = torch.randn(embeds.shape, generator=generator) * PERTURBATION
                shaken = model(inputs_embeds=embeds * (1 + noise)).logits
                moved = max(moved, (steady - shaken).abs().max().item())
    return tokens, logits, moved
