#!/bin/sh
# A Debian base image for docker/Dockerfile made without an image registry: debootstrap a minimal bookworm
# with Python 3.11 (the version the host's CPU torch wheel is built for) from Debian's packages, then
# `docker import` it. `swarm testbed compose-run` runs this when it cannot pull the default base image;
# pass the result as the build argument BASE_IMAGE.
#   docker/make-base-image.sh [TAG]        (default swarm-base:bookworm; needs root, debootstrap, a docker engine)
# ROOTFS=DIR keeps the tree in DIR and reuses it on the next run (a tree without python3 is made anew);
# DEBIAN_MIRROR overrides debootstrap's default mirror.
set -eu

tag="${1:-swarm-base:bookworm}"
suite=bookworm
packages=python3,python3-venv,python3-dev,ca-certificates

if [ -n "${ROOTFS:-}" ]; then
    root="$ROOTFS"
    mkdir -p "$root"
else
    root=$(mktemp -d)
    trap 'rm -rf "$root"' EXIT
fi

if [ ! -x "$root/usr/bin/python3" ]; then
    rm -rf "${root:?}"/*
    # shellcheck disable=SC2086
    debootstrap --variant=minbase --include="$packages" "$suite" "$root" ${DEBIAN_MIRROR:-}
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
fi

tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    --change 'CMD ["/bin/sh"]' - "$tag"
