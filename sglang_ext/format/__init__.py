"""The dump file contract: names, keys, metadata, atomic write, completion lock, index, reader.

One finished request gives one file ``<dump dir>/<name>.safetensors`` holding

- ``hidden_states``: ``[num_prompt_tokens, num_layers, hidden_size]``, the model dtype
  (bf16 for most checkpoints). Slot ``j`` is layer id ``layer_ids[j]``: the residual
  stream *entering* decoder layer ``k`` (what HF transformers' ``output_hidden_states[k]``
  holds), and id ``N`` (= num_hidden_layers) the last layer's output *before* the final
  norm. Layer ids are sorted ascending, so with the default ``[2, N//2, N-3, N]`` the
  last slot is what speculators' EAGLE-3/DFlash trainers read as the verifier's last
  hidden state (they apply the verifier's final norm to it themselves).
- ``token_ids``: ``[num_prompt_tokens]`` int64, the prompt's token ids.

With ``--dump-hidden-states-dtype fp8`` (``sglang_ext.quant``), ``hidden_states`` is
``float8_e4m3fn`` and ``hidden_states_scales`` float32 ``[T, L, 1]`` follows it (one
scale per token and layer slot; value = ``fp8 * scale``), and the metadata adds
``hidden_states_dtype`` (``float8_e4m3fn``) and ``scale_layout``
(``per_token_per_layer``): hs-connectors' ``FP8HiddenStatesConnector`` keys, which its
``FP8Transfer`` (speculators' ``--hidden-states-backend fp8``) dequantizes. ``load``
returns them as stored, or dequantized on request.

These are the keys and layout vLLM's hidden-states connector writes and speculators'
offline reader loads (``hs_<i>.safetensors``). ``__metadata__`` (str -> str) holds
``format``, ``rid``, ``layer_ids`` (JSON list), ``num_layers`` (of the model),
``model_path``, ``sglang_version``, ``sglang_ext_version`` and ``series``.

Writing (all relative to an open directory descriptor, so nothing follows a symlink
planted at a name or swapped in for the directory after start-up):

1. ``reserve()`` picks a name from the rid (``safe_stem``) that neither a finished file
   nor a write in flight holds, by creating ``<name>.safetensors.lock`` with
   ``O_CREAT|O_EXCL|O_NOFOLLOW`` and holding an exclusive ``flock`` on it. Its cost does
   not grow with the number of earlier files of the rid (O(1) calls while one process
   names them, O(log n) after others took n names).
2. The writer process (``sglang_ext.writer_process``) writes the file under a temporary
   name (``tmp_name``: ``.kimi-<writer tag>-<key>-<random>.safetensors.tmp``) laid out
   by ``file_layout`` (``create_tmp``, ``pwrite_all``) and renames it to
   ``<name>.safetensors`` (``publish``): a reader never sees a partial file under the
   final name. Then one line goes to ``index.jsonl`` (``index_record``: ``rid``,
   ``file``, ``num_tokens``, ``bytes``, ``layer_ids``; ``append_index``), whole or not
   at all: under a ``flock`` on the index, a partial line an appender killed mid-write
   left is cut away first, and a write cut short (disk full) is truncated away and
   raised as ``OSError``. The lock file gets the line's offset first (its mark), so a
   file whose writer died is settled by reading one line (``indexed``), never the whole
   index. Past ``INDEX_PART_BYTES`` (64 MiB) the index is rotated to ``index-<k>.jsonl``
   (k = 1, 2, ...); ``read_index`` reads the parts in order, then ``index.jsonl``.
3. The lock file is unlinked and released (``complete``). On failure the temporary file
   is removed, ``<name>.safetensors.error`` receives the message, and the lock is
   released (``fail``). What a killed writer leaves (temporary files, unheld locks)
   ``clean_stale`` removes at the next start.

Every file created here (data, temporary, lock, error, index) gets mode ``file_mode()``:
0600 unless ``KIMI_SGLANG_FILE_MODE`` says otherwise (e.g. ``0640``), the umask applying
on top; a dump is not readable by other users by default. Every open of an entry in the
directory uses ``O_NOFOLLOW|O_NONBLOCK`` and accepts only a regular file
(``open_regular``): a FIFO, directory or socket planted at a name is refused with an
``OSError`` that says what was found, never waited on. Headers are read with
safetensors' 100 MB bound and parsed defensively (``read_header``): a crafted file is
``DumpFormatError``, never ``MemoryError`` or ``RecursionError``.

A client waits for a file by waiting on its lock (``wait_complete``): this is the
completion protocol of vLLM's hidden-states connector, which speculators' client uses.

The server answers a request once its file is complete, unless the request's
``sampling_params.custom_params`` holds ``{"hidden_states_wait": false}`` (``WAIT_PARAM``):
then it answers as soon as the name is reserved, with ``hidden_states_pending: true``
(``PENDING_KEY``), and the client waits on the lock itself, as ``sglang_ext.client.extract`` does,
sending its next prompt meanwhile. A request whose ``custom_params`` holds
``{"hidden_states_dump": false}`` (``DUMP_PARAM``) is not dumped: no file, no path.

The package holds one module per job, data flowing down this list: ``keys`` (every
spelled name), ``files`` (safe opens, the file mode), ``names`` (``safe_stem``,
``reserve``, temporary names), ``layout`` (tensors, metadata, the byte layout), ``write``
(the temporary file, ``publish``, ``clean_stale``), ``completion`` (the lock: ``complete``,
``fail``, ``wait_complete``), ``reader`` (``read_header``, ``load``), ``index``
(``index.jsonl``) and ``output`` (files with the generated tokens' rows:
``check_output_rows``). Each module's ``__all__`` is re-exported here, so ``from sglang_ext
import format as fmt; fmt.X`` names them all; setting ``fmt.X`` (a test's monkeypatch)
sets it in the module that owns ``X`` as well, as when ``format`` was one module.
"""

from __future__ import annotations

import sys
import types

from . import completion, files, index, keys, layout, names, output, reader, write
from .completion import *  # noqa: F401,F403
from .files import *  # noqa: F401,F403
from .index import *  # noqa: F401,F403
from .keys import *  # noqa: F401,F403
from .layout import *  # noqa: F401,F403
from .names import *  # noqa: F401,F403
from .output import *  # noqa: F401,F403
from .reader import *  # noqa: F401,F403
from .write import *  # noqa: F401,F403

_OWNER = {name: mod for mod in (keys, files, names, layout, write, completion, reader, index, output)
          for name in mod.__all__}


class _Package(types.ModuleType):
    """``fmt.X = value`` also sets ``X`` in the module that owns it (its callers there see it)."""

    def __setattr__(self, name, value):
        if name in _OWNER:
            setattr(_OWNER[name], name, value)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
