"""A stand-in for ``python -m sglang.launch_server`` that lets tests/benchmark/test_bench.py rehearse
the bench's orchestration (``python -m bench``) on a CPU: the same flags, /health and /generate with
``input_ids``, and for the modes the benchmark uses:

- ``--dump-hidden-states-dir DIR``: writes one safetensors file per request by hand (an
  8-byte header length, the JSON header, the bytes), hidden_states BF16
  ``[T, len(layers), 64]`` (``hidden_rows``: a value per token id and layer slot, which
  tests/fake_vllm_server.py writes too; fp8 files hold zeros), under the name the patched
  server gives the request's rid (``format.reserve``: its ``.lock`` held until the file is
  renamed into place, ``format.complete``), and answers ``meta_info.hidden_states_path``;
  logs a 'hidden-state dump: {...}' snapshot line as sglang_ext's writer does. A request with
  ``custom_params {"hidden_states_wait": false}`` is answered at once with
  ``hidden_states_pending: true``; the file follows 50 ms later, then the lock goes, as
  sglang_ext.format's protocol says. A request with ``custom_params {"hidden_states_dump":
  false}`` is not dumped. With ``KIMI_SGLANG_TRACE`` set, each file's ``file`` event
  (sglang_ext/trace.py) is recorded as the writer records it. (``sglang-ext standin`` is the
  documented one for trying ``extract``.)
- ``--enable-return-hidden-states`` and ``return_hidden_states: true``: answers
  ``meta_info.hidden_states`` as a ``[T, 8]`` nested list.
- ``sampling_params.max_new_tokens`` G (default 1): ``output_ids`` of G ids (``generated``:
  from the prompt's sum, no model), 1 ms of "decode" per token; with ``custom_params
  {"hidden_states_output": true}`` the file holds the prompt's rows then every generated id's
  but the last, ``num_prompt_tokens`` and ``last_token_id`` in its metadata
  (``sglang_ext.format.output``), for the bench's generate modes (bench/gen.py).

It checks nothing about models; it is not SGLang.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import threading
import time
import uuid
from http.server import ThreadingHTTPServer

from sglang_ext import format as fmt
from sglang_ext import trace
from sglang_ext.tools.standin import JsonReplyHandler

HIDDEN = 64


def hidden_rows(ids, slots, hidden=HIDDEN):
    """The bytes of a BF16 ``[len(ids), slots, hidden]`` block whose row (token t, slot l)
    holds ``((ids[t] % 61) + 1) * (l + 1) / 64`` (bf16: the float32's upper half)."""
    rows = {}
    out = []
    for t in ids:
        for sl in range(slots):
            key = (t % 61, sl)
            if key not in rows:
                bits = struct.unpack("<I", struct.pack("<f", (key[0] + 1) * (sl + 1) / 64))[0] >> 16
                rows[key] = struct.pack("<H", bits) * hidden
            out.append(rows[key])
    return b"".join(out)


def generated(ids, n):
    """The ``n`` ids the fake "generates" after prompt ``ids`` (no model: a function of them)."""
    return [(sum(ids) + 7 * k) % 997 + 3 for k in range(n)]


class JsonHandler(JsonReplyHandler):
    """What both fake servers (this one and tests/fake_vllm_server.py) answer alike: the
    stand-in's HTTP/1.1 JSON replies (``reply``, TCP_NODELAY), ``GET /health``."""

    def do_GET(self):
        self.reply(200 if self.path == "/health" else 404, {})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--dump-hidden-states-dir")
    ap.add_argument("--dump-hidden-states-layers", default="2,4,5,8")
    ap.add_argument("--dump-hidden-states-max-host-mb", type=int, default=4096)
    ap.add_argument("--dump-hidden-states-dtype", default="auto")
    ap.add_argument("--enable-return-hidden-states", action="store_true")
    args, _ = ap.parse_known_args()
    layers = [int(x) for x in args.dump_hidden_states_layers.split(",")]
    lock = threading.Lock()
    state = {"n": 0, "bytes": 0, "peak": 0}

    dump_dir = os.path.abspath(args.dump_hidden_states_dir or ".")
    dir_fd = fmt.open_dump_dir(dump_dir) if args.dump_hidden_states_dir else None

    def dump(ids, rid, early=False, extra=None):
        t_submit = trace.now()
        res = fmt.reserve(dir_fd, rid)
        path = os.path.join(dump_dir, res.name)

        def finish():
            t_picked = trace.now()
            tmp = fmt.tmp_name("fake", 0)
            write(ids, os.path.join(dump_dir, tmp), extra)
            t_copied = trace.now()
            fmt.publish(dir_fd, tmp, res.name)
            t_written = trace.now()
            fmt.complete(res)
            if trace.enabled():  # the writer's file event (sglang_ext/trace.py), its stages
                trace.record("file", name=res.name, rows=len(ids), t_submit=t_submit, t_picked=t_picked,
                             t_copied=t_copied, t_written=t_written, t_released=trace.now())

        if early:
            def later():
                time.sleep(0.05)
                finish()

            threading.Thread(target=later, daemon=True).start()
            return path
        finish()
        return path

    def write(ids, path, extra=None):
        with lock:
            state["n"] += 1
        t = len(ids)
        fp8 = args.dump_hidden_states_dtype == "fp8"  # sglang_ext.format's fp8 layout
        hs = t * len(layers) * HIDDEN * (1 if fp8 else 2)
        sc = 4 * t * len(layers) if fp8 else 0
        head = {"__metadata__": {"layer_ids": json.dumps(layers), **(extra or {})},
                "hidden_states": {"dtype": "F8_E4M3" if fp8 else "BF16",
                                  "shape": [t, len(layers), HIDDEN], "data_offsets": [0, hs]}}
        if fp8:
            head["__metadata__"].update(hidden_states_dtype="float8_e4m3fn",
                                        scale_layout="per_token_per_layer")
            head["hidden_states_scales"] = {"dtype": "F32", "shape": [t, len(layers), 1],
                                            "data_offsets": [hs, hs + sc]}
        head["token_ids"] = {"dtype": "I64", "shape": [t], "data_offsets": [hs + sc, hs + sc + 8 * t]}
        header = json.dumps(head).encode()
        with open(path, "wb") as f:
            data = bytes(hs + sc) if fp8 else hidden_rows(ids, len(layers))
            f.write(struct.pack("<Q", len(header)) + header + data + struct.pack(f"<{t}q", *ids))
        with lock:
            state["bytes"] += os.path.getsize(path)
            state["peak"] = max(state["peak"], hs)
        print("hidden-state dump: " + repr({"files_written": state["n"], "bytes_written": state["bytes"],
                                            "host_bytes_peak": state["peak"]}), flush=True)
        return path

    class Handler(JsonHandler):
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            self._generate(req, req["input_ids"])

        def _generate(self, req, ids):
            sampling = req.get("sampling_params") or {}
            out = generated(ids, sampling.get("max_new_tokens", 1))
            if len(out) > 1:
                time.sleep(0.001 * len(out))
            meta = {"prompt_tokens": len(ids), "completion_tokens": len(out)}
            if req.get("return_hidden_states"):
                if not args.enable_return_hidden_states:
                    return self.reply(400, {"error": "return_hidden_states is off"})
                meta["hidden_states"] = [[[0.125] * 8 for _ in ids]]
            params = sampling.get("custom_params") or {}
            if args.dump_hidden_states_dir and params.get("hidden_states_dump") is not False:
                early = params.get("hidden_states_wait") is False
                rows, extra = ids, None
                if params.get(fmt.OUTPUT_PARAM) is True:
                    rows, extra = fmt.fed_token_ids(ids, out), fmt.output_metadata(len(ids), out[-1])
                meta["hidden_states_path"] = dump(rows, req.get("rid") or uuid.uuid4().hex, early, extra)
                if early:
                    meta["hidden_states_pending"] = True
            self.reply(200, {"output_ids": out, "meta_info": meta})

    print("Memory pool end. avail mem=1.00 GB", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
