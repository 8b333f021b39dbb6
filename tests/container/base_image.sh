#!/usr/bin/env bash
# Makes the base image the container tests build on: no image registry is
# reachable from CI, so `FROM ubuntu` cannot be pulled. A minimal Debian
# bookworm (python3, venv, pip) made with debootstrap from the Debian mirror
# apt already uses here, imported into podman. It trusts what this machine
# trusts: pip and apt inside builds go through the same network.
#
#   tests/container/base_image.sh [IMAGE]     (default localhost/sagelmi-base:bookworm)
#
# Does nothing when the image exists already. Needs root, debootstrap, podman.
set -euo pipefail
IMAGE=${1:-localhost/sagelmi-base:bookworm}
PODMAN=(podman --runtime runc)

if "${PODMAN[@]}" image exists "$IMAGE"; then
    echo "base image $IMAGE exists"
    exit 0
fi

# The Debian mirror apt is configured with (deb822 or one-line sources).
MIRROR=$(cat /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
         | grep -oE '^(URIs:|deb) +[^ ]+' | awk '{print $2}' | grep -v security | head -n1 || true)
MIRROR=${MIRROR:-http://deb.debian.org/debian}

ROOT=$(mktemp -d /var/tmp/sagelmi-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
started=$SECONDS
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 || { tail -n 30 "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"

# This machine's extra certificate authorities, and pip told to use the system store.
cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/" 2>/dev/null || true
chroot "$ROOT" update-ca-certificates >/dev/null
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$ROOT/etc/pip.conf"
rm -rf "$ROOT"/var/cache/apt/archives/*.deb "$ROOT"/var/lib/apt/lists/*

tar -C "$ROOT" -c . | "${PODMAN[@]}" import - "$IMAGE" >/dev/null
echo "base image $IMAGE made in $((SECONDS - started)) s"
