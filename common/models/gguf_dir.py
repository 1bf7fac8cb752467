"""The checkpoint directory beside a GGUF file: its config and tokenizer written once from the
file's metadata into the cache, and a link to the file (common/models/quant/gguf.py reads
the tensors). No torch here: the gateway resolves its model directory through this."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

_PREPARED_MARKER = ".pdserve-gguf"


# Bumped when what is written changes (2: the MoE and head_dim fields of _llama_cpp_fields),
# so that a directory prepared by an older version is prepared again.
_PREPARE_VERSION = 2


def _file_key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{_PREPARE_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def prepared_dir(path: Path, cache: Path) -> Path:
    return cache / "gguf" / f"{path.stem}-{_file_key(path)}"


def link_gguf(directory: Path, path: Path) -> None:
    """Puts a link to ``path`` in ``directory`` (replacing a stale one)."""
    link = directory / path.name
    if link.is_symlink() or link.exists():
        if link.resolve() == path.resolve():
            return
        link.unlink()
    link.symlink_to(path.resolve())


@contextlib.contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A scratch directory beside ``target`` to write into; when the block ends it replaces
    ``target`` whole (a reader never sees a half-written one), and on an error it is removed."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    staging.chmod(0o755)
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _llama_cpp_fields(path: Path, model_type: str) -> dict[str, object]:
    """Config fields transformers' GGUF reader (5.24) leaves at its defaults though the file
    says otherwise, set as llama.cpp runs the file: Qwen3's head_dim (``key_length``; the
    default 128 happens to be every released Qwen3's), the MoE models' expert sizes
    (``expert_feed_forward_length``, ``expert_shared_feed_forward_length``) and Qwen3-MoE's
    normalized top-k weights (llama.cpp's qwen3moe graph always normalizes them, as the
    released models' ``norm_topk_prob: true`` asks; transformers' default is false)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    arch = str(reader.fields["general.architecture"].contents())

    def number(key: str) -> int | None:
        field = reader.fields.get(f"{arch}.{key}")
        return None if field is None else int(field.contents())

    fields: dict[str, object] = {}
    if model_type in ("qwen3", "qwen3_moe") and number("attention.key_length"):
        fields["head_dim"] = number("attention.key_length")
    if model_type in ("qwen2_moe", "qwen3_moe") and number("expert_feed_forward_length"):
        fields["moe_intermediate_size"] = number("expert_feed_forward_length")
    if model_type == "qwen2_moe" and number("expert_shared_feed_forward_length"):
        fields["shared_expert_intermediate_size"] = number("expert_shared_feed_forward_length")
    if model_type == "qwen3_moe":
        fields["norm_topk_prob"] = True
    return fields


def prepare_checkpoint_dir(path: Path, cache: Path) -> Path:
    """A checkpoint directory for a GGUF file: config.json, generation config and tokenizer
    written from the file's metadata once, and a link to the file."""
    target = prepared_dir(path, cache)
    if (target / _PREPARED_MARKER).is_file():
        return target
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with staged_directory(target) as staging:
        log.info("reading %s's config and tokenizer (once)", path.name)
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        for key, value in _llama_cpp_fields(path, config.model_type).items():
            setattr(config, key, value)
        config.save_pretrained(staging)
        GenerationConfig.from_model_config(config).save_pretrained(staging)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(staging)
        link_gguf(staging, path)
        (staging / _PREPARED_MARKER).write_text(f"{path.resolve()}\n")
    return target
