"""The patched SGLang server of the GPU suite: its command line, start (until /health
answers), stop, and the HTTP calls the tests make.

One launcher for every test: ``python -m sglang.launch_server`` as upstream documents it,
or the container's entrypoint (``python -m sglang_ext.entrypoint``, profiles applied), with
the flags the suite's tolerances were set for (triton attention, pytorch sampling,
chunked prefill of ``CHUNK`` tokens)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

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


def server_command(model_path: str, dump_dir: str, layers: Optional[str], launcher: str,
                   options: ServerOptions = ServerOptions(), port: int = PORT,
                   python: str = sys.executable) -> List[str]:
    """The argv that starts the server. ``launcher``: "direct" or "entrypoint"; a model
    directory without ``tokenizer.json`` is served with --skip-tokenizer-init, one that
    ships code (a ``.py`` file: the tiny Kimi's processor) with --trust-remote-code.
    Raises ValueError for an unknown launcher or tp < 1."""
    if launcher not in ("direct", "entrypoint"):
        raise ValueError(f"launcher must be 'direct' or 'entrypoint', not {launcher!r}")
    if options.tp < 1:
        raise ValueError(f"tp must be >= 1, not {options.tp}")
    module = "sglang.launch_server" if launcher == "direct" else "sglang_ext.entrypoint"
    cmd = [python, "-m", module, "--model-path", model_path,
           "--attention-backend", "triton", "--sampling-backend", "pytorch",
           "--port", str(port), "--mem-fraction-static", "0.3", "--chunked-prefill-size", str(CHUNK),
           "--cuda-graph-max-bs", "8", "--enable-metrics", "--dump-hidden-states-dir", dump_dir]
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
    if layers:
        cmd += ["--dump-hidden-states-layers", layers]
    if options.dump_dtype:
        cmd += ["--dump-hidden-states-dtype", options.dump_dtype]
    return cmd


@dataclass
class Server:
    """A running server: ``url`` (http://127.0.0.1:PORT), ``dump_dir``, ``log_path``,
    ``proc`` (its Popen, the leader of its own process group), ``startup_s``,
    ``command``; ``printed`` is the entrypoint's --print-command output (None for
    "direct"); ``answered`` collects the file names responses named (the core group's
    index check)."""

    url: str
    dump_dir: str
    log_path: str
    proc: subprocess.Popen
    startup_s: float
    command: List[str]
    printed: Optional[str] = None
    answered: set = field(default_factory=set)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL after 30 s; also reaps schedulers a main
        process left behind. Idempotent."""
        for sig, wait_s in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break  # nothing of the group is left
            try:
                self.proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                pass

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    # ---- HTTP ---------------------------------------------------------------------
    def post(self, body: dict, timeout: float = 300, path: str = "/generate"):
        """POST ``body`` as JSON; returns the ``requests.Response`` (any status)."""
        import requests

        return requests.post(self.url + path, json=body, timeout=timeout)

    def generate(self, ids, max_new_tokens: int = 1, rid: Optional[str] = None,
                 early: bool = False) -> dict:
        """/generate with ``input_ids`` at temperature 0; ``early``: answered once the
        file's name is reserved (sglang_ext.format.WAIT_PARAM). Raises
        requests.HTTPError on a non-2xx answer."""
        body = {"input_ids": list(ids), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        if early:
            body["sampling_params"]["custom_params"] = {"hidden_states_wait": False}
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


def start_server(model_path: str, dump_dir: str, layers: Optional[str], launcher: str,
                 log_path: str, options: ServerOptions = ServerOptions(), port: int = PORT,
                 env: Optional[dict] = None, timeout_s: float = STARTUP_TIMEOUT_S) -> Server:
    """Start the server and wait until /health answers 200. ``dump_dir`` is emptied and
    created; ``env``: extra environment variables. Raises RuntimeError (with the log's
    tail) when the process exits or does not come up within ``timeout_s``; the process
    group is killed then, so the port and GPU memory are free for the next server."""
    import shutil

    import requests

    shutil.rmtree(dump_dir, ignore_errors=True)
    os.makedirs(dump_dir)
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    cmd = server_command(model_path, dump_dir, layers, launcher, options, port)
    full_env = dict(os.environ, **(env or {}))
    printed = None
    if launcher == "entrypoint":
        shown = subprocess.run(cmd + ["--print-command"], capture_output=True, text=True, env=full_env)
        if shown.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} --print-command exited with {shown.returncode}: "
                               f"{shown.stderr[-1500:]}")
        printed = shown.stdout
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=full_env)
    server = Server(f"http://127.0.0.1:{port}", dump_dir, log_path, proc, 0.0, cmd, printed)
    t0 = time.time()
    try:
        while time.time() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} during start-up; "
                                   f"log {log_path}:\n{server.log_tail()}")
            try:
                if requests.get(f"{server.url}/health", timeout=2).status_code == 200:
                    server.startup_s = round(time.time() - t0, 1)
                    return server
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError(f"server did not come up in {timeout_s:.0f} s; log {log_path}:\n{server.log_tail()}")
    except BaseException:
        server.stop()
        raise
