"""The tooling around the runtime: never imported by SGLang's processes.

- ``patches``     ``python -m sglang_ext patches``: check/apply/maintain the patch series
                  (the work is done in ``patchtool``).
- ``entrypoint``  the container's ``kimi-sglang`` command: SM120 defaults, then SGLang's
                  own ``launch_server``.
- ``standin``     ``python -m sglang_ext standin``: a stand-in server (no GPU, no model) that
                  writes files as the patched server does, for trying the client.
"""
