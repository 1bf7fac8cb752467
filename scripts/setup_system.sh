#!/usr/bin/env bash
# Debian packages for the integration tests: a real redis-server, and Node.js for the
# cross-language client test. Installs only what is missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null || need+=(redis-server)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
if ((${#need[@]})); then
  SUDO=""
  [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi
echo "system: redis-server $(redis-server --version | awk '{print $3}'), node $(node --version)"
