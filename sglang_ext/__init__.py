"""kimi-sglang: hidden-state dumping for SGLang.

Modules, one job each (data flows top to bottom):

- ``config``   what to dump: directory, layer ids, host-memory cap (validated).
- ``hooks``    the only API SGLang's patched files call.
- ``writer``   device-to-host copies on a side stream, writer threads, backpressure.
- ``format``   the file contract: names, keys, metadata, atomic write, index, reader.
- ``trace``    stage timestamps of the path above, for profiling (KIMI_SGLANG_TRACE).
- ``patches``  the patch-series tooling (check / apply / checkout / export).
"""

__version__ = "0.1.0"
