# TEST FIXTURE, not a product image: a stand-in for upstream's lmsysorg/sglang
# image, made without any registry, for tests/tooling/test_image.py. The real base
# stays pinned in patches/<series>/base.toml ([base] image).
#
# ROOTFS: a minimal Debian (mmdebstrap --variant=minbase with python3,
# python3-pip, git, patch), brought in with `docker import`. On top, the
# pinned SGLang wheel is installed --no-deps and its Python sources are moved
# to /sgl-workspace/sglang/python, where upstream's image keeps them (there
# installed editable). SGLang's own dependencies (torch, ...) are not in this
# image: the smoke runs that need them mount the test venv's site-packages
# read-only at /opt/ci-deps, which zz-ci-deps.pth puts at the END of sys.path
# (so the image's patched sglang, earlier on sys.path, wins).
ARG ROOTFS=kimi-sglang-standin-rootfs:bookworm
FROM ${ROOTFS}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY sglang-*.whl /tmp/wheel/
RUN python3 -m pip install --no-cache-dir --no-deps --no-index --break-system-packages \
        --root-user-action=ignore /tmp/wheel/sglang-*.whl \
    && rm -rf /tmp/wheel \
    && site=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') \
    && mkdir -p /sgl-workspace/sglang/python \
    && mv "$site/sglang" /sgl-workspace/sglang/python/sglang \
    && echo /sgl-workspace/sglang/python > "$site/00-sgl-workspace.pth" \
    && echo /opt/ci-deps > "$site/zz-ci-deps.pth" \
    && python3 -c 'import importlib.util as u; p = u.find_spec("sglang").origin; assert p.startswith("/sgl-workspace/sglang/python/"), p'
WORKDIR /sgl-workspace/sglang
