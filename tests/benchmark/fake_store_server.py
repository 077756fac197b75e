"""A stand-in for ``python -m sglang.launch_server`` with a store sink, for the bench's
store modes on a CPU (tests/benchmark/test_bench_store.py): ``--dump-hidden-states-dir
mooncake://...`` answers ``/generate`` as sglang_ext's store sink does (at once, with the
version-1 manifest of a bf16 ``[T, 4, 8]`` sample under a new handle, docs/store.md) and
puts the sample into that master ``DELAY_S`` later through a ``StoreClient`` that lends no
memory; under ``KIMI_SGLANG_TRACE`` it records the store writer's ``store`` event
(t_submit: the answer, t_written: the put's return). Any other dump target: it is
tests/fake_sglang_server.py. It checks nothing about models; it is not SGLang.
"""

from __future__ import annotations

import json
import runpy
import struct
import sys
import threading
import time
from http.server import ThreadingHTTPServer

DELAY_S = 0.15  # the put comes this long after the answer
MiB = 1 << 20


class StandIn:
    """The HTTP server on ``port`` (0: a free one; ``self.port``). ``answered``/``put``:
    handle -> ``time.monotonic()`` of the answer / the put's return; ``fail``: request
    numbers (from 1) whose sample is an error marker instead."""

    def __init__(self, master_address: str, port: int = 0, delay: float = DELAY_S):
        from fake_sglang_server import JsonHandler
        from sglang_ext import store, store_client

        self.store, self.delay = store, delay
        self.producer = store_client.StoreClient(store.StoreConfig(master_address, global_segment_size=0,
                                                          local_buffer_size=16 * MiB, local_hostname="127.0.0.1"))
        self.producer.connect()
        self.answered, self.put, self.n, self.lock = {}, {}, 0, threading.Lock()
        self.fail = set()
        stand_in = self

        class Handler(JsonHandler):
            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                meta = {"prompt_tokens": len(req["input_ids"]), "completion_tokens": 1,
                        "hidden_states_manifest": stand_in.answer(req["input_ids"])}
                self.reply(200, {"meta_info": meta})

        self.http = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.http.server_address[1]
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def answer(self, ids):
        from sglang_ext import trace

        with self.lock:
            self.n += 1
            n = self.n
        handle = self.store.unique_handle(f"bench-{n}")
        layout = self.store.pack_layout(len(ids), 4, 8, "bfloat16")
        data = {"hidden_states": [bytes(len(ids) * 4 * 8 * 2)], "token_ids": [struct.pack(f"<{len(ids)}q", *ids)]}
        t_submit = trace.now()

        def later():
            time.sleep(self.delay)
            t_picked = trace.now()
            if n in self.fail:
                self.producer.put_error(handle, f"request {n} failed on purpose")
            else:
                self.producer.put_packed(handle, layout, data)
            self.put[handle] = t_written = trace.now()
            trace.record("store", name=handle, t_submit=t_submit, t_picked=t_picked, t_written=t_written)

        self.answered[handle] = t_submit
        threading.Thread(target=later, daemon=True).start()
        return layout.manifest(handle)

    def close(self):
        self.http.shutdown()
        self.http.server_close()
        self.producer.close()


def main():
    argv = sys.argv[1:]
    target = argv[argv.index("--dump-hidden-states-dir") + 1] if "--dump-hidden-states-dir" in argv else ""
    if not target.startswith("mooncake://"):
        runpy.run_module("fake_sglang_server", run_name="__main__")
        return
    from sglang_ext import store

    StandIn(store.StoreConfig.from_url(target).master_server_address, int(argv[argv.index("--port") + 1]))
    print("The server is fired up and ready to roll!", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
