#!/usr/bin/env bash
# Build the kimi-sglang image with docker buildx. See docs/container.md.
set -euo pipefail

usage() {
    cat <<'USAGE'
Usage: ./build.sh [--base vX.Y.Z] [--push] [--tag NAME]... [--dry-run] [-- EXTRA_BUILDX_ARGS...]

Builds the kimi-sglang image for linux/amd64 with `docker buildx build`.

  --base vX.Y.Z   patch series to build (a folder patches/vX.Y.Z with a base.toml);
                  default: the newest patches/v* by version order
  --push          push the image (instead of --load into the local engine)
  --load          load the image into the local docker engine (the default)
  --tag NAME      extra tag, repeatable (kimi-sglang:latest and
                  kimi-sglang:<base>-s<series version> are always set)
  --dry-run       print the buildx command instead of running it
  -h, --help      this help

Build args come from patches/<base>/base.toml: BASE_IMAGE ([base] image),
SGLANG_VERSION ([base] version), BASE_GIT_TAG ([base] git_tag),
SERIES_VERSION ([series] version). SOURCE_DATE_EPOCH is the last git commit's
time unless already set. Env: DOCKER (default: docker), SOURCE_URL.
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
while [[ $# -gt 0 ]]; do
    case "$1" in
        -h|--help) usage; exit 0 ;;
        --base) [[ $# -ge 2 ]] || die "--base needs a value"; base=$2; shift 2 ;;
        --base=*) base=${1#--base=}; shift ;;
        --push) output="--push"; shift ;;
        --load) output="--load"; shift ;;
        --tag) [[ $# -ge 2 ]] || die "--tag needs a value"; extra_tags+=("$2"); shift 2 ;;
        --tag=*) extra_tags+=("${1#--tag=}"); shift ;;
        --dry-run) dry_run=1; shift ;;
        --) shift; passthrough=("$@"); break ;;
        *) usage >&2; die "unknown option: $1" ;;
    esac
done

# Newest series by version order (sort -V), unless --base says otherwise.
if [[ -z "$base" ]]; then
    base=$(find patches -mindepth 1 -maxdepth 1 -type d -name 'v*' -printf '%f\n' 2>/dev/null | sort -V | tail -n 1)
    [[ -n "$base" ]] || die "no patches/v* series found under $root/patches"
fi
[[ "$base" == v* ]] || base="v$base"
toml="patches/$base/base.toml"
[[ -f "$toml" ]] || die "$toml not found (known series: $(find patches -mindepth 1 -maxdepth 1 -type d -name 'v*' -printf '%f ' 2>/dev/null))"

# base.toml -> shell assignments, via tomllib (Python 3.11+); no yq needed.
py=${PYTHON:-python3}
eval "$("$py" - "$toml" <<'PY'
import shlex, sys, tomllib
with open(sys.argv[1], "rb") as f:
    d = tomllib.load(f)
try:
    vals = {
        "BASE_IMAGE": d["base"]["image"],
        "SGLANG_VERSION": d["base"]["version"],
        "BASE_GIT_TAG": d["base"]["git_tag"],
        "SERIES_VERSION": str(d["series"]["version"]),
    }
except KeyError as e:
    sys.exit(f"build.sh: {sys.argv[1]} lacks {e}")
for k, v in vals.items():
    print(f"{k}={shlex.quote(str(v))}")
PY
)"

if [[ "v$SGLANG_VERSION" != "$base" ]]; then
    die "$toml says [base] version = $SGLANG_VERSION, but the folder is $base"
fi

docker=${DOCKER:-docker}
if [[ $dry_run -eq 0 ]]; then
    if ! command -v "$docker" >/dev/null 2>&1; then
        die "'$docker' not found on PATH: install Docker (with the buildx plugin) to build the image"
    fi
    if ! "$docker" buildx version >/dev/null 2>&1; then
        die "'$docker buildx' is not available: install the Docker buildx plugin (https://docs.docker.com/build/)"
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

cmd=("$docker" buildx build
    --platform linux/amd64
    --file Dockerfile
    --build-arg "BASE_IMAGE=$BASE_IMAGE"
    --build-arg "SGLANG_VERSION=$SGLANG_VERSION"
    --build-arg "BASE_GIT_TAG=$BASE_GIT_TAG"
    --build-arg "SERIES_VERSION=$SERIES_VERSION"
    --build-arg "IMAGE_VERSION=$version_tag"
    --build-arg "VCS_REF=$vcs_ref"
    --build-arg "CREATED=$created"
    --build-arg "SOURCE_URL=${SOURCE_URL:-https://github.com/kimi-sglang/kimi-sglang}"
    --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH"
    --tag kimi-sglang:latest
    --tag "kimi-sglang:$version_tag")
for t in ${extra_tags[@]+"${extra_tags[@]}"}; do
    cmd+=(--tag "$t")
done
cmd+=("$output" ${passthrough[@]+"${passthrough[@]}"} .)

echo "build.sh: series $base (series version $SERIES_VERSION) on $BASE_IMAGE" >&2
if [[ $dry_run -eq 1 ]]; then
    printf '%q ' "${cmd[@]}"; echo
    exit 0
fi
exec "${cmd[@]}"
