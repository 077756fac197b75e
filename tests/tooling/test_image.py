"""The image, really built and started: build.sh on a stand-in base, then `docker run`.

Session fixtures, in order:

* ``engine``: a Docker daemon. One that already answers (``DOCKER_HOST`` or
  /var/run/docker.sock) is used as it is. Where none answers and this process is
  root, a PRIVATE dockerd is started (after ``apt-get install docker.io
  mmdebstrap`` where they are missing): its own data root (kept under
  ``~/.cache/kimi-sglang/docker`` so the stand-in base survives between runs),
  exec root and unix socket; it is stopped by its pid at the end. A user's
  daemon is never started, stopped or reconfigured, and the images made here
  carry test-only names (``kimi-sglang-test*``), never ``kimi-sglang`` or
  ``lmsysorg/sglang``. Where no engine can run: the tests fail under CI
  (``CI=true``) and skip elsewhere, with the reason.
* ``standin``: the TEST FIXTURE standing in for upstream's ``lmsysorg/sglang``
  image (tests/image/standin.Dockerfile): minimal Debian made by mmdebstrap and
  ``docker import``, plus the pinned SGLang wheel of SERIES (the newest gpu-verified series) laid out at
  /sgl-workspace/sglang/python as upstream's image has it. Cached by tag.
* ``image``: the project's own ``build.sh --base SERIES`` on that stand-in.
  A failed build fails every test here.

SGLang's dependencies (torch, ...) are not in the stand-in: the two runs that
import SGLang's server mount this test venv's site-packages read-only at
/opt/ci-deps, which the stand-in puts at the end of sys.path.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

from sglang_ext.tools.patchtool.series import GPU_VERIFIED, newest_series

REPO = Path(__file__).resolve().parents[2]
# The series CI's venv pins (its SGLang and deps): tests/run.sh installs the SGLang of the
# newest gpu-verified series, the same series build.sh builds by default.
SERIES = newest_series(GPU_VERIFIED).name
BASE_TOML = tomllib.loads((REPO / "patches" / SERIES / "base.toml").read_text())
STANDIN_DOCKERFILE = REPO / "tests" / "image" / "standin.Dockerfile"
ROOTFS_PACKAGES = "python3,python3-pip,git,patch,ca-certificates"
ROOTFS_SUITE = "bookworm"  # Python 3.11: the cp311 wheel's _core modules load
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kimi-sglang"
TEST_NAME = "kimi-sglang-test"  # repository of the image built here (never kimi-sglang)
DEPS_MOUNT = "/opt/ci-deps"


def _no_engine(reason: str):
    """Fail under CI (the container is part of what CI proves), skip elsewhere."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but no container engine can run here: {reason}", pytrace=False)
    pytest.skip(f"no container engine: {reason}")


