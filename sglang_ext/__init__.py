"""kimi-sglang: hidden-state dumping for SGLang.

Three products, one package:

- ``sglang_ext`` itself: the runtime SGLang's patched processes import.
  ``hooks`` (the door the patches call) over ``session`` (one scheduler's dump: capture,
  each request's rows) and ``responses`` (what an answer carries); ``config`` (validated
  settings); ``writer`` (device-to-host copies, backpressure, the writer process's life);
  ``writer_process`` (files) and ``store_writer`` (Mooncake Store objects), its two sinks
  (``sink``: what they share);
  ``arena`` + ``wire`` (shared host memory, the messages between them); ``quant`` (fp8);
  ``format`` (the file contract: names, keys, metadata, atomic write, index, reader);
  ``store`` (the store contract: handles, packed layout, manifest) and ``store_client``
  (the one Mooncake client, the sink's and ``extract --store``'s); ``metrics``, ``trace``,
  ``compat``.
- ``sglang_ext.client``: ``extract`` and ``convert``, run wherever the server is reachable.
- ``sglang_ext.tools``: the patch-series tooling, the container's entrypoint and the
  stand-in server for trying the client without a GPU.

SGLang's processes import only the first; the client imports ``format``, ``store`` and
``store_client`` of it.
"""

__version__ = "0.1.0"
