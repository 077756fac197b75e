# kimi-sglang: upstream SGLang image + our patch series + the sglang_ext package.
# Build with ./build.sh (it reads patches/<base>/base.toml, builds the
# sglang-ext wheel into build/wheel/ and passes the ARGs below); see
# docs/container.md. Hermetic: no RUN step uses the network (no `# syntax=`
# line either, which would fetch a BuildKit frontend from a registry).

# Upstream image for the series' base release (base.toml [base] image). The
# defaults here are build.sh's default series, the newest GPU-verified one
# (tests/tooling/test_container.py keeps them in step with its base.toml).
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23-cu130
FROM ${BASE_IMAGE}

# base.toml [base] version / git_tag and [series] version.
ARG SGLANG_VERSION=0.5.23
ARG BASE_GIT_TAG=v0.5.23
ARG SERIES_VERSION=7
# Re-declared without a value: the stage then sees the global value (ARGs
# declared before FROM are otherwise out of scope here).
ARG BASE_IMAGE
# Provenance of this repository (build.sh fills them in from git).
ARG VCS_REF=unknown
ARG CREATED=1970-01-01T00:00:00Z
ARG SOURCE_URL=https://github.com/kimi-sglang/kimi-sglang
ARG IMAGE_VERSION=v0.5.23-s7

LABEL org.opencontainers.image.title="kimi-sglang" \
      org.opencontainers.image.description="SGLang ${SGLANG_VERSION} + kimi-sglang patch series ${SERIES_VERSION}: hidden-state dumping for EAGLE-3 drafter training (Kimi-K2.5)" \
      org.opencontainers.image.version="${IMAGE_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="${SOURCE_URL}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.vendor="kimi-sglang" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.kimi-sglang.series.version="${SERIES_VERSION}" \
      io.kimi-sglang.base.version="${SGLANG_VERSION}" \
      io.kimi-sglang.base.git-tag="${BASE_GIT_TAG}" \
      io.kimi-sglang.base.image="${BASE_IMAGE}"

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /opt/kimi-sglang

# 1. Refuse a base image whose SGLang is not the series' base release.
COPY docker/ docker/
RUN docker/check-sglang-version.sh "${SGLANG_VERSION}"

# 2. Install sglang_ext from the wheel build.sh made (--no-index: nothing is
#    downloaded; --no-deps: the image's pinned packages stay as they are),
#    then apply the series to the image's SGLang.
#    PEP 668: a base whose system Python is marked externally managed (Debian,
#    Ubuntu 24.04) makes pip refuse; PIP_BREAK_SYSTEM_PACKAGES=1 (for this step
#    only) is the deliberate choice: the image exists to modify that Python's
#    SGLang, and --no-deps adds one pure-Python package beside it.
COPY patches/ patches/
COPY build/wheel/ /tmp/sglang-ext-wheel/
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps --no-index \
        --root-user-action=ignore /tmp/sglang-ext-wheel/sglang_ext-*.whl \
    && rm -rf /tmp/sglang-ext-wheel \
    && docker/apply-series.sh "patches/v${SGLANG_VERSION}"

# `python -m sglang_ext patches ...` finds the series here from any directory;
# with no --series it picks the one matching the installed SGLang (this image's).
ENV KIMI_SGLANG_PATCHES=/opt/kimi-sglang/patches

# Port of the HTTP server: the kimi-k25 profile passes it as --port and the
# HEALTHCHECK probes it. Change it with -e KIMI_SGLANG_PORT=..., not --port.
ENV KIMI_SGLANG_PORT=30000
EXPOSE 30000

# Loading Kimi-K2.5 (about 1T parameters) and capturing CUDA graphs takes a
# while: failures during the start period do not count.
HEALTHCHECK --interval=30s --timeout=10s --start-period=40m --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KIMI_SGLANG_PORT', '30000'), timeout=8)"]

ENTRYPOINT ["kimi-sglang"]
CMD []
