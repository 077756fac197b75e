"""kimi-sglang: hidden-state dumping for SGLang.

Three products, one package:

- ``sglang_ext`` itself: the runtime SGLang's patched processes import.
  ``config`` (what to dump, validated), ``hooks`` (the only API the patches call),
  ``writer`` + ``writer_process`` (device-to-host copies, the writer process, backpressure),
  ``arena`` + ``wire`` (shared host memory, the messages between them), ``quant`` (fp8),
  ``format`` (the file contract: names, keys, metadata, atomic write, index, reader),
  ``metrics``, ``trace``, ``compat``.
- ``sglang_ext.client``: ``extract`` and ``convert``, run wherever the server is reachable.
- ``sglang_ext.tools``: the patch-series tooling and the container's entrypoint.

SGLang's processes import only the first; the other two import ``format`` and nothing else of it.
"""

__version__ = "0.1.0"
