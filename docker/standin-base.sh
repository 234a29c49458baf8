#!/usr/bin/env bash
# A stand-in for NGC's PyTorch image, for machines that cannot pull nvcr.io (this project's CI):
# Debian bookworm from Debian's own packages (debootstrap, no registry), its Python 3.11 and pip,
# the CPU build of torch that lies on this machine, and this machine's CA bundle so that pip inside
# the image can reach the package index. Tests build the real Dockerfile on it:
#
#   docker build --build-arg BASE_IMAGE="$(docker/standin-base.sh)" -t megatron-lowprec:standin .
#
# Prints the image's tag (the only line on stdout). The tag names the torch build and a hash of this
# script and the wheel's name, so an image already built from them is reused as it is; REBUILD=1
# builds it again. For tests only: the production image builds on NGC's image, never on this one.
#
# Environment:
#   TORCH_WHEEL   the CPU torch wheel to install (default: the cp311 wheel in /opt/wheels)
#   DEBIAN_MIRROR where debootstrap fetches bookworm (default http://deb.debian.org/debian)
#   CA_BUNDLE     the CA certificates pip inside the image trusts (default /etc/ssl/certs/ca-certificates.crt)
set -euo pipefail

repository=megatron-lowprec-standin
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
ca_bundle=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
if [[ -z "${TORCH_WHEEL:-}" ]]; then
    wheels=(/opt/wheels/torch-*+cpu-cp311-*.whl)
    TORCH_WHEEL=${wheels[0]}
fi
for file in "$TORCH_WHEEL" "$ca_bundle"; do
    if [[ ! -f $file ]]; then
        echo "standin-base.sh: $file does not exist (set TORCH_WHEEL / CA_BUNDLE)" >&2
        exit 2
    fi
done

wheel_name=$(basename "$TORCH_WHEEL")
torch_version=${wheel_name#torch-}
torch_version=${torch_version%%-*}
fingerprint=$({ cat "$0"; echo "$wheel_name"; } | sha256sum)
tag="$repository:torch${torch_version//+/-}-${fingerprint:0:12}"

if [[ "${REBUILD:-0}" != 1 ]] && docker image inspect "$tag" > /dev/null 2>&1; then
    echo "standin-base.sh: $tag is already built" >&2
    echo "$tag"
    exit 0
fi

for tool in debootstrap docker; do
    if ! command -v "$tool" > /dev/null 2>&1; then
        echo "standin-base.sh: $tool is not installed (apt-get install debootstrap docker.io)" >&2
        exit 2
    fi
done
if (( EUID != 0 )); then
    echo "standin-base.sh: debootstrap needs root" >&2
    exit 2
fi

rootfs=$(mktemp -d /tmp/standin-rootfs.XXXXXX)
trap 'rm -rf "$rootfs"' EXIT

echo "standin-base.sh: debootstrap bookworm into $rootfs" >&2
debootstrap --variant=minbase --include=python3,python3-pip bookworm "$rootfs" "$mirror" >&2

# pip in the image trusts this machine's CA bundle (a minimal Debian has none of its own). Like
# NGC's image, the image's Python takes packages from pip system-wide: no PEP 668 marker.
install -D -m 0644 "$ca_bundle" "$rootfs/etc/ssl/certs/ca-certificates.crt"
rm -f "$rootfs"/usr/lib/python3*/EXTERNALLY-MANAGED
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
cp "$TORCH_WHEEL" "$rootfs/tmp/$wheel_name"
echo "standin-base.sh: installing $wheel_name and its dependencies from the package index ($SECONDS s)" >&2
env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt PIP_DISABLE_PIP_VERSION_CHECK=1 \
    "$(command -v chroot)" "$rootfs" python3 -m pip install --no-cache-dir "/tmp/$wheel_name" >&2
rm -rf "$rootfs/tmp/$wheel_name" "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
: > "$rootfs/etc/resolv.conf"

echo "standin-base.sh: importing $tag ($SECONDS s)" >&2
tar --numeric-owner -C "$rootfs" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt' \
    --change 'ENV PIP_DISABLE_PIP_VERSION_CHECK=1' \
    --change 'CMD ["python3"]' \
    --message "stand-in for nvcr.io/nvidia/pytorch: Debian bookworm, Python 3.11, torch $torch_version" \
    - "$tag" > /dev/null
echo "standin-base.sh: built $tag in $SECONDS s" >&2
# Older stand-ins (built by an earlier version of this script) go; one still in use stays.
docker image ls --format '{{.Repository}}:{{.Tag}}' "$repository" | grep -vxF "$tag" | xargs -r docker rmi > /dev/null 2>&1 || true
echo "$tag"
