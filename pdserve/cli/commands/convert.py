"""``pdserve convert``: write the default model's safetensors checkpoint into the cache."""

from __future__ import annotations

import argparse
from pathlib import Path

from common.models.default_model import convert_default_model, default_model_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert", help="convert the bundled SmolLM2 GGUF into a safetensors checkpoint (once)"
    )
    parser.add_argument("--output", type=Path, default=None, help=f"default: {default_model_dir()}")
    parser.add_argument("--force", action="store_true", help="convert again even if present")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    print(convert_default_model(args.output, force=args.force))
    return 0
