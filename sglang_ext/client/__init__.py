"""The client: runs anywhere a dumping server is reachable, never inside SGLang.

Commands (each ``add_parser`` + ``main``, run as ``sglang-ext <command>``):

- ``extract``  send a dataset to a dumping server; collect ``hs_<i>.safetensors`` + manifest.
- ``convert``  rewrite those files for another trainer (SpecForge).

Their parts, each importing only those listed before it (no cycle):

- ``files``    create, check and remove files safely (``Staged``: temporary name, then rename).
- ``images``   rows whose messages hold images: their parts checked, the chat request shaped.
- ``dataset``  DATA's rows (JSONL or a ``datasets`` folder); ``DataError``.
- ``checks``   a hidden-state file against its request (``check_file``).
- ``pending``  the journal of server files a run still owns (resume, cleanup).
- ``manifest`` OUT: ``hs_<i>`` names, ``manifest.jsonl``, what a rerun keeps.
- ``dumpdir``  the server's dump directory; moving its file to ``OUT/hs_<i>``.
- ``http``     the health probe, ``POST /generate`` and ``/v1/chat/completions``, retry
               delays, the request errors.
- ``fetch``    a Mooncake Store's samples (``--store``): wait, read, write ``hs_<i>``, remove;
               imported only with ``--store``.
- ``runner``   the asyncio run: workers, tries, retries, abort.
- ``extract_setup`` what ``extract`` checks and opens before its first row (flags, paths,
               DATA, the server's health, --out, the store); ``BadInput``, ``CannotStart``.
- ``convert_inputs`` what ``convert`` reads besides the files: ``--model``'s final norm,
               ``--loss-mask-from``'s masks, the manifest's image rows.

It reads the server's files through ``sglang_ext.format`` only (and the store's objects
through ``sglang_ext.store``'s config and layout); nothing here is imported
by SGLang's processes.
"""
