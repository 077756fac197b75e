"""Session fixtures for the patch tests: the pinned 0.5.17 wheel and one pristine checkout,
each series applied to its pinned wheel's files (``patched_site``), the GPU suite's tiny
models built on the CPU (``tiny_models_built``); the ``py310`` marker.

The patch tooling is imported inside the fixtures: the client tests marked ``py310`` run
under Python 3.10 too (tests/run.sh), where nothing here may need Python 3.11's tomllib.
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERIES_DIR = REPO / "patches" / "v0.5.17"
SERIES_DIRS = sorted(p for p in (REPO / "patches").glob("v*") if (p / "series").is_file())
# Read at import time (the cache_dir fixture points KIMI_SGLANG_CACHE at a temporary folder
# later): the wheel downloads persist between runs.
WHEEL_CACHE = Path(os.environ.get("KIMI_SGLANG_CACHE") or Path.home() / ".cache" / "kimi-sglang")
PRESEEDED = Path("/tmp/wh/sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl")


# pip's error text when the registry cannot be reached (as opposed to a real failure).
OFFLINE_HINTS = ("NewConnectionError", "Network is unreachable", "Temporary failure in name resolution",
                 "Name or service not known", "ConnectTimeout", "timed out", "ProxyError",
                 "Max retries exceeded", "Could not fetch URL")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "py310: also run under Python 3.10 by tests/run.sh (client and CLI tests; "
        "the module may import only what requirements/ci-py310.txt installs)")


def fetch_wheel_or_skip(version, base, cache):
    """``fetch_wheel``, skipping the calling test only when PyPI is unreachable."""
    from sglang_ext.tools.patchtool.wheel import WheelError, fetch_wheel

    try:
        return fetch_wheel(version, base, cache)
    except WheelError as exc:
        if any(h in str(exc) for h in OFFLINE_HINTS):
            pytest.skip(f"PyPI unreachable: {exc}")
        raise


@pytest.fixture(scope="session")
def series():
    from sglang_ext.tools.patchtool.series import load_series

    return load_series(SERIES_DIR)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """A private KIMI_SGLANG_CACHE for the whole session (never ~/.cache)."""
    path = tmp_path_factory.mktemp("cache")
    os.environ["KIMI_SGLANG_CACHE"] = str(path)
    return path


@pytest.fixture(scope="session")
def wheel(series, cache_dir):
    """The sha256-verified 0.5.17 wheel: /tmp/wh when present, else downloaded."""
    from sglang_ext.tools.patchtool.wheel import fetch_wheel, verify_wheel

    if PRESEEDED.is_file():
        return verify_wheel(PRESEEDED, series.base)
    return fetch_wheel("0.5.17", series.base, cache_dir)


@pytest.fixture(scope="session")
def patched_site(tmp_path_factory):
    """``patched_site(series_dir) -> Path``: a folder holding the series' pinned wheel
    unpacked with the series applied (the project's own CLI), made once per session and
    series; for a probe subprocess with it first on PYTHONPATH. Skips the calling test
    when PyPI is unreachable and the wheel is not cached (``network`` tests)."""
    import subprocess
    import zipfile

    from sglang_ext.tools.patchtool.series import load_series

    made = {}

    def get(series_dir: Path) -> Path:
        if series_dir not in made:
            base = load_series(series_dir).base
            info = fetch_wheel_or_skip(base.version, base, WHEEL_CACHE)
            site = tmp_path_factory.mktemp(f"site-{series_dir.name}")
            with zipfile.ZipFile(info.path) as z:
                z.extractall(site)
            proc = subprocess.run([sys.executable, "-m", "sglang_ext", "patches", "apply", "--series",
                                   str(series_dir), "--target", str(site)],
                                  cwd=REPO, capture_output=True, text=True)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            made[series_dir] = site
        return made[series_dir]

    return get


@pytest.fixture(scope="session")
def tiny_models_built(tmp_path_factory) -> dict:
    """The GPU suite's tiny ``deepseek`` and ``kimi`` (testing/tiny_models.py), built on
    the CPU once per session: name -> tiny_models.TinyModel (~10 s each)."""
    from testing import tiny_models

    workdir = str(tmp_path_factory.mktemp("tiny-models"))
    return {name: tiny_models.build(tiny_models.MODELS[name], workdir) for name in ("deepseek", "kimi")}


@pytest.fixture(scope="session")
def pristine(wheel, tmp_path_factory) -> Path:
    """One checkout built by the tool; tests clone it rather than modify it."""
    from sglang_ext.tools.patchtool.wheel import create_checkout

    dest = tmp_path_factory.mktemp("pristine") / "sglang"
    create_checkout(wheel, dest)
    return dest


def assert_rows_ready_at_hook(batch_result_processor: Path) -> None:
    """The invariant behind ``copy_rows(..., ready=True)`` in
    ``DumpSession.on_prefill_result``: in the patched ``process_batch_result_prefill``,
    ``result.copy_done.synchronize()`` (the event SGLang records after the forward, before
    its own device-to-host copies) runs before our hook, so the rows the hook copies are
    complete on the GPU; and it is called once, before the batch's outputs are streamed
    (the response carries the path it records)."""
    text = batch_result_processor.read_text()
    start = text.index("    def process_batch_result_prefill(")
    end = text.find("\n    def ", start + 1)
    body = text[start:end if end > 0 else len(text)]
    sync = body.find("result.copy_done.synchronize()")
    hook = body.find("dump_hooks.on_prefill_result(")
    assert hook > 0, "the hook call is not in process_batch_result_prefill"
    assert 0 < sync < hook, "copy_done is no longer synchronized before the hook"
    assert body.count("dump_hooks.") == 1, "the hook is not one call"
    streamed = body.find("self.output_streamer.stream_output(")
    assert hook < streamed, "the hook is no longer before the batch's outputs are streamed"


def assert_warmup_named_before_post(http_server) -> None:
    """In a patched ``http_server.py``: ``_execute_server_warmup`` passes its body through
    ``dump_hooks.warmup_request`` after the last change to ``json_data`` and before the
    warm-up POST (``requests.post``), so the rid is on the body SGLang sends. Called by
    tests/tooling/test_patches.py (0.5.17) and tests/tooling/test_nightly.py (0.5.23) on the real wheel."""
    tree = ast.parse(Path(http_server).read_text())
    assert any(isinstance(n, ast.ImportFrom) and n.module == "sglang_ext"
               and [(a.name, a.asname) for a in n.names] == [("hooks", "dump_hooks")] for n in tree.body)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_execute_server_warmup")
    hook, changes, posts = [], [], []
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "dump_hooks.warmup_request":
            assert ast.unparse(node) == "dump_hooks.warmup_request(server_args, json_data)"
            hook.append(node.lineno)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "requests.post":
            posts.append(node.lineno)
        elif isinstance(node, ast.Assign) and any(ast.unparse(t).startswith("json_data") for t in node.targets):
            if "dump_hooks" not in ast.unparse(node.value):
                changes.append(node.lineno)
        elif isinstance(node, ast.Call) and ast.unparse(node.func).startswith("json_data."):
            changes.append(node.lineno)
    assert len(hook) == 1, f"{len(hook)} warmup_request calls in _execute_server_warmup"
    assert changes and max(changes) < hook[0], "json_data is changed after warmup_request"
    assert len(posts) == 1 and hook[0] < posts[0], "warmup_request is not before the warm-up POST"


@pytest.fixture
def dump_dir(tmp_path):
    """``(path, descriptor)`` of an empty dump directory opened with
    ``format.open_dump_dir`` (closed afterwards)."""
    from sglang_ext import format as fmt

    d = tmp_path / "hs"
    d.mkdir()
    fd = fmt.open_dump_dir(str(d))
    yield d, fd
    os.close(fd)


@pytest.fixture
def dump(tmp_path):
    """An empty dump directory, ``tmp_path / "hs"``."""
    d = tmp_path / "hs"
    d.mkdir()
    return d


class Sessions:
    """Dump sessions a test starts (``start``), closed by ``close`` (the ``sessions``
    fixture calls it after the test) so no writer process outlives its test."""

    def __init__(self):
        self.started = []

    def start(self, model_runner, output_rows: bool = False):
        """``DumpSession.start(model_runner, output_rows)``: what ``hooks.setup_model``
        would make (``output_rows``: as patch 0009 calls it)."""
        from sglang_ext.session import DumpSession

        session = DumpSession.start(model_runner, output_rows=output_rows)
        if session is not None:
            self.started.append(session)
        return session

    def close(self) -> None:
        while self.started:
            self.started.pop().close(timeout=10)


@pytest.fixture
def sessions(monkeypatch):
    """A ``Sessions``. The door's session (``hooks.setup_model``) is this test's too:
    hooks starts the test with none and is given back none; one made is closed."""
    from sglang_ext import hooks

    monkeypatch.setattr(hooks, "_SESSION", None)
    made = Sessions()
    yield made
    if hooks.session() is not None:
        made.started.append(hooks.session())
    made.close()


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A real ``mooncake_master`` for one test module (tests/mooncake_fixture.py)."""
    from mooncake_fixture import Master

    m = Master(tmp_path_factory.mktemp("mooncake"))
    yield m
    m.kill()
