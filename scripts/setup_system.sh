#!/usr/bin/env bash
# What the integration tests need outside Python: a real redis-server, Node.js for the
# cross-language client test and that test's npm packages, and curl (the HTTP API's SSE
# test). Installs only what is missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
command -v curl >/dev/null || need+=(curl)
if ((${#need[@]})); then
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
# The Node.js client test's dependencies, exactly as tests/node/package-lock.json pins them.
node_dir="$(dirname "$0")/../tests/node"
if [[ ! -d "$node_dir/node_modules" ]]; then
  npm ci --prefix "$node_dir" --no-audit --no-fund
fi
echo "system: redis-server $(redis-server --version | awk '{print $3}'), node $(node --version)"
