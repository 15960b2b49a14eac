#!/usr/bin/env bash
# Builds the Debian 12 base image that deploy/docker/Dockerfile starts FROM, with debootstrap from
# Debian's own packages, for machines that reach Debian's mirror but no image registry. The image
# gets the exact name the Dockerfile's FROM uses, so the Dockerfile stays as a user builds it.
#   scripts/docker_base_image.sh [DOCKERFILE]     (root; a running Docker engine)
# Nothing is done when an image of that name exists. The root filesystem is a minbase bookworm
# (apt, bash, coreutils) with the official image's three apt sources; it is the current bookworm
# point release, which may be newer than the tag says (/etc/debian_version tells).
set -euo pipefail
cd "$(dirname "$0")/.."
DOCKERFILE="${1:-deploy/docker/Dockerfile}"
DOCKER="${DOCKER:-docker}"
MIRROR="${MOELORA_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
TAG="$(awk 'toupper($1) == "FROM" { print $2; exit }' "$DOCKERFILE")"
case "$TAG" in
  debian:12*|debian:bookworm*) ;;
  *) echo "docker_base_image: $DOCKERFILE starts FROM '$TAG', not a Debian 12 image" >&2; exit 2 ;;
esac
if "$DOCKER" image inspect "$TAG" > /dev/null 2>&1; then
  echo "docker_base_image: $TAG exists"
  exit 0
fi
command -v debootstrap > /dev/null || { echo "docker_base_image: debootstrap not installed" >&2; exit 2; }
ROOTFS="$PWD/.cache/docker-rootfs"
rm -rf "$ROOTFS"
trap 'rm -rf "$ROOTFS"' EXIT
SECONDS=0
debootstrap --variant=minbase bookworm "$ROOTFS" "$MIRROR" > "$PWD/.cache/debootstrap.log" 2>&1 \
  || { tail -20 "$PWD/.cache/debootstrap.log" >&2; exit 1; }
# The sources of the official debian:12 images (deb822), in place of debootstrap's one line.
rm -f "$ROOTFS/etc/apt/sources.list"
cat > "$ROOTFS/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $MIRROR
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
# As in the official images: no package caches or man pages left in layers built on top.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*
tar -C "$ROOTFS" --numeric-owner -c . | "$DOCKER" import --change 'CMD ["bash"]' - "$TAG" > /dev/null
echo "docker_base_image: $TAG from debootstrap ($(cat "$ROOTFS/etc/debian_version")) in ${SECONDS}s"
