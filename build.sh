#!/usr/bin/env bash
# Build the kimi-sglang image with `docker build` or podman (usage() says which builder). See docs/container.md.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: ./build.sh [--base vX.Y.Z] [--base-image IMAGE] [--name NAME] [--push | --load] [--tag NAME]...
                  [--wheel FILE] [--dry-run] [-- EXTRA_BUILD_ARGS...]

Builds the kimi-sglang image for linux/amd64: first the sglang-ext wheel (into
build/wheel/, on this machine), then `docker build` or `podman build`: with
BuildKit, except on a docker client 23+ without the buildx plugin, where the
classic builder is used (said on stderr; --dry-run shows which). RUN steps
run with `--network none`: the build is hermetic; the base image must be
present or pullable, nothing else is fetched.

  --base vX.Y.Z   patch series to build (a folder patches/vX.Y.Z with a base.toml);
                  default: the newest GPU-verified series (base.toml [series] status;
                  `python -m sglang_ext patches list` shows each series' status).
                  An apply-checked series (never run on a GPU) builds with a warning
  --base-image IMAGE
                  build on IMAGE instead of base.toml's [base] image, e.g. a copy
                  of it in a local registry for offline builds (it must hold the
                  same SGLang release; the build checks the version)
  --name NAME     repository of the two default tags (default: kimi-sglang)
  --push          push every tag after the build
  --load          keep the image in the local engine only (the default)
  --tag NAME      extra tag, repeatable (NAME:latest and
                  NAME:<base>-s<series version> are always set)
  --wheel FILE    use this sglang-ext wheel instead of building one
  --dry-run       print the commands instead of running them
  -h, --help      this help

Build args come from patches/<base>/base.toml: BASE_IMAGE ([base] image),
SGLANG_VERSION ([base] version), BASE_GIT_TAG ([base] git_tag),
SERIES_VERSION ([series] version). SOURCE_DATE_EPOCH is the last git commit's
time unless already set.
Env: DOCKER (engine command; default: docker if on PATH, else podman),
DOCKER_BUILDKIT (default 1; 0 where the docker client is 23+ without buildx),
PYTHON (default python3; 3.11+), SOURCE_URL.
The wheel is built with `pip wheel --no-build-isolation` when PYTHON has
setuptools >= 77 (offline), else pip fetches setuptools into an isolated
build environment.
USAGE
}

die() { echo "build.sh: $*" >&2; exit 1; }

root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cd "$root"

