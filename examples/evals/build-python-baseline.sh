#!/usr/bin/env bash
# Build a Python-capable rootfs baseline from Debian packages (debootstrap), once, and cache it.
#
#   pytest examples/evals --smol-baseline="$(bash examples/evals/build-python-baseline.sh)"
#
# Prints the path of the cached rootfs tarball. Needs root and debootstrap
# (apt-get install -y debootstrap). On the smol backend, a registry image does the same job:
# --smol-baseline=python:3.12-slim.
set -euo pipefail

suite=${SUITE:-bookworm}
mirror=${MIRROR:-http://deb.debian.org/debian}
cache=${PYTEST_SMOLVM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/pytest-smolvm}
out=${1:-$cache/python-$suite-rootfs.tar.gz}

if [ -f "$out" ]; then
    echo "$out"
    exit 0
fi
if ! command -v debootstrap >/dev/null 2>&1; then
    echo "build-python-baseline: needs debootstrap (apt-get install -y debootstrap)" >&2
    exit 2
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "build-python-baseline: debootstrap needs root" >&2
    exit 2
fi

mkdir -p "$(dirname "$out")"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
debootstrap --variant=minbase --include=python3 "$suite" "$work/rootfs" "$mirror" >&2
# Package caches and logs are not part of the baseline every test starts from.
rm -rf "$work/rootfs/var/cache/apt/archives/"*.deb "$work/rootfs/var/lib/apt/lists/"* "$work/rootfs/var/log/"*
tar -C "$work/rootfs" --numeric-owner -czf "$work/rootfs.tar.gz" .
mv "$work/rootfs.tar.gz" "$out"  # atomic: a half-built tarball never looks finished
echo "$out"
