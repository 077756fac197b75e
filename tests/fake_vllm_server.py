"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` that lets
tests/benchmark/test_bench.py rehearse the benchmark's peer modes (bench/peer.py) on a CPU: the
flags the benchmark passes, ``/health``, and ``/v1/completions`` with token ids as
``prompt``; it prints vLLM 0.33's start-up lines the benchmark reads (its version, "init
engine (profile, create kv cache, ...)").

With ``--kv-transfer-config`` (``shared_storage_path``) and ``--speculative-config``
(``eagle_aux_hidden_state_layer_ids``) it behaves as vLLM's ExampleHiddenStatesConnector
does: ``<dir>/<request id>.safetensors.lock`` is created and held with an exclusive flock
before the answer (``kv_transfer_params.hidden_states_path``) goes out, the file follows
30 ms later, written by hand in vLLM's layout (hidden_states BF16 ``[T, len(ids), 64]``
with tests/fake_sglang_server.py's values, token_ids I64 ``[T]``, no metadata), then the
lock is released and its file left behind.

It checks nothing about models; it is not vLLM.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import struct
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from fake_sglang_server import HIDDEN, JsonHandler, hidden_rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--speculative-config", type=json.loads, default=None)
    ap.add_argument("--kv-transfer-config", type=json.loads, default=None)
    args, _ = ap.parse_known_args()
    served = args.served_model_name or args.model
    storage = None
    slots = 0
    if args.kv_transfer_config:
        storage = args.kv_transfer_config["kv_connector_extra_config"]["shared_storage_path"]
        hf = args.speculative_config["draft_model_config"]["hf_config"]
        slots = len(hf["eagle_aux_hidden_state_layer_ids"])
    lock = threading.Lock()
    state = {"n": 0}

    def dump(ids, req_id):
        path = os.path.join(storage, f"{req_id}.safetensors")
        fd = os.open(path + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX)

        def later():
            time.sleep(0.03)
            t = len(ids)
            hs = t * slots * HIDDEN * 2
            head = json.dumps({"hidden_states": {"dtype": "BF16", "shape": [t, slots, HIDDEN], "data_offsets": [0, hs]},
                               "token_ids": {"dtype": "I64", "shape": [t], "data_offsets": [hs, hs + 8 * t]}}).encode()
            with open(path, "wb") as f:
                f.write(struct.pack("<Q", len(head)) + head + hidden_rows(ids, slots) + struct.pack(f"<{t}q", *ids))
            os.close(fd)  # releases the lock; the lock file stays, as vLLM's

        threading.Thread(target=later, daemon=True).start()
        return path

    class Handler(JsonHandler):
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path != "/v1/completions":
                return self.reply(404, {"error": f"no route {self.path}"})
            ids = req.get("prompt")
            if not isinstance(ids, list) or req.get("model") not in (None, served):
                return self.reply(400, {"error": "prompt must be token ids; model must be the served one"})
            with lock:
                state["n"] += 1
                req_id = f"cmpl-{state['n']:08x}-0"
            body = {"id": req_id, "object": "text_completion", "model": served,
                    "choices": [{"index": 0, "text": "", "finish_reason": "length",
                                 "prompt_token_ids": ids if req.get("return_token_ids") else None,
                                 "token_ids": [1] if req.get("return_token_ids") else None}],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1},
                    "kv_transfer_params": {"hidden_states_path": dump(ids, req_id)} if storage else None}
            self.reply(200, body)

    print(f"vLLM server version 0.33.0+fake, serving model {args.model}", flush=True)
    print("init engine (profile, create kv cache, warmup model) took 0.01 seconds", flush=True)
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    sys.exit(main())
