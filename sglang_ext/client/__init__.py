"""The client: runs anywhere a dumping server is reachable, never inside SGLang.

- ``extract``  send a dataset to a dumping server; collect ``hs_<i>.safetensors`` + manifest.
- ``convert``  rewrite those files for another trainer (SpecForge).
- ``pending``  the journal of server files a run still owns (resume, cleanup).

It reads the server's files through ``sglang_ext.format`` only; nothing here is imported
by SGLang's processes.
"""
