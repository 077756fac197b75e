"""The GPU suite's fixtures, options and skip rules (see tests/gpu/README.md).

Fixtures, each built once per model (session) or per test module (server):
- ``model_name``: "llama", "deepseek" or "kimi" (parametrized; ``--models`` or ``-k`` picks;
  a module without it, test_gpu_vlm.py, runs only when ``--models`` names them all, the
  default);
- ``tiny_model``: the model built with random weights (tiny_models.TinyModel);
- ``reference``: HF's float32 forward of it on the GPU (reference.Reference; for ``kimi``,
  of its language model, a DeepseekV3 of the same weights);
- ``server_options`` (module-overridable, default TP=1) and ``server``: the patched server
  of this module and model (server.Server: ``.url``, ``.dump_dir``, ``.log_path``, ``.proc``);
- ``start_server``: a factory for a test's own extra server (stopped after the test).

Without CUDA, or without an importable SGLang carrying the kimi-sglang series, every test
here is collected and reported skipped with the reason; ``multi_gpu`` tests are skipped
when fewer GPUs than ``--tp`` are visible.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest

import record
from testing import tiny_models
from testing.server import ServerOptions, sglang_srt_dir
from testing.server import start_server as _start_server

MODEL_NAMES = tuple(tiny_models.MODELS)


def pytest_addoption(parser):
    group = parser.getgroup("kimi-sglang GPU suite")
    group.addoption("--models", default=",".join(MODEL_NAMES),
                    help=f"comma-separated tiny models to test (default: {','.join(MODEL_NAMES)})")
    group.addoption("--tp", type=int, default=2,
                    help="--tp-size of the multi_gpu tests' servers (needs that many GPUs; default 2)")
    group.addoption("--no-cuda-graph", action="store_true",
                    help="start the servers with --disable-cuda-graph (faster start-up, decode eager)")
    group.addoption("--server-log-dir", default=None, metavar="DIR",
                    help="where the servers' logs go (default: a pytest temporary directory)")
    record.add_option(group)
    group.addoption("--model-dir", default="/tmp/kimi-e2e-models", metavar="DIR",
                    help="where the tiny models are built (default: /tmp/kimi-e2e-models)")


def selected_models(config) -> list:
    """The ``--models`` list; a pytest.UsageError for a name that is not a tiny model."""
    names = [n.strip() for n in config.getoption("--models").split(",") if n.strip()]
    bad = [n for n in names if n not in tiny_models.MODELS]
    if bad or not names:
        what = f"unknown model(s) {bad}" if bad else "no model given"
        raise pytest.UsageError(f"--models: {what}; choose from {', '.join(MODEL_NAMES)}")
    return names


def pytest_configure(config):
    config.addinivalue_line("markers", "models(*names): the tiny models a GPU test runs on (default: all)")
    selected_models(config)  # a bad --models is a usage error before collection
    config._kimi_results = record.configure(config, environment=_environment)


def _environment() -> dict:
    try:
        import torch

        if torch.cuda.is_available():
            return {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count()}
    except Exception:  # noqa: BLE001 - the header says what it could not find
        pass
    return {"gpu": None, "gpus": 0}


def patched_sglang_reason():
    """None when SGLang is importable and carries the series (the file holding its server
    arguments knows --dump-hidden-states-dir: srt/server_args.py up to 0.5.17,
    srt/arg_groups/fields/exec_.py from 0.5.2x), else why not (one sentence). Reads source
    files only: importing SGLang here would be slow and could touch CUDA."""
    srt = sglang_srt_dir()
    if srt is None:
        return "SGLang is not importable (pip install sglang==<the series' base version>)"
    candidates = [os.path.join(srt, "arg_groups", "fields", "exec_.py"), os.path.join(srt, "server_args.py")]
    found = [c for c in candidates if os.path.exists(c)]
    if not found:
        return f"SGLang at {os.path.dirname(srt)} has neither srt/server_args.py nor srt/arg_groups"
    for path in found:
        with open(path, encoding="utf-8") as f:
            if "dump_hidden_states_dir" in f.read():
                return None
    return (f"SGLang at {os.path.dirname(srt)} is not patched "
            "(python -m sglang_ext patches apply --site-packages)")


def gpu_unavailable_reason():
    """None when this host can run the GPU suite, else why not (one sentence)."""
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        return f"torch is not importable ({type(e).__name__}: {e})"
    if not torch.cuda.is_available():
        return "CUDA is not available (torch.cuda.is_available() is False): the GPU suite needs an NVIDIA GPU"
    return patched_sglang_reason()


def pytest_generate_tests(metafunc):
    """Parametrize ``model_name`` over ``--models`` (session scope: each model is built,
    referenced and served in one stretch). ``@pytest.mark.models("llama", ...)`` on a test
    or module narrows it."""
    if "model_name" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("models")
        allowed = marker.args if marker else MODEL_NAMES
        names = [n for n in selected_models(metafunc.config) if n in allowed]
        metafunc.parametrize("model_name", names, ids=names, scope="session")


def pytest_collection_modifyitems(config, items):
    # a test whose models were all left out by --models has no model: deselected, not skipped
    unused = [it for it in items if "model_name" in getattr(it, "fixturenames", ())
              and getattr(getattr(it, "callspec", None), "params", {}).get("model_name") not in MODEL_NAMES]
    if set(selected_models(config)) != set(MODEL_NAMES):
        # a module without model_name (test_gpu_vlm.py, its own models) runs with every
        # tiny model only: a run narrowed by --models leaves it out (-k vlm picks it)
        unused += [it for it in items if "model_name" not in getattr(it, "fixturenames", ())]
    if unused:
        config.hook.pytest_deselected(items=unused)
        items[:] = [it for it in items if it not in unused]
    mine = [it for it in items if it.get_closest_marker("gpu")]
    if not mine:
        return
    reason = gpu_unavailable_reason()
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for it in mine:
            it.add_marker(skip)
        return
    import torch

    tp, have = config.getoption("--tp"), torch.cuda.device_count()
    if have < tp:
        skip = pytest.mark.skip(reason=f"needs {tp} GPUs (--tp {tp}), {have} visible")
        for it in mine:
            if it.get_closest_marker("multi_gpu"):
                it.add_marker(skip)


# ---- fixtures ------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_model(model_name, pytestconfig):
    """The model ``model_name`` built under --model-dir (tiny_models.TinyModel)."""
    workdir = pytestconfig.getoption("--model-dir")
    os.makedirs(workdir, exist_ok=True)
    return tiny_models.build(tiny_models.MODELS[model_name], workdir)


@pytest.fixture(scope="session")
def reference(tiny_model):
    """HF's float32 forward of ``tiny_model`` (its ``reference_path``) on the GPU:
    ``reference(ids, layer_ids)``."""
    import torch

    from testing.reference import Reference

    ref = Reference(tiny_model.reference_path, device="cuda")
    yield ref
    ref.close()
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def server_log_dir(pytestconfig, tmp_path_factory):
    path = pytestconfig.getoption("--server-log-dir") or str(tmp_path_factory.mktemp("server-logs"))
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def server_options(pytestconfig):
    """The flags of this module's server; a module overrides this fixture for others
    (test_gpu_parallel.py: --tp N)."""
    return ServerOptions(cuda_graph=not pytestconfig.getoption("--no-cuda-graph"))


def _launch(request, tiny_model, options, log_dir, group, env=None):
    name = f"{tiny_model.name}-{group}-{options.tag}"
    launcher = options.launcher or tiny_model.spec.launcher
    srv = _start_server(tiny_model.path, f"/dev/shm/hs-{name}", tiny_model.spec.layers_flag, launcher,
                        os.path.join(log_dir, f"server-{name}.log"), options, env=env)
    plugin = getattr(request.config, "_kimi_results", None)
    if plugin is not None:
        plugin.servers.append({"name": name, "startup_s": srv.startup_s, "command": srv.command,
                               "entrypoint_command": srv.printed})
    return srv


@pytest.fixture(scope="module")
def server(request, tiny_model, server_options, server_log_dir):
    """The patched server of this test module and model, started once for the module
    (server.Server), with the module's ``SERVER_ENV`` (a dict) added to its environment. A
    test that ends it (SIGTERM) must be the module's last for that model."""
    group = request.module.__name__.replace("test_gpu_", "")
    srv = _launch(request, tiny_model, server_options, server_log_dir, group,
                  getattr(request.module, "SERVER_ENV", None))
    yield srv
    srv.stop()


@pytest.fixture
def start_server(request, tiny_model, server_log_dir):
    """A factory ``start_server(options=ServerOptions(...), tag="x", env=None) -> Server``
    for a test's own server on ``tiny_model``; every server it started is stopped after the
    test. The module's ``server`` must be stopped first when both would not fit (same port)."""
    started = []

    def start(options: ServerOptions = ServerOptions(), tag: str = "extra", env=None):
        srv = _launch(request, tiny_model, options, server_log_dir, tag, env)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.stop()


@pytest.fixture
def rng(request):
    """A random.Random seeded from the test's name (same prompts every run)."""
    return random.Random(f"1234:{request.node.name}")


@pytest.fixture
def scratch_dir(tmp_path):
    """An empty directory in /dev/shm when there is one (clients write many files), else
    under tmp_path; removed after the test."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)
    path = os.path.join(base, f"kimi-gpu-{os.getpid()}-{tmp_path.name}")
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    yield path
    shutil.rmtree(path, ignore_errors=True)
