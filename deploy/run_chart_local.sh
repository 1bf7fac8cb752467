#!/usr/bin/env bash
# Runs every pod of the Helm chart from the image, each under its own pod spec, on this
# machine with podman, and checks them (deploy/chart_local.py says how and what):
#
#   bash deploy/build_image.sh && bash deploy/run_chart_local.sh
#   bash deploy/run_chart_local.sh --keep          leave the containers running afterwards
#   bash deploy/run_chart_local.sh --set decode.replicas=3
#
# IMAGE (default localhost/pdserve:<version>) is the image to run. Redis runs the chart's
# own image (docker.io/library/redis) where a registry answers, else Debian's redis-server
# on the base deploy/build_image.sh made (localhost/pdserve-redis:bookworm).
set -euo pipefail
cd "$(dirname "$0")/.."
source deploy/podman_env.sh

VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
IMAGE="${IMAGE:-localhost/pdserve:$VERSION}"
if ! podman image exists "$IMAGE"; then
  echo "run_chart_local: no image $IMAGE here: build it first (bash deploy/build_image.sh)" >&2
  exit 1
fi
CHART_REDIS=docker.io/library/redis:$(sed -n '/^redis:/,/^[a-z]/s/^    tag: "\(.*\)"$/\1/p' deploy/helm/pdserve/values.yaml)
if podman image exists "$CHART_REDIS" || timeout 120 podman pull -q "$CHART_REDIS" >/dev/null 2>&1; then
  REDIS_IMAGE=$CHART_REDIS
else
  REDIS_IMAGE=localhost/pdserve-redis:bookworm
  if ! podman image exists "$REDIS_IMAGE"; then
    if ! podman image exists localhost/pdserve-base:bookworm; then
      echo "run_chart_local: no registry answers for $CHART_REDIS, and no local base to build" \
           "Redis on: run bash deploy/build_image.sh first" >&2
      exit 1
    fi
    echo "run_chart_local: no registry answers for $CHART_REDIS; building $REDIS_IMAGE" >&2
    podman build --format docker --network host --pull=never --tag "$REDIS_IMAGE" - <<'CONTAINERFILE' >/dev/null
FROM localhost/pdserve-base:bookworm
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/*
CONTAINERFILE
  fi
fi
# The chart is rendered, and the host-side checks run, with the project's own tooling.
[[ -x .venv/bin/python ]] || bash scripts/setup.sh
exec .venv/bin/python deploy/chart_local.py --image "$IMAGE" --redis-image "$REDIS_IMAGE" "$@"