base=""
output="--load"
dry_run=0
extra_tags=()
passthrough=()
wheel=""
base_image=""
name=kimi-sglang
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --base) [[ $# -ge 2 ]] || die "--base needs a value"; base=$2; shift 2 ;;
        --base=*) base=${1#--base=}; shift ;;
        --base-image) [[ $# -ge 2 ]] || die "--base-image needs a value"; base_image=$2; shift 2 ;;
        --base-image=*) base_image=${1#--base-image=}; shift ;;
        --name) [[ $# -ge 2 ]] || die "--name needs a value"; name=$2; shift 2 ;;
        --name=*) name=${1#--name=}; shift ;;
        --push) output="--push"; shift ;;
        --load) output="--load"; shift ;;
        --tag) [[ $# -ge 2 ]] || die "--tag needs a value"; extra_tags+=("$2"); shift 2 ;;
        --tag=*) extra_tags+=("${1#--tag=}"); shift ;;
        --wheel) [[ $# -ge 2 ]] || die "--wheel needs a value"; wheel=$2; shift 2 ;;
        --wheel=*) wheel=${1#--wheel=}; shift ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; passthrough=("$@"); break ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

# The series' status and base.toml are read by the project's own patch tooling
# (sglang_ext/tools/patchtool/series.py; Python 3.11+ for tomllib).
py=${PYTHON:-python3}
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
    || die "needs Python 3.11+ (tomllib) to read base.toml; '$py' is not (set PYTHON=python3.11 or newer)"
series_py() { KIMI_SGLANG_PATCHES="$root/patches" PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$py" "$@"; }
known=$(find patches -mindepth 1 -maxdepth 1 -type d -name 'v*' -printf '%f ' 2>/dev/null)
known=${known% }

# Default: the newest GPU-verified series, unless --base says otherwise.
if [[ -z "$base" ]]; then
    [[ -n "$known" ]] || die "no patches/v* series found under $root/patches"
    base=$(series_py -m sglang_ext patches list --status gpu-verified --newest --names) \
        || die "no --base given and no GPU-verified series to default to (known series: $known)"
    newer=$(series_py -m sglang_ext patches list --names | awk -v b="$base" 'f { printf "%s ", $0 } $0 == b { f = 1 }')
    echo "build.sh: no --base: building $base, the newest GPU-verified series${newer:+ (newer, not GPU-verified: ${newer% }; --base builds one)}" >&2
fi
[[ "$base" == v* ]] || base="v$base"
toml="patches/$base/base.toml"
[[ -f "$toml" ]] || die "$toml not found (known series: $known)"

# base.toml -> shell assignments (an error is printed by the reader; stop then).
assignments=$(series_py - "patches/$base" <<'PY'
import shlex, sys
from pathlib import Path
from sglang_ext.tools.patchtool.series import SeriesError, load_base, series_status
toml = Path(sys.argv[1], "base.toml")
try:
    base = load_base(toml)
    status = series_status(sys.argv[1])
except SeriesError as e:
    sys.exit(f"build.sh: {e}")
vals = {"BASE_IMAGE": base.image, "SGLANG_VERSION": base.version,
        "BASE_GIT_TAG": base.git_tag, "SERIES_VERSION": base.series_version,
        "SERIES_STATUS": status, "SERIES_EVIDENCE": base.evidence or ""}
missing = [k for k, v in vals.items() if v is None]
if missing:
    sys.exit(f"build.sh: {toml} lacks {', '.join(missing)}")
for k, v in vals.items():
    print(f"{k}={shlex.quote(str(v))}")
PY
) || exit 1
eval "$assignments"
if [[ "$SERIES_STATUS" != gpu-verified ]]; then
    echo "build.sh: warning: series $base is $SERIES_STATUS only: it applies to SGLang $SGLANG_VERSION and passes the CPU tests, but has never run end to end on a GPU (docs/porting.md)" >&2
fi

if [[ -n "$base_image" ]]; then
    BASE_IMAGE=$base_image
fi

if [[ "v$SGLANG_VERSION" != "$base" ]]; then
    die "$toml says [base] version = $SGLANG_VERSION, but the folder is $base"
fi

# The engine: $DOCKER, else docker, else podman. `docker build` with BuildKit
# (DOCKER_BUILDKIT=1) is the daemon's built-in builder: no buildx plugin needed.
docker=${DOCKER:-}
if [[ -z "$docker" ]]; then
    if command -v docker >/dev/null 2>&1; then docker=docker
    elif command -v podman >/dev/null 2>&1; then docker=podman
    else docker=docker
    fi
fi
if [[ $dry_run -eq 0 ]] && ! command -v "$docker" >/dev/null 2>&1; then
    die "'$docker' not found on PATH: install Docker (docker.io or Docker Engine) or podman to build the image"
fi
engine=docker
if [[ "$(basename "$docker")" == podman* ]]; then
    engine=podman
fi
# Docker clients 23+ hand BuildKit builds to the buildx plugin and refuse them
# without it; older clients (Debian's docker.io 20.10) talk to the daemon's
# built-in BuildKit. Without buildx on a 23+ client: the classic builder (probed for
# --dry-run too, so that it prints the command a build would run).
buildkit=${DOCKER_BUILDKIT:-1}
if [[ $engine == docker && -z "${DOCKER_BUILDKIT:-}" ]] \
        && ! "$docker" buildx version >/dev/null 2>&1; then
    client=$("$docker" version --format '{{.Client.Version}}' 2>/dev/null || true)
    if [[ "${client%%.*}" =~ ^[0-9]+$ && ${client%%.*} -ge 23 ]]; then
        echo "build.sh: docker client $client without the buildx plugin: using the classic builder (DOCKER_BUILDKIT=0)" >&2
        buildkit=0
    fi
fi

if [[ -z "${SOURCE_DATE_EPOCH:-}" ]]; then
    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 0)
fi
export SOURCE_DATE_EPOCH
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
vcs_ref=$(git rev-parse HEAD 2>/dev/null || echo unknown)
if [[ -n "$(git status --porcelain 2>/dev/null)" ]]; then
    vcs_ref="$vcs_ref-dirty"
fi
version_tag="$base-s$SERIES_VERSION"

if [[ -n "$wheel" ]]; then
    [[ -f "$wheel" && "$(basename "$wheel")" == sglang_ext-*.whl ]] || die "--wheel $wheel: not an sglang_ext-*.whl file"
    wheel_cmd=(cp "$wheel" build/wheel/)
else
    wheel_cmd=("$py" -m pip wheel --no-deps --wheel-dir build/wheel/)
    if "$py" -c 'import setuptools, sys; sys.exit(int(setuptools.__version__.split(".")[0]) < 77)' 2>/dev/null; then
        wheel_cmd+=(--no-build-isolation)
    fi
    wheel_cmd+=(--quiet .)
fi

cmd=("$docker" build
    --platform linux/amd64
    --file Dockerfile
    --network none
    --build-arg "BASE_IMAGE=$BASE_IMAGE"
    --build-arg "SGLANG_VERSION=$SGLANG_VERSION"
    --build-arg "BASE_GIT_TAG=$BASE_GIT_TAG"
    --build-arg "SERIES_VERSION=$SERIES_VERSION"
    --build-arg "IMAGE_VERSION=$version_tag"
    --build-arg "VCS_REF=$vcs_ref"
    --build-arg "CREATED=$created"
    --build-arg "SOURCE_URL=${SOURCE_URL:-https://github.com/kimi-sglang/kimi-sglang}"
    --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH")
if [[ $engine == podman ]]; then
    cmd+=(--format docker)  # the OCI format drops HEALTHCHECK
fi
tags=("$name:latest" "$name:$version_tag" ${extra_tags[@]+"${extra_tags[@]}"})
for t in "${tags[@]}"; do
    cmd+=(--tag "$t")
done
cmd+=(${passthrough[@]+"${passthrough[@]}"} .)

echo "build.sh: series $base (series version $SERIES_VERSION, $SERIES_STATUS${SERIES_EVIDENCE:+: $SERIES_EVIDENCE}) on $BASE_IMAGE" >&2
if [[ $dry_run -eq 1 ]]; then
    echo "rm -rf build/wheel && mkdir -p build/wheel"
    printf '%q ' "${wheel_cmd[@]}"; echo
    [[ $engine == docker ]] && printf 'DOCKER_BUILDKIT=%s ' "$buildkit"
    printf '%q ' "${cmd[@]}"; echo
    if [[ $output == --push ]]; then
        for t in "${tags[@]}"; do printf '%q push %q\n' "$docker" "$t"; done
    fi
    exit 0
fi
rm -rf build/wheel
mkdir -p build/wheel
"${wheel_cmd[@]}" || die "building the sglang-ext wheel failed (${wheel_cmd[*]})"
ls build/wheel/sglang_ext-*.whl >/dev/null 2>&1 || die "no sglang_ext-*.whl in build/wheel/ after: ${wheel_cmd[*]}"
if [[ $engine == docker ]]; then
    export DOCKER_BUILDKIT=$buildkit
fi
"${cmd[@]}"
if [[ $output == --push ]]; then
    for t in "${tags[@]}"; do
        "$docker" push "$t"
    done
fi
