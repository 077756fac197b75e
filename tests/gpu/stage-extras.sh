#!/usr/bin/env bash
# Stage what the GPU runs need beyond ../shared/gpu-lab's a, b, c, for the device image
# (Python 3.12, CUDA 13; it already has pandas, pyarrow, fsspec, xxhash, typer, tqdm).
# Usage: bash tests/gpu/stage-extras.sh [.whl] [d|m|r|all]   (default: all)
#
# .whl/d (about 8 MiB; carry it with .whl/c, or alone with the stack, in the `run` call):
# pytest for tests/gpu, speculators' own generator and reader for its clients group
# (issue 6), hs-connectors (its MooncakeTransfer reads the store group's samples), and
# py-spy for ad-hoc profiling on the host (neither the suite nor the bench runs it).
#
# .whl/m (about 56 MiB: a call of its own, `bash -c 'source tests/gpu/stage.sh; install_store'`
# carrying .whl/m; issue 35): mooncake-transfer-engine-cuda13 0.3.14 (cp312; mooncake_master
# and mooncake.store) for tests/gpu/test_gpu_store.py, and mooncake-libs.tar.gz: the
# shared libraries of the Debian packages its binaries need (readelf -d: libibverbs.so.1,
# libmlx5.so.1, libnuma.so.1, libcurl.so.4, libgssapi_krb5.so.2) and what those need, from
# this machine's Debian; install_store copies only what the image lacks (store_libs.py).
#
# .whl/r (about 30 MiB: a call of its own, `bash -c 'source tests/gpu/stage.sh; install_router'`
# carrying .whl/r, before the `run` call on the same warm host): SGLang's router,
# sglang-router 0.3.2 (cp38-abi3, manylinux_2_17), for tests/gpu/test_gpu_fleet.py (issue 38).
# Installed --no-deps: what `python -m sglang_router.launch_router` imports beyond it
# (fastapi, uvicorn, setproctitle, orjson, aiohttp) are SGLang's own dependencies.
set -euo pipefail
root=${1:-.whl}
what=${2:-all}
max=$((58 << 20))  # a call carries 64 MiB with the tree

stage_d() {
  mkdir -p "$root/d"
  python3 -m pip download -q --no-deps --dest "$root/d" --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux1_x86_64 \
    --platform any \
    speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 multiprocess==0.70.19 py-spy==0.4.3 \
    pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 packaging==26.4 Pygments==2.21.0
  ls -la "$root/d"
}

DEBS=(libibverbs1 ibverbs-providers libnl-3-200 libnl-route-3-200 libnuma1
      libcurl4 libbrotli1 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2
      libkeyutils1 libidn2-0 libunistring2 libldap-2.5-0 libsasl2-2 libsasl2-modules-db libdb5.3
      libgnutls30 libgmp10 libhogweed6 libnettle8 libp11-kit0 libffi8 libtasn1-6 libnghttp2-14
      libpsl5 librtmp1 libssh2-1 libssl3 libzstd1 zlib1g)

stage_m() {
  mkdir -p "$root/m"
  rm -f "$root/m"/*.whl "$root/m/mooncake-libs.tar.gz"
  python3 -m pip download -q --no-deps --dest "$root/m" --python-version 3.12 --implementation cp \
    --only-binary=:all: --platform manylinux_2_28_x86_64 mooncake-transfer-engine-cuda13==0.3.14
  local tmp
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -q "${DEBS[@]}" >/dev/null)
  mkdir "$tmp/x"
  local d
  for d in "$tmp"/*.deb; do dpkg-deb -x "$d" "$tmp/x"; done
  # the libraries only (folders lib/ and usr/lib/x86_64-linux-gnu, providers' subfolder too)
  (cd "$tmp/x" && find . -path '*/lib*/x86_64-linux-gnu/*' -name '*.so*' \( -type f -o -type l \) \
     | sort | tar -czf - -T -) > "$root/m/mooncake-libs.tar.gz"
  rm -rf "$tmp"
  local bytes
  bytes=$(du -cb "$root/m"/* | tail -1 | cut -f1)
  ls -la "$root/m"
  if [ "$bytes" -gt "$max" ]; then
    echo "stage-extras: $root/m holds $bytes bytes, more than one call carries ($max)" >&2
    exit 1
  fi
}

stage_r() {
  mkdir -p "$root/r"
  rm -f "$root/r"/*.whl
  python3 -m pip download -q --no-deps --dest "$root/r" --python-version 3.12 --only-binary=:all: \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 sglang-router==0.3.2
  ls -la "$root/r"
}

case "$what" in
  d) stage_d ;;
  m) stage_m ;;
  r) stage_r ;;
  all) stage_d; stage_m; stage_r ;;
  *) echo "usage: $0 [.whl] [d|m|r|all]" >&2; exit 2 ;;
esac
