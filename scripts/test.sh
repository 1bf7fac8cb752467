#!/usr/bin/env bash
# Sets up everything the tests need, then runs lint, type checks and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --system
bash scripts/quant_tools.sh  # llm-compressor's venv: the tests quantize with the tool itself
.venv/bin/ruff check .
.venv/bin/mypy
.venv/bin/lint-imports  # the layer rules in pyproject.toml ([tool.importlinter])
bash scripts/gen_protos.sh --check
bash scripts/buf_lint.sh
.venv/bin/pdserve --log-level WARNING convert >/dev/null  # the default model, once
.venv/bin/python -m pytest -q --timeout 900 "$@"
