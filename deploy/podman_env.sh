# Sourced by deploy/build_image.sh and deploy/run_chart_local.sh: podman ready to run here.
#
# Installs podman, runc and debootstrap from Debian's packages when they are missing, and
# points podman at a containers.conf of ours (unless CONTAINERS_CONF names one already):
# runc as the runtime, and no default ulimits, which some machines refuse to raise.
# PDSERVE_IMAGE_CACHE (default ~/.cache/pdserve/image) keeps it and the base image's rootfs.

PDSERVE_IMAGE_CACHE="${PDSERVE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve/image}"
mkdir -p "$PDSERVE_IMAGE_CACHE"

missing=()
for tool in podman:podman runc:runc debootstrap:debootstrap; do
  command -v "${tool%%:*}" >/dev/null 2>&1 || missing+=("${tool#*:}")
done
if ((${#missing[@]})); then
  sudo_=()
  [[ $(id -u) == 0 ]] || sudo_=(sudo)
  echo "podman_env: installing ${missing[*]} (Debian packages)" >&2
  "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null \
    || { "${sudo_[@]}" apt-get update -q >/dev/null \
         && "${sudo_[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null; }
fi

if [[ -z "${CONTAINERS_CONF:-}" ]]; then
  CONTAINERS_CONF="$PDSERVE_IMAGE_CACHE/containers.conf"
  cat > "$CONTAINERS_CONF" <<'EOF'
# Written by deploy/podman_env.sh.
[containers]
default_ulimits = []

[engine]
runtime = "runc"
EOF
fi
export CONTAINERS_CONF PDSERVE_IMAGE_CACHE
