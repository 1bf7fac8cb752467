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


def _file_key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
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
        config.save_pretrained(staging)
        GenerationConfig.from_model_config(config).save_pretrained(staging)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(staging)
        link_gguf(staging, path)
        (staging / _PREPARED_MARKER).write_text(f"{path.resolve()}\n")
    return target
