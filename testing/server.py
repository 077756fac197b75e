"""The patched SGLang server, one launcher for the GPU suite and the benchmark: its
command line, start (until /health answers), stop, and the HTTP calls the tests make.

- ``base_command`` and ``dump_flags``: the flags every server of both carries (triton
  attention and pytorch sampling: what the suite's tolerances were set for, and so what
  the benchmark measures) and the dump flags, spelled once.
- ``launch`` (returns at once), ``Server.wait_until`` / ``wait_healthy``, ``stop_all``:
  the process lifecycle (own process group, log file, start-up errors with the log's
  tail, SIGTERM then SIGKILL of the whole group). ``start_server`` is the suite's
  launch-and-wait.
- ``server_command``: the suite's server, ``python -m sglang.launch_server`` as upstream
  documents it or the container's entrypoint (``python -m sglang_ext.tools.entrypoint``,
  profiles applied), chunked prefill of ``CHUNK`` tokens.

bench/servers.py builds its own servers (A, B, C, D) from the same pieces."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, List, Optional

PORT = 30011
CHUNK = 256  # --chunked-prefill-size: the core cases straddle it (257, 700 tokens)
STARTUP_TIMEOUT_S = 420


@dataclass(frozen=True)
class ServerOptions:
    """Flags of one server beyond the model's: ``tp`` (--tp-size), ``dp_attention``
    (--dp-size tp --enable-dp-attention), ``cuda_graph`` (False: --disable-cuda-graph),
    ``launcher`` (None: the model's; "direct" or "entrypoint"), ``dump_dtype``
    (--dump-hidden-states-dtype; None: not passed, the model's dtype)."""

    tp: int = 1
    dp_attention: bool = False
    cuda_graph: bool = True
    launcher: Optional[str] = None
    dump_dtype: Optional[str] = None

    @property
    def tag(self) -> str:
        """Short name for directories and logs, e.g. ``tp2-dpattn``."""
        return (f"tp{self.tp}" + ("-dpattn" if self.dp_attention else "") + ("" if self.cuda_graph else "-eager")
                + (f"-{self.dump_dtype}" if self.dump_dtype else ""))


def base_command(module: str, model_path: str, port: int, mem_fraction: float = 0.3,
                 python: str = sys.executable) -> List[str]:
    """``python -m module --model-path ...`` with the flags every server of the suite and
    of the benchmark carries: triton attention, pytorch sampling, ``--port``,
    ``--mem-fraction-static``."""
    return [python, "-m", module, "--model-path", model_path,
            "--attention-backend", "triton", "--sampling-backend", "pytorch",
            "--port", str(port), "--mem-fraction-static", str(mem_fraction)]


def sglang_srt_dir() -> Optional[str]:
    """The installed SGLang's ``srt`` folder, found without importing SGLang (slow, and it
    may touch CUDA); None when SGLang is not importable."""
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "srt")


def cuda_graph_max_bs_flags(n: int) -> List[str]:
    """``--cuda-graph-max-bs N`` as the installed SGLang spells it: 0.5.22 split it into
    ``--cuda-graph-max-bs-decode`` and ``-prefill`` (defined in
    sglang/srt/arg_groups/cuda_graph_hook.py, which 0.5.17 lacks), and argparse then
    rejects the old name as an ambiguous prefix. Without an importable SGLang (the CPU
    tests' fake server): the old name."""
    srt = sglang_srt_dir()
    split = srt is not None and os.path.exists(os.path.join(srt, "arg_groups", "cuda_graph_hook.py"))
    return ["--cuda-graph-max-bs-decode" if split else "--cuda-graph-max-bs", str(n)]


def dump_flags(dump_dir: str, layers: Optional[str] = None, max_host_mb: Optional[int] = None,
               dtype: Optional[str] = None) -> List[str]:
    """The series' dump flags (patch 0001): ``--dump-hidden-states-dir`` and, when given,
    ``-layers`` (e.g. "1,3,4"), ``-max-host-mb`` and ``-dtype`` (auto, bf16, fp8)."""
    cmd = ["--dump-hidden-states-dir", dump_dir]
    if layers:
        cmd += ["--dump-hidden-states-layers", layers]
    if max_host_mb:
        cmd += ["--dump-hidden-states-max-host-mb", str(max_host_mb)]
    if dtype:
        cmd += ["--dump-hidden-states-dtype", dtype]
    return cmd


def server_command(model_path: str, dump_dir: str, layers: Optional[str], launcher: str,
                   options: ServerOptions = ServerOptions(), port: int = PORT,
                   python: str = sys.executable) -> List[str]:
    """The argv that starts the suite's server. ``launcher``: "direct" or "entrypoint"; a
    model directory without ``tokenizer.json`` is served with --skip-tokenizer-init, one
    that ships code (a ``.py`` file: the tiny Kimi's processor) with --trust-remote-code.
    Raises ValueError for an unknown launcher or tp < 1."""
    if launcher not in ("direct", "entrypoint"):
        raise ValueError(f"launcher must be 'direct' or 'entrypoint', not {launcher!r}")
    if options.tp < 1:
        raise ValueError(f"tp must be >= 1, not {options.tp}")
    module = "sglang.launch_server" if launcher == "direct" else "sglang_ext.tools.entrypoint"
    cmd = base_command(module, model_path, port, python=python) + [
        "--chunked-prefill-size", str(CHUNK), *cuda_graph_max_bs_flags(8), "--enable-metrics"]
    if not os.path.exists(os.path.join(model_path, "tokenizer.json")):
        cmd.append("--skip-tokenizer-init")
    if os.path.isdir(model_path) and any(name.endswith(".py") for name in os.listdir(model_path)):
        cmd.append("--trust-remote-code")
    if not options.cuda_graph:
        cmd.append("--disable-cuda-graph")
    if options.tp > 1:
        # SGLang 0.5.17 auto-enables FlashInfer's trtllm allreduce fusion on SM90 for
        # DeepseekV3; its workspace JIT can take the whole start-up budget.
        cmd += ["--tp-size", str(options.tp), "--enforce-disable-flashinfer-allreduce-fusion"]
    if options.dp_attention:
        cmd += ["--dp-size", str(options.tp), "--enable-dp-attention"]
    return cmd + dump_flags(dump_dir, layers, dtype=options.dump_dtype)


class ServerExited(RuntimeError):
    """The server's process exited while it was awaited; the message holds its log's tail."""


class StartupTimeout(RuntimeError):
    """The server did not get ready in time; the message holds its log's tail."""


@dataclass
class Server:
    """A running server: ``url`` (http://127.0.0.1:PORT), ``dump_dir``, ``log_path``,
    ``proc`` (its Popen, the leader of its own process group), ``startup_s``,
    ``command``; ``printed`` is the entrypoint's --print-command output (None for
    "direct"); ``answered`` collects the file names responses named (the core group's
    index check); ``t_launched``: ``time.monotonic()`` at launch."""

    url: str
    dump_dir: str
    log_path: str
    proc: subprocess.Popen
    startup_s: float
    command: List[str]
    printed: Optional[str] = None
    answered: set = field(default_factory=set)
    t_launched: float = field(default_factory=time.monotonic)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 30 s; also reaps schedulers a main
        process left behind. Idempotent."""
        stop_all([self])

    def healthy(self) -> bool:
        """Whether GET /health answers 200 (within 2 s)."""
        import requests

        try:
            return requests.get(f"{self.url}/health", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def wait_until(self, ready: Callable[[], bool], timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Poll ``ready()`` every 0.5 s until it is true. Raises ServerExited when the
        process exits first, StartupTimeout after ``timeout`` s (both with the log's tail)."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise ServerExited(f"server exited with {self.proc.returncode} during start-up; "
                                   f"log {self.log_path}:\n{self.log_tail()}")
            if ready():
                return
            time.sleep(0.5)
        raise StartupTimeout(f"server did not come up in {timeout:.0f} s; log {self.log_path}:\n"
                             f"{self.log_tail()}")

    def wait_healthy(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """``wait_until(healthy)``; the first time, ``startup_s`` becomes the time since
        launch."""
        self.wait_until(self.healthy, timeout)
        if not self.startup_s:
            self.startup_s = round(time.monotonic() - self.t_launched, 1)

    def log_text(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        """The log's last ``n`` lines, without the access-log lines of our own ``/health``
        polls (two a second while the server starts: they would fill the tail)."""
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join([ln for ln in f.readlines() if '"GET /health ' not in ln][-n:])
        except OSError:
            return ""

    # ---- HTTP ---------------------------------------------------------------------
    def post(self, body: dict, timeout: float = 300, path: str = "/generate"):
        """POST ``body`` as JSON; returns the ``requests.Response`` (any status)."""
        import requests

        return requests.post(self.url + path, json=body, timeout=timeout)

    def generate(self, ids, max_new_tokens: int = 1, rid: Optional[str] = None,
                 early: bool = False, dump: bool = True) -> dict:
        """/generate with ``input_ids`` at temperature 0; ``early``: answered once the
        file's name is reserved (sglang_ext.format.WAIT_PARAM); ``dump=False``: asks not
        to be dumped (format.DUMP_PARAM). Raises requests.HTTPError on a non-2xx answer."""
        body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        custom = {**({"hidden_states_wait": False} if early else {}),
                  **({} if dump else {"hidden_states_dump": False})}
        if custom:
            body["sampling_params"]["custom_params"] = custom
        if rid is not None:
            body["rid"] = rid
        r = self.post(body)
        r.raise_for_status()
        return r.json()

    def send_and_close(self, body: dict, after_s: float) -> None:
        """A client that sends a /generate request and closes the connection ``after_s``
        seconds later, without reading the answer."""
        data = json.dumps(body).encode()
        s = socket.create_connection(("127.0.0.1", self.port))
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(data) + data)
        time.sleep(after_s)
        s.close()


def launch(cmd: List[str], log_path: str, env: Optional[dict] = None, dump_dir: str = "",
           printed: Optional[str] = None) -> Server:
    """Start ``cmd`` (it carries ``--port``) in a process group of its own, stdout and
    stderr into ``log_path``, ``env`` added to the environment; returns at once (wait
    with ``Server.wait_healthy``, stop with ``Server.stop`` or ``stop_all``)."""
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    port = int(cmd[cmd.index("--port") + 1])
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, **(env or {})))
    return Server(f"http://127.0.0.1:{port}", dump_dir, log_path, proc, 0.0, cmd, printed)


def stop_all(servers: Iterable[Server], grace: float = 30.0, kill_wait: float = 10.0) -> None:
    """SIGTERM every server's process group at once, SIGKILL what is left of each group
    after ``grace`` s (schedulers a main process left behind too). Idempotent: a group
    with nothing left is skipped."""
    termed = []
    for s in servers:
        try:
            os.killpg(s.proc.pid, signal.SIGTERM)
            termed.append(s)
        except ProcessLookupError:
            pass  # nothing of the group is left
    deadline = time.monotonic() + grace
    for s in termed:
        try:
            s.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for s in termed:
        try:
            os.killpg(s.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        try:
            s.proc.wait(kill_wait)
        except subprocess.TimeoutExpired:
            pass


def start_server(model_path: str, dump_dir: str, layers: Optional[str], launcher: str,
                 log_path: str, options: ServerOptions = ServerOptions(), port: int = PORT,
                 env: Optional[dict] = None, timeout_s: float = STARTUP_TIMEOUT_S) -> Server:
    """Start the suite's server and wait until /health answers 200. ``dump_dir`` is
    emptied and created, unless it is a store address (``mooncake://...``, the store
    sink: nothing is made); ``env``: extra environment variables. Raises RuntimeError
    (ServerExited, StartupTimeout; with the log's tail) when the process exits or does not
    come up within ``timeout_s``; the process group is killed then, so the port and GPU
    memory are free for the next server."""
    import shutil

    if "://" not in dump_dir:
        shutil.rmtree(dump_dir, ignore_errors=True)
        os.makedirs(dump_dir)
    cmd = server_command(model_path, dump_dir, layers, launcher, options, port)
    printed = None
    if launcher == "entrypoint":
        shown = subprocess.run(cmd + ["--print-command"], capture_output=True, text=True,
                               env=dict(os.environ, **(env or {})))
        if shown.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} --print-command exited with {shown.returncode}: "
                               f"{shown.stderr[-1500:]}")
        printed = shown.stdout
    server = launch(cmd, log_path, env, dump_dir, printed)
    try:
        server.wait_healthy(timeout_s)
        return server
    except BaseException:
        server.stop()
        raise
