#!/usr/bin/env bash
# Refreshes requirements.lock, the exact dependency set scripts/setup.sh installs: a fresh
# virtualenv gets pdserve with every extra the tests use (torch pinned to the CPU build) as
# the registries resolve it today, and pip freeze writes down each version. Run it, run the
# tests (bash scripts/test.sh), and commit the lock with what made you refresh it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
"$PYTHON" -m venv "$scratch/venv"
PIP=("$scratch/venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
"${PIP[@]}" -e ".[dev,convert,triton,bench]"
# tritonclient, the real client of the KServe v2 tests, declares protobuf<7 while the stubs
# here need 7; its own stubs load on protobuf 7 unchanged (gencode one major older, which
# the runtime accepts). So it comes without its declared deps, and its imports by name.
"${PIP[@]}" --no-deps "tritonclient==2.73.0" "python-rapidjson>=1.20" "ml-dtypes<=0.5.4"
{
  echo "# Every package the tests run with, exactly (scripts/setup.sh installs these with"
  echo "# --no-deps). Written by scripts/lock.sh from a fresh resolution; do not edit by hand."
  echo "# torch is the CPU build: == matches the +cpu wheel (PIP_FIND_LINKS or PyTorch's CPU index)."
  "$scratch/venv/bin/python" -m pip freeze --exclude-editable --disable-pip-version-check \
    | sed -E 's/^torch==([0-9.]+)\+cpu$/torch==\1/'
} > requirements.lock
echo "requirements.lock: $(grep -vc '^#' requirements.lock) packages"
