#!/usr/bin/env bash
# Builds deploy/Dockerfile with podman: the image every role of the Helm chart runs.
#
#   bash deploy/build_image.sh            -> localhost/pdserve:<version in pyproject.toml>
#   bash deploy/build_image.sh --print    prints the podman build command, runs nothing
#
# Settings (environment):
#   IMAGE           the tag to build (default localhost/pdserve:<version>)
#   BASE_IMAGE      the base of both stages. Unset: python:3.11-slim-bookworm where a
#                   registry answers, else a Debian bookworm root made here by debootstrap
#                   (minbase + Python 3.11), imported once and kept (localhost/pdserve-base)
#   DEBIAN_MIRROR   where debootstrap fetches from (default http://deb.debian.org/debian)
#   KERNEL_TARGETS  the C++ kernels' CPU targets (default: the Dockerfile's, every x86-64
#                   level the kernels have: about four minutes each on 2 cores)
#   TORCH_INDEX     PyTorch's wheel index; unset: theirs where it answers, else pip's own
#                   settings (a mirror, or a find-links folder holding torch)
# The package index is this machine's: PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_FIND_LINKS
# and PIP_CERT, from the environment or pip's configuration, are passed as build arguments,
# and the local folders and CA file they name are mounted read-only into the build (so a
# mirror behind a private CA works, and none of it stays in the image).
set -euo pipefail
cd "$(dirname "$0")/.."
PRINT_ONLY=0
[[ "${1:-}" != --print ]] || PRINT_ONLY=1
((PRINT_ONLY)) || source deploy/podman_env.sh

VERSION=$(sed -n 's/^version = "\(.*\)"$/\1/p' pyproject.toml | head -n 1)
IMAGE="${IMAGE:-localhost/pdserve:$VERSION}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
UPSTREAM_BASE=docker.io/library/python:3.11-slim-bookworm
LOCAL_BASE=localhost/pdserve-base:bookworm

make_base() {
  # A bookworm root with what python:3.11-slim gives the Dockerfile: python (3.11), venv,
  # CA certificates. debootstrap needs root (or fakeroot + fakechroot).
  local root="$PDSERVE_IMAGE_CACHE/rootfs-bookworm"
  rm -rf "$root"
  echo "build_image: making $LOCAL_BASE with debootstrap from $DEBIAN_MIRROR (about a minute)" >&2
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,ca-certificates \
    bookworm "$root" "$DEBIAN_MIRROR" >"$PDSERVE_IMAGE_CACHE/debootstrap.log" 2>&1 \
    || { tail -n 20 "$PDSERVE_IMAGE_CACHE/debootstrap.log" >&2; return 1; }
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/log/*.log
  tar --numeric-owner -C "$root" -c . \
    | podman import --change 'CMD ["/bin/bash"]' \
        --message "debootstrap --variant=minbase bookworm $DEBIAN_MIRROR" - "$LOCAL_BASE" >/dev/null
  rm -rf "$root"
}

if ((PRINT_ONLY)); then
  BASE_IMAGE="${BASE_IMAGE:-<python:3.11-slim-bookworm, else $LOCAL_BASE>}"
elif [[ -z "${BASE_IMAGE:-}" ]]; then
  if podman image exists "$UPSTREAM_BASE" \
      || timeout 120 podman pull -q "$UPSTREAM_BASE" >/dev/null 2>&1; then
    BASE_IMAGE=$UPSTREAM_BASE
  else
    echo "build_image: no registry answers for $UPSTREAM_BASE; using $LOCAL_BASE" >&2
    podman image exists "$LOCAL_BASE" || make_base
    BASE_IMAGE=$LOCAL_BASE
  fi
fi

# pip's settings here: the environment first, then pip's configuration files.
pip_setting() {
  local env_name=$1 key=$2 value
  value="${!env_name:-}"
  if [[ -z "$value" ]]; then
    value=$(python3 -m pip config get "global.$key" 2>/dev/null || true)
  fi
  printf '%s' "$value"
}
build_args=()
mounts=()
mount_local() {  # a file:// URL or an absolute path: mounted read-only at the same path
  local path=${1#file://}
  path=${path%/}
  [[ "$path" == /* && -e "$path" ]] || return 0
  # A local index's pages link to their files by relative paths (../../files/x.whl in a
  # simple index), so an index brings its parent folder.
  [[ "$2" == find-links ]] || path=$(dirname "$path")
  mounts+=(--volume "$path:$path:ro")
}
for setting in PIP_INDEX_URL:index-url PIP_EXTRA_INDEX_URL:extra-index-url PIP_FIND_LINKS:find-links; do
  value=$(pip_setting "${setting%%:*}" "${setting#*:}")
  [[ -n "$value" ]] || continue
  build_args+=(--build-arg "${setting%%:*}=$value")
  for location in $value; do mount_local "$location" "${setting#*:}"; done
done
cert=$(pip_setting PIP_CERT cert)
if [[ -n "$cert" && -f "$cert" ]]; then
  mounts+=(--volume "$cert:/run/pdserve-build-ca.crt:ro")
  build_args+=(--build-arg PIP_CERT=/run/pdserve-build-ca.crt)
fi
if [[ -z "${TORCH_INDEX+set}" ]]; then
  if python3 -c "import urllib.request as u; u.urlopen('https://download.pytorch.org/whl/cpu/torch/', timeout=10)" 2>/dev/null; then
    TORCH_INDEX=https://download.pytorch.org/whl
  else
    echo "build_image: download.pytorch.org does not answer; torch comes from pip's own index" >&2
    TORCH_INDEX=
  fi
fi
build_args+=(--build-arg "TORCH_INDEX=$TORCH_INDEX" --build-arg "BASE_IMAGE=$BASE_IMAGE")
[[ -z "${KERNEL_TARGETS:-}" ]] || build_args+=(--build-arg "KERNEL_TARGETS=$KERNEL_TARGETS")

# --format docker: the OCI format has no SHELL, and the Dockerfile's RUNs are bash.
command=(podman build --format docker --network host --pull=never --layers
  --file deploy/Dockerfile --ignorefile deploy/Dockerfile.dockerignore
  "${build_args[@]}" "${mounts[@]}" --tag "$IMAGE" .)
if ((PRINT_ONLY)); then
  printf '%q ' "${command[@]}"
  echo
  exit 0
fi
echo "build_image: building $IMAGE from $BASE_IMAGE" >&2
start=$SECONDS
"${command[@]}"
size=$(podman image inspect --format '{{.Size}}' "$IMAGE")
echo "build_image: $IMAGE built in $((SECONDS - start)) s, $((size / 1000000)) MB"
