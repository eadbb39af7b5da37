#!/usr/bin/env bash
# Build the CPU all-in-one image (deploy/images/allinone.Containerfile), start `chorus up` in it and
# synthesize one request against it with `chorus say`. Needs root and Debian's buildah; with no
# reachable image registry it makes the base image itself with debootstrap (Debian's packages).
#
#   sudo deploy/test-image.sh            # from the repository root
#
# BASE=IMAGE uses that base instead (a Debian-like image whose python3 is 3.11 with venv).
# TORCH_WHEEL=FILE: a local CPU torch wheel for the build, for hosts that reach no torch index
# (default: the one in $PIP_FIND_LINKS, if any); it is copied into deploy/images/wheels/ (ignored by git).
# BUILD_CA=FILE: the CA bundle pip trusts in the build (default: the host's).
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${TAG:-localhost/chorus-allinone:test}
BASE_TAG=localhost/chorus-base:bookworm
MIRROR=${MIRROR:-http://deb.debian.org/debian}
BUILDAH=(buildah --storage-driver vfs)
step() { echo "== $(date -u +%H:%M:%S) $*"; }

command -v buildah >/dev/null || { echo "needs buildah (apt-get install -y buildah debootstrap)" >&2; exit 2; }
start=$(date +%s)

if [[ -z "${BASE:-}" ]]; then
  BASE=$BASE_TAG
  if ! "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
    step "base image $BASE from debootstrap (bookworm: python3.11)"
    command -v debootstrap >/dev/null || { echo "needs debootstrap" >&2; exit 2; }
    rootfs=$(mktemp -d)
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" "$MIRROR" \
      >/tmp/chorus-debootstrap.log
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' -cf "$rootfs.tar" .
    ctr=$("${BUILDAH[@]}" from scratch)
    "${BUILDAH[@]}" add "$ctr" "$rootfs.tar" / >/dev/null
    "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
    "${BUILDAH[@]}" commit --quiet "$ctr" "$BASE" >/dev/null
    "${BUILDAH[@]}" rm "$ctr" >/dev/null
    rm -rf "$rootfs" "$rootfs.tar"
  fi
fi

build_args=(--build-arg "BASE=$BASE")
# the host's CA bundle, for pip behind a TLS-intercepting proxy (mounted for the build only)
ca=${BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
if [[ -f "$ca" ]]; then
  build_args+=(--volume "$ca:/run/build-ca.crt:ro" --build-arg BUILD_CA=/run/build-ca.crt)
fi
wheel=${TORCH_WHEEL:-$(ls "${PIP_FIND_LINKS:-/nonexistent}"/torch-*+cpu-*.whl 2>/dev/null | tail -1 || true)}
if [[ -n "$wheel" ]]; then
  step "torch from $wheel (no torch index reachable from this build)"
  cp -u "$wheel" deploy/images/wheels/
  build_args+=(--build-arg TORCH_INDEX=)
fi

step "build $TAG"
"${BUILDAH[@]}" bud --isolation chroot --layers=false -f deploy/images/allinone.Containerfile "${build_args[@]}" \
  -t "$TAG" . >/tmp/chorus-image-build.log 2>&1 || { tail -40 /tmp/chorus-image-build.log; exit 1; }
built=$(date +%s)

step "run chorus up in it and synthesize one request"
ctr=$("${BUILDAH[@]}" from "$TAG")
trap '"${BUILDAH[@]}" rm "$ctr" >/dev/null 2>&1 || true' EXIT
"${BUILDAH[@]}" run --isolation chroot "$ctr" -- sh -c '
  chorus up --host 127.0.0.1 --port 50071 --no-omnivoice >/tmp/up.log 2>&1 &
  up=$!
  trap "kill -TERM $up 2>/dev/null" EXIT
  for i in $(seq 1 180); do
    if chorus say "Hello from the image." --server 127.0.0.1:50071 --seed 1 --min-frames 10 --max-frames 20 \
         --timeout 30 -o /tmp/hello.wav >/tmp/say.log 2>&1; then break; fi
    kill -0 $up 2>/dev/null || { cat /tmp/up.log; exit 1; }
    sleep 1
  done
  kill -TERM $up; wait $up || true
  python3 -c "import soundfile as sf; d, r = sf.read(\"/tmp/hello.wav\"); assert len(d) > 0, d; print(\"hello.wav:\", len(d) / r, \"s at\", r, \"Hz\")"
' || { echo "the request against the image failed" >&2; exit 1; }
done_=$(date +%s)
step "ok: built in $((built - start)) s, served in $((done_ - built)) s; image $TAG"