@dataclass
class Engine:
    client: str  # path of the docker client
    env: dict[str, str]  # environment for client calls (DOCKER_HOST)
    private: bool  # True: a dockerd started by this session

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([self.client, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            pytest.fail(f"`docker {' '.join(args)}` exited {proc.returncode}:\n"
                        f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}", pytrace=False)
        return proc

    def has_image(self, ref: str) -> bool:
        return self.run("image", "inspect", ref, check=False, timeout=60).returncode == 0


def _clients() -> list[str]:
    """Docker clients to try: Debian's /usr/bin/docker first (20.10 talks to the daemon's
    built-in BuildKit; a 23+ client elsewhere on PATH may lack buildx), then PATH's."""
    out = []
    for c in ("/usr/bin/docker", shutil.which("docker")):
        if c and os.access(c, os.X_OK) and c not in out:
            out.append(c)
    return out


def _answers(client: str, env: dict[str, str]) -> bool:
    try:
        proc = subprocess.run([client, "version", "--format", "{{.Server.Version}}"], env=env,
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return proc.returncode == 0 and proc.stdout.strip() != ""


def _apt_install(packages: list[str]) -> None:
    if not shutil.which("apt-get"):
        _no_engine(f"{', '.join(packages)} missing and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", *packages]):
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            _no_engine(f"`{' '.join(cmd)}` failed: {proc.stderr[-1500:]}")


def _private_dockerd(tmp_root: Path):
    """Start dockerd with its own data root, exec root and socket. Yields (Engine, pid)."""
    missing = [pkg for pkg, binary in (("docker.io", "/usr/bin/docker"), ("docker.io", "/usr/sbin/dockerd"),
                                       ("mmdebstrap", "/usr/bin/mmdebstrap"))
               if not Path(binary).exists()]
    if missing:
        _apt_install(sorted(set(missing)))
    CACHE.mkdir(parents=True, exist_ok=True)
    data_root = CACHE / "docker"
    data_root.mkdir(exist_ok=True)
    lock = open(CACHE / "docker.lock", "w")
    try:  # one daemon per data root; a second session at once gets a throw-away one
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        data_root = tmp_root / "data"
    exec_root = Path(tempfile.mkdtemp(prefix="ksd-", dir="/tmp"))  # short: socket paths are limited
    sock = exec_root / "docker.sock"
    log = tmp_root / "dockerd.log"
    with open(log, "w") as logf:
        proc = subprocess.Popen(
            ["/usr/sbin/dockerd", "--storage-driver", "overlay2", "--iptables=false", "--ip-masq=false",
             "--bridge=none", "--data-root", str(data_root), "--exec-root", str(exec_root / "exec"),
             "--pidfile", str(exec_root / "dockerd.pid"), "--host", f"unix://{sock}"],
            stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    env = dict(os.environ, DOCKER_HOST=f"unix://{sock}")
    engine = Engine("/usr/bin/docker", env, private=True)
    deadline = time.monotonic() + 60
    while not _answers(engine.client, env):
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            _no_engine(f"private dockerd did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    try:
        yield engine
    finally:
        _stop(proc)
        shutil.rmtree(exec_root, ignore_errors=True)
        lock.close()


def _stop(proc: subprocess.Popen) -> None:
    """Stop the dockerd this session started (by its pid only)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="session")
def engine(tmp_path_factory):
    clients = _clients()
    for client in clients:
        if _answers(client, dict(os.environ)):
            yield Engine(client, dict(os.environ), private=False)
            return
    if os.geteuid() != 0:
        _no_engine("no Docker daemon answers and this process is not root, so it cannot start one")
    yield from _private_dockerd(tmp_path_factory.mktemp("dockerd"))


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p)
        h.update(b"\0")
    return h.hexdigest()[:12]


@pytest.fixture(scope="session")
def wheel():
    """SERIES' pinned SGLang wheel, sha256-verified (cached between runs; here it shadows
    conftest's fixture of the patch tests' fixed 0.5.17 wheel)."""
    from conftest import WHEEL_CACHE, fetch_wheel_or_skip

    from sglang_ext.tools.patchtool.series import load_series

    base = load_series(REPO / "patches" / SERIES).base
    return fetch_wheel_or_skip(base.version, base, WHEEL_CACHE)


@pytest.fixture(scope="session")
def standin(engine, wheel, tmp_path_factory) -> str:
    """Tag of the stand-in base image (made once per rootfs recipe + wheel + Dockerfile)."""
    assert "-cp311-" in wheel.path.name, f"{wheel.path.name}: the stand-in's Python is 3.11"
    assert wheel.version == BASE_TOML["base"]["version"]
    rootfs = f"{TEST_NAME}-rootfs:{ROOTFS_SUITE}-{_digest(ROOTFS_PACKAGES.encode())}"
    if not engine.has_image(rootfs):
        if not shutil.which("mmdebstrap"):
            _apt_install(["mmdebstrap"])
        tar = tmp_path_factory.mktemp("rootfs") / "rootfs.tar"
        proc = subprocess.run(["mmdebstrap", "--quiet", "--variant=minbase", f"--include={ROOTFS_PACKAGES}",
                               ROOTFS_SUITE, str(tar)], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            _no_engine(f"mmdebstrap could not make the stand-in's rootfs: {proc.stderr[-2000:]}")
        engine.run("import", str(tar), rootfs, timeout=600)
        tar.unlink()
    tag = (f"{TEST_NAME}-standin:v{BASE_TOML['base']['version']}-"
           f"{_digest(rootfs.encode(), wheel.sha256.encode(), STANDIN_DOCKERFILE.read_bytes())}")
    if not engine.has_image(tag):
        ctx = tmp_path_factory.mktemp("standin-ctx")
        shutil.copy(wheel.path, ctx / wheel.path.name)
        env = dict(engine.env, DOCKER_BUILDKIT="1")
        proc = subprocess.run([engine.client, "build", "--network", "none", "--build-arg", f"ROOTFS={rootfs}",
                               "--file", str(STANDIN_DOCKERFILE), "--tag", tag, str(ctx)],
                              env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode == 0:  # drop stand-ins of older recipes (test-only names)
            refs = engine.run("image", "ls", "--format", "{{.Repository}}:{{.Tag}}",
                              f"{TEST_NAME}-standin").stdout.split()
            stale = [r for r in refs if r != tag]
            if stale:
                engine.run("image", "rm", *stale, check=False)
        if proc.returncode != 0:
            pytest.fail(f"building the stand-in base failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}",
                        pytrace=False)
    return tag


@dataclass
class Image:
    tag: str
    build_log: str
    engine: Engine

    def run(self, *args: str, deps: bool = False, env: dict[str, str] | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess:
        """`docker run --rm --network none [-v venv:/opt/ci-deps:ro] [-e K=V] IMAGE args`."""
        cmd = ["run", "--rm", "--network", "none"]
        if deps:
            cmd += ["--volume", f"{sysconfig.get_paths()['purelib']}:{DEPS_MOUNT}:ro"]
        for k, v in (env or {}).items():
            cmd += ["--env", f"{k}={v}"]
        return self.engine.run(*cmd, self.tag, *args, timeout=timeout, check=False)


@pytest.fixture(scope="session")
def image(engine, standin) -> Image:
    """The project's image, built by ./build.sh on the stand-in (BuildKit, --network none)."""
    env = dict(engine.env, DOCKER=engine.client, PYTHON=sys.executable)
    env.pop("DOCKER_BUILDKIT", None)
    proc = subprocess.run(["bash", str(REPO / "build.sh"), "--base", SERIES, "--base-image", standin,
                           "--name", TEST_NAME], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"./build.sh failed (exit {proc.returncode}):\n{log[-5000:]}", pytrace=False)
    if engine.private:  # the previous run's image, now untagged, in the cached data root
        engine.run("image", "prune", "--force", check=False, timeout=120)
    version_tag = f"{SERIES}-s{BASE_TOML['series']['version']}"
    return Image(f"{TEST_NAME}:{version_tag}", log, engine)


def _ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def _print_command(image: Image, **env: str) -> tuple[str, list[str]]:
    out = _ok(image.run("--print-command", env=env)).splitlines()
    assert len(out) == 2, out
    return out[0], out[1].split()


def test_print_command_default_profile(image):
    header, argv = _print_command(image)
    assert header == "# kimi-sglang: profiles applied: kimi-k25"
    assert argv[:2] == ["env", "NVCC_APPEND_FLAGS=--split-compile=8"]  # kimi-k25's only env
    argv = argv[2:]
    assert argv[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    pairs = dict(zip(argv[3::1], argv[4::1]))
    assert pairs["--model-path"] == "/models/Kimi-K2.5" and pairs["--port"] == "30000"
    assert "--attention-backend" not in argv  # no GPU here: no SM120 profile


def test_print_command_sm120_profile(image):
    header, argv = _print_command(image, KIMI_SGLANG_COMPUTE_CAP="12.0", KIMI_SGLANG_PORT="31000")
    assert header == "# kimi-sglang: profiles applied: kimi-k25, sm120"
    assert argv[0] == "env"
    env = dict(tok.split("=", 1) for tok in argv[1:argv.index("/usr/bin/python3")])
    assert env == {"NCCL_CUMEM_ENABLE": "0", "NCCL_CUMEM_HOST_ENABLE": "0", "NCCL_P2P_DISABLE": "1",
                   "NVCC_APPEND_FLAGS": "--split-compile=8"}
    i = argv.index("--attention-backend")
    assert argv[i + 1] == "triton" and "--disable-custom-all-reduce" in argv
    assert argv[argv.index("--tp-size") + 1] == "1"  # one compute capability given: one GPU
    assert argv[argv.index("--port") + 1] == "31000"


def test_patches_check_in_the_image_reports_its_series_applied(image):
    # No --series, run from / (not the WORKDIR): the image's own series, found via
    # KIMI_SGLANG_PATCHES, picked by the installed SGLang's version.
    proc = image.run("bash", "-c", "cd / && python3 -m sglang_ext patches check --json")
    report = json.loads(_ok(proc))
    assert report["series"] == SERIES and report["state"] == "applied"
    series = (REPO / "patches" / SERIES / "series").read_text().split()
    assert [p["status"] for p in report["patches"]] == ["applied"] * len(series) and len(series) >= 7
    assert report["target"] == "/sgl-workspace/sglang/python (site-packages, -p2)"
    assert report["notes"][0].startswith(f"series {SERIES} picked: it is made for sglang {BASE_TOML['base']['version']}")


def test_kimi_sglang_help_is_ours_and_help_sglang_reaches_the_patched_server(image):
    proc = image.run("--help", deps=True, timeout=240)
    out = _ok(proc)
    for flag in ("--print-command", "--no-profile", "--no-default", "--dump-hidden-states-dir",
                 "--dump-hidden-states-layers", "--help-sglang", "KIMI_SGLANG_COMPUTE_CAP"):
        assert flag in out, flag
    assert len(out.splitlines()) < 80, "our help, not SGLang's 2,000 lines"
    proc = image.run("--help-sglang", deps=True, timeout=240)
    out = _ok(proc)
    for flag in ("--dump-hidden-states-dir DUMP_HIDDEN_STATES_DIR", "--dump-hidden-states-layers",
                 "--model-path"):
        assert flag in out, flag  # the image's patched SGLang's own parser


def test_launch_server_help_runs_as_in_upstreams_image(image):
    proc = image.run("python3", "-m", "sglang.launch_server", "--help", deps=True, timeout=240)
    out = _ok(proc)
    assert out.startswith("usage: launch_server.py") or "usage:" in out.splitlines()[0]
    assert "--dump-hidden-states-dir DUMP_HIDDEN_STATES_DIR" in out  # the image's patched SGLang
    assert "kimi-sglang:" not in proc.stderr  # pass-through: the entrypoint added nothing


def test_labels_healthcheck_and_entrypoint(image, standin):
    info = json.loads(image.engine.run("image", "inspect", image.tag).stdout)[0]
    cfg = info["Config"]
    labels = cfg["Labels"]
    base = BASE_TOML["base"]
    assert labels["io.kimi-sglang.base.version"] == base["version"]
    assert labels["io.kimi-sglang.base.git-tag"] == base["git_tag"]
    assert labels["io.kimi-sglang.series.version"] == str(BASE_TOML["series"]["version"])
    assert labels["io.kimi-sglang.base.image"] == labels["org.opencontainers.image.base.name"] == standin
    assert labels["org.opencontainers.image.version"] == f"{SERIES}-s{BASE_TOML['series']['version']}"
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert labels["org.opencontainers.image.revision"] in (head, head + "-dirty")
    hc = cfg["Healthcheck"]
    assert any("/health" in part for part in hc["Test"]) and "KIMI_SGLANG_PORT" in " ".join(hc["Test"])
    assert hc["StartPeriod"] == 40 * 60 * 10**9 and hc["Interval"] == 30 * 10**9
    assert cfg["Entrypoint"] == ["kimi-sglang"]
    env = dict(e.split("=", 1) for e in cfg["Env"])
    assert env["KIMI_SGLANG_PORT"] == "30000" and env["KIMI_SGLANG_PATCHES"] == "/opt/kimi-sglang/patches"
    assert "30000/tcp" in cfg["ExposedPorts"]
